"""Code shared by every BubbleTea service, one subpackage per purpose.

shared.bus, shared.wire   the control plane's bus (Redis Streams) and its messages
shared.control            what else rides Redis: stream and key names, statuses, records, leases
shared.dataplane          tensors between workers and KV caches to decoders (never Redis)
shared.config               the cluster spec, the environment's overrides, the device time scale
shared.model              the models: stages, prefill, tokenizers, checkpoints
shared.policies           the pure decisions, and the one pipeline walk every clock drives
shared.figures            the one definition of every figure printed
shared.runtime            logs, metrics, priorities, the embedded Redis, the common `__main__`
"""
