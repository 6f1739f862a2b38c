"""The port's tensor keys and caches (`services/stage_worker/port/tensors.py`): a key per received
tensor, read off its announcement; one cache per direction, a received buffer kept until the
microbatch's backward frees it."""

from __future__ import annotations

import torch

from services.stage_worker.port.tensors import Direction, IterationTensors, TensorKey
from shared.wire import TensorReady


def test_a_key_is_read_off_the_announcement_and_names_its_direction() -> None:
    ready = {"run": "r", "replica": 0, "src_stage": 1, "dst_stage": 0, "dtype": "float32", "shape": (2,)}
    m = TensorReady(what="grad", iteration=3, microbatch=1, **ready)
    key = TensorKey.of(m)
    assert key == TensorKey(Direction.GRAD, 3, 1) and key.direction is Direction.GRAD
    assert Direction("act") is Direction.ACT and Direction.ACT.value == "act"  # the wire's `what`


def test_each_direction_keeps_its_inputs_outputs_and_buffers_apart() -> None:
    tensors = IterationTensors()
    x, out = torch.zeros(1), torch.ones(1)
    tensors[Direction.ACT].received(0, x)
    assert tensors.act.take_input(0) is x and tensors.act.take_input(0) is None  # taken once
    assert tensors.grad.take_input(0) is None  # nothing came the other way
    tensors.act.computed(0, out)
    tensors.act.computed(1, None)  # the last stage's forward sends nothing on
    assert tensors[Direction.ACT].take_output(0) is out and not tensors.act.outputs
    assert tensors.act.dead_buffer(0) is x and tensors.act.dead_buffer(0) is None  # freed once
