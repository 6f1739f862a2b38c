"""What every process runs on: logging, metrics, thread priorities, the embedded Redis, the
common `__main__`, child processes, precise sleeps, the API key check.
"""
