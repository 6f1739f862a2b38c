"""The figures: the one definition of every number the demo, `bubbletea up`, the report, the
simulator and the benchmarks print about a run, so no two of them can compute one figure two ways.

Here in `shared/`, not in the `bubbletea` command's package, because the simulator (`sim/`) and
the benchmarks (`bench/`) compute the same figures from their own runs. Import the submodule you
need; this package imports none of them.

- `runstats`: a run's spans (`Span`, read from the bus and written to spans.jsonl), the steady
  window, per-worker usage, utilization, bubble fraction, fill ratio, prefill lag.
- `percentiles`: the one percentile rule (linear interpolation, numpy's default) of every figure,
  bench and report.
- `bubblestats`: the per-bubble figures: dispatch latency over every bubble, control shares,
  prediction error, overrun, and the bubbles' capacity.
- `capacity`: the load a run offers, as a share of that capacity, and what a prompt costs.
- `training`: the steady iteration time, the training slowdown with BubbleTea on, a speedup, and
  the share of time training compute ran behind its profile.
- `requests`: TTFT percentiles on the device clock, SLO attainment over every request sent, and
  the requests lost.
"""
