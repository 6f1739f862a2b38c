"""What every process runs on: logging, thread priorities, the embedded Redis, child processes,
precise sleeps, the API key check. The common `__main__` and `/metrics` are `shared.service`.
"""
