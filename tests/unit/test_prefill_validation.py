import pytest

from services.prefill_queue.validation import BadRequest, Limits, parse_completion, parse_native

LIM = Limits(model="bubbletea-gpt", vocab=256, max_prompt_tokens=8, default_timeout_s=60.0)


def test_openai_shape() -> None:
    c = parse_completion({"model": "bubbletea-gpt", "prompt": "hi", "max_tokens": 1, "logprobs": 2, "seed": 7}, LIM)
    (p,) = c.prompts
    assert p.tokens == (104, 105) and p.logprobs == 2 and p.seed == 7 and p.temperature == 1.0
    assert not c.stream and not c.include_usage and c.stop == ()
    assert parse_completion({"model": "bubbletea-gpt", "prompt": ["hi"]}, LIM).prompts[0].tokens == (104, 105)
    assert parse_completion({"model": "bubbletea-gpt", "prompt": [1, 2, 3]}, LIM).prompts[0].tokens == (1, 2, 3)


def test_a_list_of_prompts_is_one_choice_each() -> None:
    c = parse_completion({"prompt": ["hi", [1, 2], "x"], "temperature": 0}, LIM)
    assert [p.tokens for p in c.prompts] == [(104, 105), (1, 2), (120,)]
    assert all(p.temperature == 0.0 for p in c.prompts)


def test_what_vllm_bench_serve_sends_is_accepted() -> None:
    body = {
        "model": "bubbletea-gpt",
        "prompt": "hello",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 1,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    c = parse_completion(body, LIM)
    assert c.stream and c.include_usage and c.prompts[0].logprobs == 0


def test_neutral_values_and_honoured_fields_are_accepted() -> None:
    body = {
        "prompt": "x",
        "top_p": 1,
        "n": 1,
        "best_of": 1,
        "echo": False,
        "suffix": None,
        "logit_bias": {},
        "presence_penalty": 1.5,  # counts output tokens: none precede the first
        "frequency_penalty": -1,
        "stop": ["\n", "x"],
        "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": None},
    }
    assert parse_completion(body, LIM).stop == ("\n", "x")
    assert parse_completion({"prompt": "x", "stop": "end"}, LIM).stop == ("end",)


