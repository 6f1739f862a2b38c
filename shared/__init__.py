"""Code shared by every BubbleTea service, one subpackage per purpose, in layers: each imports only
those listed above it (tests/unit/test_layout.py, `LAYERS`).

shared.config             the ground floor: the cluster spec, the environment (`env.ENV`), errors,
                          a checkpoint's shape, the device time scale's rule
shared.runtime            logs, thread priorities, the embedded Redis, child processes, precise sleeps
shared.wire               the messages, every stream and key name, every status
shared.bus                the control plane's bus (Redis Streams)
shared.model              the models: stages, prefill, tokenizers, checkpoints, lanes, calibration
shared.policies           the pure decisions, the one pipeline walk every clock drives, the plan
shared.control            what else rides Redis: the serving plane's records, leases, heartbeats
shared.figures            the one definition of every figure printed
shared.dataplane          tensors between workers and KV caches to decoders (never Redis)
shared.service            the common `__main__` of every service, and its `/metrics`
"""
