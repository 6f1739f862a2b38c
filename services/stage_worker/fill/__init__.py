"""The worker's guest: prefill run inside training's bubbles. The bubble announced and ended
(`announcer.py`); the queued batches run in it (`executor.py`) one block at a time (`compute.py`),
over the values both share (`batch.py`); each request answered as it is done (`answers.py`) and its
batch reported after (`reporting.py`); a failing guest counted and stopped (`guest_faults.py`)."""
