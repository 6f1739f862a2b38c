"""The configuration, the ground floor of `shared/` (it imports nothing above it): the cluster spec
(schema and loading: `spec`, `training`, `fields`; a checkpoint directory's shape, `model_info`),
the environment (`env`: one table of the variables; `settings`), the errors (`ConfigError`, what
they say: `messages`) and the device time scale's rule (`timescale`; measured in
`shared.model.calibration`).
"""
