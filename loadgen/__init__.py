"""The load generator for the prefill API, modelled on `vllm bench serve` (see docs/loadgen.md).

Modules: `arrivals` (when requests are sent), `datasets` (what is sent: random prompts or a
replayed trace), `client` (sending one request), `stream` (reading a streamed answer), `outcome`
(what a request ended as), `report` (the numbers and the table), `result` (the JSON, with vLLM's
keys, and its file name), `options` and `config` (the command line and what it becomes) and `cli`
(the command, and `run_benchmark` for use in-process).
"""
