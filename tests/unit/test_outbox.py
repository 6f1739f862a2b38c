"""A worker's cross-DC send as the broker takes it in WAN mode `model`: stamped with the send time
(the emulated wire starts then), sized by the tensor on the data plane, and carrying only the
receiver's small release message (the tensor itself never rides Redis)."""

import time

from services.stage_worker.port.outbox import wan_transfer
from shared.wire import TensorReady, decode


def test_a_transfer_is_stamped_when_it_is_built_and_carries_only_the_release() -> None:
    release = TensorReady(
        run="r",
        what="act",
        iteration=1,
        microbatch=2,
        replica=0,
        src_stage=0,
        dst_stage=1,
        dtype="float32",
        shape=(4, 8),
        release=True,
    )
    before = time.time()
    t = wan_transfer("r", release, "act:0:1:2:0:0", "dc-a", "dc-b", "bt:r:w:0:1", (1, 2, 0), 4 * 8 * 4)
    assert before <= t.sent_at <= time.time()
    assert t.nbytes == 4 * 8 * 4 and decode(t.payload) == release
    assert len(t.payload) < 200  # control only
    assert (t.run, t.src_dc, t.dst_dc, t.deliver_to, t.priority) == ("r", "dc-a", "dc-b", "bt:r:w:0:1", (1, 2, 0))
