"""The load generator for the prefill API, modelled on `vllm bench serve` (see docs/loadgen.md).

Modules: `arrivals` (when requests are sent), `datasets` (what is sent: random prompts or a
replayed trace), `client` (sending one request), `report` (the numbers and the table) and `cli`
(the command, and `run_benchmark` for use in-process).
"""
