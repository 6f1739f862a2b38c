"""What enters and leaves the worker: every tensor the stage sends, receives or keeps outside its own
memory (`stage_port.py`, over `transport.py`, `prefill.py` and `state.py`), the typed keys and
per-direction caches they are held under (`tensors.py`), where received tensors wait for the
runner (`mailbox.py`), and the ordered bus writes that announce them (`outbox.py`)."""
