"""The worker's training: the stage's model and optimizer (`trainer.py`), the schedule walked for
real (`runner.py`), its timing before the first step (`timing.py`), and what a spare loads while it
waits (`warm.py`). It moves tensors only through the port (`..port`)."""
