"""The control plane: what rides Redis (stream and key names, statuses, the serving plane's
records, slot leases, heartbeats). The bus and the messages are `shared.bus` and `shared.wire`.
"""
