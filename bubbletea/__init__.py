"""The `bubbletea` command a person runs (as `loadgen/` is for the `loadgen` command).

Modules: `cli` (the command and its subcommands), `launcher` (the service table, process
supervision, `up`, `demo`, `train`), `report` (a run folder's pictures and table), `runstats` (the
one definition of each run figure: utilization, bubble fraction, fill ratio, dispatch latency) and
`plan` (the text `bubbletea plan` prints). No service imports this package.
"""
