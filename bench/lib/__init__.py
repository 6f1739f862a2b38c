"""The helpers of the bench scripts (`bench/*.py`), one module a purpose; `make bench` runs only the
scripts. A script puts the checkout first on ``sys.path`` and imports ``bench.lib.<module>``, as
the tests do, so each helper is one module under one name.

What a bench prints and runs: `output` (progress, verdict, the JSON line), `children` (child
processes, SIGTERM as Ctrl-C), `arms` (`--arms`), `procfs`, `cpu_time` and `cpu_shares` (where
the CPU went), `worker_memory` (the stage workers' peak memory), `harness` (interleaved off/on
pairs and their summary).
One bench's pieces: `atlas_summary` (atlas.py); `bubble_fill_run`, `sim_fit`, `gpu_job`,
`gpu_share` (bubble_fill.py, gpu_check.py); `churn_figures`, `fault_arms`, `fault_figures`,
`lost_host` (churn.py, faults.py, takeover.py); `emulated_workers`, `injector` (dispatcher.py);
`paper_cases` (paper.py); `pd_load`, `pd_sweep`, `vllm_stack` (pd_vllm.py, tests/vllm);
`sim_compare`, `drawn_specs` (sim_vs_live.py); `transfers`, `tensor_receiver` (transport*.py).
"""
