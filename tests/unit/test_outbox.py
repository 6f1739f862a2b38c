"""A worker's cross-DC send as the broker takes it: stamped with the send time (the emulated wire
starts then), carrying the tensor's bytes as its size and the encoded message as its payload."""

import time

import torch

from services.stage_worker.outbox import wan_transfer
from shared.tensors import to_blob
from shared.wire import StageTensor, decode


def test_a_transfer_is_stamped_when_it_is_built_and_sized_by_its_tensor() -> None:
    blob = to_blob(torch.zeros(4, 8))
    msg = StageTensor(run="r", what="act", iteration=1, microbatch=2, replica=0, src_stage=0, dst_stage=1, tensor=blob)
    before = time.time()
    t = wan_transfer("r", msg, "act:1:2:0:0", "dc-a", "dc-b", "bt:r:w:0:1", (1, 2, 0))
    assert before <= t.sent_at <= time.time()
    assert t.nbytes == 4 * 8 * 4 and decode(t.payload) == msg
    assert (t.run, t.src_dc, t.dst_dc, t.deliver_to, t.priority) == ("r", "dc-a", "dc-b", "bt:r:w:0:1", (1, 2, 0))
