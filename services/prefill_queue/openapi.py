"""The OpenAPI description of the prefill API, served at /openapi.json.

Tested by: tests/unit/test_prefill_validation.py, tests/unit/test_chat_request.py."""

from __future__ import annotations

from typing import Any

_PROMPT = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}
#: /v1/completions also takes a list of prompts (one choice each).
_PROMPTS = {"oneOf": [*_PROMPT["oneOf"], {"type": "array", "items": _PROMPT, "minItems": 1, "maxItems": 256}]}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
_KV = {
    "type": "object",
    "description": "Where the KV cache is kept, for a decode service",
    "properties": {
        "store": {"type": "string", "enum": ["plane", "redis", "none"]},
        "holder": {"type": "string", "description": "store plane: the worker holding it in memory"},
        "key": {"type": ["string", "null"]},
        "bytes": {"type": "integer"},
        "expires_at": {"type": "number"},
    },
}


def _err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": _ERROR}}}


def _completion_properties(model: str) -> dict[str, Any]:
    """The fields of a /v1/completions body (`validation.COMPLETION_FIELDS`)."""
    return {
        "model": {"type": "string", "enum": [model]},
        "prompt": _PROMPTS,
        "max_tokens": {"type": ["integer", "null"], "enum": [1, None], "default": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "enum": [1, None]},
        "n": {"type": ["integer", "null"], "enum": [1, None]},
        "best_of": {"type": ["integer", "null"], "enum": [1, None]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {
                "include_usage": {"type": "boolean"},
                "continuous_usage_stats": {"type": "boolean"},
            },
        },
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
        "echo": {"type": ["boolean", "null"], "enum": [False, None]},
        "stop": {
            "oneOf": [
                {"type": "null"},
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": 4,
                },
            ]
        },
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": ["number", "null"], "enum": [1, None]},
        "logit_bias": {"type": ["object", "null"], "maxProperties": 0},
        "suffix": {"type": ["string", "null"], "enum": ["", None]},
        "ignore_eos": {"type": ["boolean", "null"]},
        "return_token_ids": {"type": ["boolean", "null"]},
        "seed": {"type": ["integer", "null"]},
        "user": {"type": ["string", "null"]},
        "kv_transfer_params": {"type": ["object", "null"]},
        "ttft_objective_ms": {"type": ["number", "null"], "minimum": 1},
    }


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "additionalProperties": False,
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "additionalProperties": False,
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1}]},
        "name": {"type": ["string", "null"]},
    },
}


def _chat_path(model: str, max_prompt_tokens: int, errors: dict[str, Any]) -> dict[str, Any]:
    """/v1/chat/completions: the fields it shares with /v1/completions, the messages, chat logprobs."""
    shared = {k: v for k, v in _completion_properties(model).items() if k not in _COMPLETION_ONLY}
    length = shared["max_tokens"]
    properties = {
        **shared,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": length,
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    }
    body = {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": properties}
    return {
        "post": {
            "summary": "OpenAI-compatible chat completion: the messages rendered with the model's chat template, "
            "then answered as /v1/completions answers that prompt (400 for a model without a chat template)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": f"The assistant's message (rendered prompts of at most {max_prompt_tokens} "
                    "tokens) with kv_transfer_params; with stream, server-sent chat.completion.chunk events, "
                    "usage if asked, [DONE]"
                },
                "504": _err("No result in time; the request stays queued"),
                **errors,
            },
        }
    }


#: /v1/completions' fields a chat request does not take (its prompt is its messages).
_COMPLETION_ONLY = frozenset({"prompt", "best_of", "echo", "suffix", "return_token_ids", "logprobs"})


def spec(model: str, max_prompt_tokens: int) -> dict[str, Any]:
    errors = {
        "400": _err("Invalid request (the message names the field)"),
        "401": _err("Missing or wrong API key"),
        "404": _err("Unknown model"),
        "413": _err("Body too large"),
        "415": _err("The body is not sent as application/json"),
        "429": _err("Queue full; see Retry-After"),
        "503": _err("Not serving now (training not running); see Retry-After"),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "BubbleTea prefill API",
            "version": "1",
            "description": "Prefill-as-a-service: the prompt phase of LLM inference, computed in the idle "
            "bubbles of pipeline-parallel training. Returns the first token and a KV cache handle.",
        },
        "paths": {
            "/v1/completions": {
                "post": {
                    "summary": "OpenAI-compatible completion, prefill only (max_tokens must be 1)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["prompt"],
                                    "additionalProperties": False,
                                    "properties": _completion_properties(model),
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": f"The first token per prompt (prompts of at most {max_prompt_tokens} "
                            "tokens); with stream, server-sent events: a chunk per prompt, usage if asked, [DONE]"
                        },
                        "504": _err("No result in time; the request stays queued"),
                        **errors,
                    },
                }
            },
            "/v1/chat/completions": _chat_path(model, max_prompt_tokens, errors),
            "/v1/prefill": {
                "post": {
                    "summary": "Submit a prefill; answers 202 with an id at once",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string", "maxLength": 200},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["prompt"],
                                    "properties": {
                                        "prompt": _PROMPT,
                                        "model": {"type": "string", "enum": [model]},
                                        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 0},
                                        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
                                        "seed": {"type": ["integer", "null"]},
                                        "deadline_ms": {"type": "number", "minimum": 1},
                                        "ttft_objective_ms": {"type": ["number", "null"], "minimum": 1},
                                        "user": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "202": {"description": "Queued: {id, status}"},
                        "200": {"description": "Same Idempotency-Key as an earlier request: its id"},
                        **errors,
                    },
                }
            },
            "/v1/prefill/{id}": {
                "get": {
                    "summary": "Status and result of a submitted prefill",
                    "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {
                        "200": {
                            "description": "queued | done (with result and kv_transfer_params) | failed",
                            "content": {
                                "application/json": {
                                    "schema": {"type": "object", "properties": {"kv_transfer_params": _KV}}
                                }
                            },
                        },
                        "404": _err("Unknown id"),
                    },
                }
            },
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {"description": "Model list"}}}},
            "/health": {
                "get": {
                    "summary": "200 when Redis answers",
                    "responses": {"200": {"description": "ok"}, "503": {"description": "down"}},
                }
            },
            "/ready": {
                "get": {
                    "summary": "200 when requests can be served (Redis and a dispatcher are up)",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
    }
