"""The `bubbletea` command a person runs (as `loadgen/` is for the `loadgen` command).

Modules: `cli` (the entry point: every user error in one line), `commands` (the subcommands),
`launcher` (the service table, process supervision, `up`, `demo`, `train`), `report` (a run
folder's pictures and table) and `plan` (the text `bubbletea plan` prints). The figures they
print are defined in `shared.figures`, which the simulator and the benchmarks use too. No service
imports this package, nor does `shared/` or `sim/`.
"""
