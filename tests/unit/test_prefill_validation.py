import pytest

from services.prefill_queue.validation import BadRequest, Limits, parse_completion, parse_native

LIM = Limits(model="bubbletea-gpt", vocab=256, max_prompt_tokens=8, default_timeout_s=60.0)


def test_openai_shape() -> None:
    p = parse_completion({"model": "bubbletea-gpt", "prompt": "hi", "max_tokens": 1, "logprobs": 2, "seed": 7}, LIM)
    assert p.tokens == (104, 105) and p.logprobs == 2 and p.seed == 7 and p.temperature == 1.0
    assert parse_completion({"model": "bubbletea-gpt", "prompt": ["hi"]}, LIM).tokens == (104, 105)
    assert parse_completion({"model": "bubbletea-gpt", "prompt": [1, 2, 3]}, LIM).tokens == (1, 2, 3)


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
        ({"model": "bubbletea-gpt", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
        ({"model": "bubbletea-gpt", "prompt": [1, 300]}, 400, "prompt", "token id 300 is outside"),
        ({"model": "bubbletea-gpt", "prompt": [1, True]}, 400, "prompt", "integer token ids"),
        ({"model": "bubbletea-gpt", "prompt": 5}, 400, "prompt", "must be a string or a list"),
        ({"model": "bubbletea-gpt", "prompt": "123456789"}, 400, "prompt", "9 tokens; this service accepts at most 8"),
        ({"model": "bubbletea-gpt", "prompt": "x", "max_tokens": 16}, 400, "max_tokens", "prefill only"),
        ({"model": "bubbletea-gpt", "prompt": "x", "max_tokens": "1"}, 400, "max_tokens", "must be an integer"),
        ({"model": "bubbletea-gpt", "prompt": "x", "stream": True}, 400, "stream", "streaming"),
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
