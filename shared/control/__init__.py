"""The control plane's records in Redis: the serving plane's records, slot leases, heartbeats. The
bus is `shared.bus`; the messages, the stream and key names and the statuses are `shared.wire`.
"""