def test_null_means_the_default() -> None:
    nulls = {"max_tokens", "temperature", "top_p", "n", "best_of", "stream", "stream_options", "logprobs", "echo"}
    nulls |= {"stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "suffix"}
    nulls |= {"ignore_eos", "seed", "user", "kv_transfer_params"}
    c = parse_completion({"prompt": "x", **dict.fromkeys(nulls)}, LIM)
    (p,) = c.prompts
    assert (p.temperature, p.seed, p.logprobs, p.user, c.stream, c.stop) == (1.0, None, 0, "", False, ())


def test_native_shape_defaults() -> None:
    p = parse_native({"prompt": "abc", "deadline_ms": 1500}, LIM)
    assert p.model == "bubbletea-gpt" and p.temperature == 0.0 and p.timeout_s == 1.5


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ([1, 2], 400, None, "must be a JSON object"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
        ({"model": "bubbletea-gpt"}, 400, "prompt", "'prompt' is required"),
        ({"model": "bubbletea-gpt", "prompt": ""}, 400, "prompt", "empty"),
        ({"model": "bubbletea-gpt", "prompt": []}, 400, "prompt", "empty list"),
        ({"model": "bubbletea-gpt", "prompt": ["a", 1]}, 400, "prompt", "or a list of those"),
        ({"model": "bubbletea-gpt", "prompt": [1, 300]}, 400, "prompt", "token id 300 is outside"),
        ({"model": "bubbletea-gpt", "prompt": [1, True]}, 400, "prompt", "integer token ids"),
        ({"model": "bubbletea-gpt", "prompt": 5}, 400, "prompt", "must be a string or a list"),
        ({"model": "bubbletea-gpt", "prompt": "123456789"}, 400, "prompt", "9 tokens; this service accepts at most 8"),
        ({"model": "bubbletea-gpt", "prompt": "x", "max_tokens": 16}, 400, "max_tokens", "prefill only"),
        ({"model": "bubbletea-gpt", "prompt": "x", "max_tokens": "1"}, 400, "max_tokens", "must be an integer"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream", "must be a boolean"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x", "unknown field"),
        ({"prompt": "x", "top_p": 0.9}, 400, "top_p", "'top_p' must be 1"),
        ({"prompt": "x", "echo": True}, 400, "echo", "not supported"),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias", "not supported"),
        ({"prompt": "x", "best_of": 2}, 400, "best_of", "must be 1"),
        ({"prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty", "must be 1"),
        ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "between -2.0 and 2.0"),
        ({"prompt": "x", "stop": ["a", ""]}, 400, "stop", "non-empty"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"prompt": "x", "top_k": 5}, 400, "top_k", "unknown field 'top_k'"),
        (
            {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
            400,
            "kv_transfer_params.do_remote_prefill",
            "prefill side",
        ),
        ({"prompt": "x", "kv_transfer_params": {"block": 1}}, 400, "kv_transfer_params.block", "unknown field"),
        ({"prompt": ["x"] * 300}, 400, "prompt", "at most 256 prompts"),
        ({"model": "bubbletea-gpt", "prompt": "x", "n": 2}, 400, "n", "'n' must be 1"),
        ({"model": "bubbletea-gpt", "prompt": "x", "logprobs": 9}, 400, "logprobs", "between 0 and 5"),
        ({"model": "bubbletea-gpt", "prompt": "x", "temperature": -1}, 400, "temperature", "between 0.0 and 2.0"),
        ({"model": "bubbletea-gpt", "prompt": "x", "temperature": "hot"}, 400, "temperature", "finite number"),
        ({"model": "bubbletea-gpt", "prompt": "x", "seed": 1.5}, 400, "seed", "must be an integer"),
        ({"model": "bubbletea-gpt", "prompt": "x", "user": 3}, 400, "user", "must be a string"),
        ({"model": 3, "prompt": "x"}, 400, "model", "must be a string"),
    ],
)
def test_bad_completion_requests(body: object, status: int, param: str | None, text: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_completion(body, LIM)
    assert (err.value.status, err.value.param) == (status, param)
    assert text in err.value.message


def test_bad_native_deadline() -> None:
    with pytest.raises(BadRequest, match="'deadline_ms' must be between"):
        parse_native({"prompt": "x", "deadline_ms": 0}, LIM)


def test_the_openapi_schema_names_exactly_the_accepted_fields() -> None:
    from services.prefill_queue.openapi import spec
    from services.prefill_queue.validation import COMPLETION_FIELDS

    schema = spec("bubbletea-gpt", 8)["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    body = schema["application/json"]["schema"]
    assert set(body["properties"]) == COMPLETION_FIELDS and body["additionalProperties"] is False


def test_whole_completions_are_accepted_only_with_the_decoder_and_what_it_honours() -> None:
    from services.prefill_queue.validation import Limits, parse_completion

    prefill_only = Limits(model="m", vocab=256, max_prompt_tokens=64, default_timeout_s=5.0)
    decoding = Limits(model="m", vocab=256, max_prompt_tokens=64, default_timeout_s=5.0, max_tokens=32)
    with pytest.raises(BadRequest, match="prefill only"):
        parse_completion({"prompt": "x", "max_tokens": 8}, prefill_only)
    assert parse_completion({"prompt": "x", "max_tokens": 8, "stop": "\n"}, decoding).max_tokens == 8
    for body, field in (
        ({"prompt": "x", "max_tokens": 33}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 8, "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "max_tokens": 8, "presence_penalty": 0.5}, "presence_penalty"),
    ):
        with pytest.raises(BadRequest) as refused:
            parse_completion(body, decoding)
        assert refused.value.param == field and refused.value.status == 400
    assert parse_completion({"prompt": "x", "presence_penalty": 0.5}, decoding).max_tokens == 1  # honoured: no effect


def test_a_completion_must_fit_the_models_context() -> None:
    from services.prefill_queue.validation import Limits, parse_completion

    small = Limits(model="m", vocab=256, max_prompt_tokens=32, default_timeout_s=5.0, max_tokens=64, max_model_len=32)
    assert parse_completion({"prompt": "x" * 24, "max_tokens": 8}, small).max_tokens == 8
    with pytest.raises(BadRequest, match="context is 32 tokens: a prompt of 24 tokens leaves room for 8 more"):
        parse_completion({"prompt": "x" * 24, "max_tokens": 9}, small)


def test_a_request_may_name_its_own_ttft_objective() -> None:
    lim = Limits(model="bubbletea-gpt", vocab=256, max_prompt_tokens=8, default_timeout_s=60.0, default_objective_s=0.5)
    assert parse_completion({"prompt": "hi"}, lim).prompts[0].objective_s == 0.5  # the service's default
    assert parse_completion({"prompt": "hi", "ttft_objective_ms": None}, lim).prompts[0].objective_s == 0.5
    assert parse_completion({"prompt": "hi", "ttft_objective_ms": 250}, lim).prompts[0].objective_s == 0.25
    assert parse_native({"prompt": "hi", "ttft_objective_ms": 2000}, lim).objective_s == 2.0
    assert parse_completion({"prompt": "hi"}, LIM).prompts[0].objective_s is None  # no default: none
    for bad, text in ((0, "between 1.0 and"), ("fast", "a finite number")):
        with pytest.raises(BadRequest, match=text) as e:
            parse_completion({"prompt": "hi", "ttft_objective_ms": bad}, lim)
        assert e.value.status == 400 and e.value.param == "ttft_objective_ms"


def test_the_usage_says_where_each_prompt_was_computed() -> None:
    from services.prefill_queue.answers import usage
    from shared.wire import PrefillResult
    from shared.wire.status import PromptPlacement, RequestStatus

    bubbles = PrefillResult(id="a", status=RequestStatus.DONE, prompt_tokens=5)
    decoder = PrefillResult(id="b", status=RequestStatus.DONE, prompt_tokens=7, placement=PromptPlacement.DECODER)
    u = usage([bubbles, decoder])
    assert u["prompt_tokens"] == 12 and u["completion_tokens"] == 2
    assert u["prompt_tokens_details"] == {"bubble_tokens": 5, "decoder_tokens": 7}
