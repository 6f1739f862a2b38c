"""A worker's membership of its run (see take_part.py)."""
