"""The cluster spec and what is read from it: the validated spec, the environment's overrides,
the device time scale, and the spec as the analytic model's inputs.
"""
