"""The HTTP front door for prefill requests (aiohttp).

The main flow of one request:

1. `__main__.py:main` -> `app.py:create_app`: routes, middlewares (request id, API key, JSON
   errors), the bus, the results consumer and the readiness gate, started and stopped in pairs.
2. `completions.py:completions` (or `chat.py:chat_completions`, `api.py:submit`): the body parsed by
   `validation.py:parse_completion` (a 4xx naming the field); `api.py:refuse_if_not_serving` (503).
3. `completions.py:placement_mode`: where the prompt may be computed (bubbles, decoder, auto).
4. `api.py:enqueue` -> `api.py:new_request` -> `shared/control/serving.py:accept`: counted in flight,
   queued on the run's request stream (429 past `max_queue_depth`).
5. `completions.py:answer` waits: `answers.py:as_answered` over `state.py:Waiters`, fed by
   `app.py:_results_ctx` from the instance's results stream.
6. A failed answer: `answers.py:raise_if_failed` (429, 504, ... by reason); a moved one:
   `on_decoder.py:compute` has the decoder compute the prompt.
7. `max_tokens > 1`: `decoding.py:whole` continues on the decoder (`builtin_decode.py`,
   `vllm_decode.py:VllmDecoder.continue_completion`).
8. The response: `answers.py:choice`, `answers.py:usage`, streamed or whole; `answers.py:observe`
   records TTFT in `metrics.py:Metrics`.
"""
