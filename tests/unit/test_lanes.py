"""Training and prefill on streams of their own (`shared.model.lanes`): on the CPU nothing
changes; every trainer method that touches the device runs on training's lane; on a GPU training's
stream outranks prefill's and prefill's blocks really run on its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
import torch

from services.stage_worker.train.trainer import StageTrainer
from shared.config.spec import parse_spec
from shared.model.data import ByteCorpus
from shared.model.gpt import GPTConfig
from shared.model.lanes import Lane, LaneClock, Urgency, stream_priority
from shared.model.prefill import PrefillModel

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false (a CPU-only torch build, or no visible GPU)"
SPEC = parse_spec(
    {
        "datacenters": [{"name": "a", "gpus": 2}],
        "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
        "parallelism": {"pp": 2, "dp": 1},
        "training": {"microbatches": 1, "microbatch_size": 2},
    }
)
CORPUS = ByteCorpus(torch.arange(256, dtype=torch.uint8).repeat(8))


def test_on_the_cpu_a_lane_has_no_stream_and_changes_nothing() -> None:
    cpu = torch.device("cpu")
    for lane in (Lane.training(cpu), Lane.prefill(cpu)):
        assert lane.stream is None and lane.priority is None
        with lane.scope():
            assert torch.ones(2).sum().item() == 2.0
        lane.wait()
        lane.hand_over()
    assert StageTrainer(SPEC, 0, 0, CORPUS).lane.stream is None
    model = PrefillModel(GPTConfig(layers=2, d_model=16, heads=2, seq_len=8, vocab=256), seed=1)
    assert model.lane.stream is None and model.place(cpu).lane.stream is None
    # positions are built once per request and kept with its state (the same values as before)
    state = model.run_layers(model.start([1, 2, 3]), max_layers=1)
    assert state.positions is not None and state.positions.tolist() == [0, 1, 2]
    kept = state.positions
    assert model.run_layers(state).positions is kept


class CountingLane(Lane):
    """A CPU lane that counts how often work entered it (there is no stream to look at here)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), Urgency.TRAINING)
        self.entered = 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self.entered += 1
        yield


def test_every_trainer_method_that_touches_the_device_runs_on_trainings_lane() -> None:
    tr = StageTrainer(SPEC, 0, 0, CORPUS)
    lane = tr.lane = CountingLane()
    act = tr.forward(0, 0, None)
    assert act is not None and lane.entered == 1
    tr.backward(0, torch.full_like(act, 0.01))
    flat = tr.flat_grads()
    on_cpu = tr.flat_grads_on_cpu()  # the all-reduce's input: its copy off the device on the lane too
    assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, flat)
    tr.load_mean([flat, flat])  # and load_grads inside it: 2
    tr.step(0)  # and grad_sq_norm inside it (clipping is on): 2
    blob = tr.checkpoint()
    tr.restore(blob)  # and discard inside it: 2
    tr.saved_tensors()
    tr.discard()
    assert lane.entered == 13, lane.entered


def test_prefill_is_the_least_urgent_lane_and_training_the_most() -> None:
    """CUDA's range, e.g. (0, -5): a lower number is more urgent, and none is below the default
    stream's 0, so prefill takes 0 and training never uses the default stream."""
    assert stream_priority(Urgency.TRAINING, 0, -5) == -5
    assert stream_priority(Urgency.PREFILL, 0, -5) == 0
    assert stream_priority(Urgency.TRAINING, 0, -5) < stream_priority(Urgency.PREFILL, 0, -5)
    assert {stream_priority(u, 0, 0) for u in Urgency} == {0}  # a device without priorities


def test_a_finished_prefills_head_and_logits_copy_run_on_a_lane_as_urgent_as_training() -> None:
    """Not on prefill's low-priority lane, where training could starve them past the bubble."""
    assert stream_priority(Urgency.FINISHING, 0, -5) == stream_priority(Urgency.TRAINING, 0, -5)
    model = PrefillModel(GPTConfig(layers=2, d_model=16, heads=2, seq_len=8, vocab=256), seed=1)
    assert model.finish_lane.urgency is Urgency.FINISHING and model.lane.urgency is Urgency.PREFILL
    want = model.prefill([1, 2, 3], top_logprobs=2)
    model.lane, model.finish_lane = CountingLane(), CountingLane()
    got = model.prefill([1, 2, 3], top_logprobs=2)
    assert model.finish_lane.entered == 1  # the head, once
    assert model.lane.entered == 1  # the blocks (one run_layers)
    assert (got.token, got.logprob, got.top) == (want.token, want.logprob, want.top)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_a_gpu_training_outranks_prefill_and_prefill_runs_on_its_own_stream() -> None:
    dev = torch.device("cuda", 0)
    train, prefill = Lane.training(dev), Lane.prefill(dev)
    assert train.priority is not None and prefill.priority is not None
    assert train.priority < prefill.priority  # lower is more urgent
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=16, vocab=256), seed=1)
    want = model.prefill([5, 6, 7])
    model.place(dev)
    seen: list[torch.cuda.Stream] = []
    block = model.module.block

    def recording(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(torch.cuda.current_stream())
        return block(*args, **kw)

    model.module.block = recording  # type: ignore[method-assign]
    head, heads = model.module.head, []

    def finishing(*args, **kw):  # type: ignore[no-untyped-def]
        heads.append(torch.cuda.current_stream())
        return head(*args, **kw)

    model.module.head = finishing  # type: ignore[method-assign]
    got = model.prefill([5, 6, 7])
    assert seen and all(s == model.lane.stream for s in seen)
    assert heads == [model.finish_lane.stream] and model.finish_lane.priority == train.priority
    assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
    # what prefill computed is readable from the default stream at once (a snapshot's copy)
    state = model.run_layers(model.start([5, 6, 7]), max_layers=1)
    assert state.hidden is not None and torch.isfinite(state.hidden.cpu()).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_a_gpu_trainings_gradient_copy_does_not_wait_behind_prefill() -> None:
    """Prefill's work handed to the default stream (`Lane.hand_over`) holds up none of training's:
    the all-reduce's copy of the gradients comes back while prefill still runs."""
    dev = torch.device("cuda", 0)
    tr = StageTrainer(SPEC, 0, 0, CORPUS, dev)
    act = tr.forward(0, 0, None)
    assert act is not None
    tr.backward(0, torch.full_like(act, 0.01))
    prefill = Lane.prefill(dev)
    x = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize(dev)
    with prefill.scope():
        for _ in range(200):  # about a second of prefill queued on the GPU
            x = x @ x
        done = torch.cuda.Event()
        done.record()
    prefill.hand_over()
    flat = tr.flat_grads_on_cpu()
    assert not done.query(), "training's copy waited for prefill"
    assert flat.device.type == "cpu" and flat.numel() == sum(p.numel() for p in tr.params)


def test_a_lane_clock_on_the_cpu_times_each_piece_on_the_host() -> None:
    clock = LaneClock(Lane.prefill(torch.device("cpu")))
    for tokens in (3, 5):
        mark = clock.begin()
        torch.ones(64, 64) @ torch.ones(64, 64)
        clock.end(mark, tokens)
    got = clock.measured()
    assert [n for n, _ in got] == [3, 5] and all(s > 0 for _, s in got)
    assert clock.measured() == []  # each measurement once


def test_a_finished_prefill_read_later_is_the_one_finish_gives() -> None:
    """`finish_async` + `Finishing.result` (a worker reads the first token where waiting costs
    nothing) equals `finish`: on the CPU ready at once and computed exactly as before."""
    model = PrefillModel(GPTConfig(layers=2, d_model=16, heads=2, seq_len=32, vocab=64), seed=3)
    state = model.run_layers(model.start([1, 2, 3, 4, 5]))
    pending = model.finish_async(state, temperature=0.7, seed=11, top_logprobs=3)
    assert pending.ready() and pending.event is None
    got, want = pending.result(), model.finish(state, temperature=0.7, seed=11, top_logprobs=3)
    assert (got.token, got.logprob, got.top, got.prompt_tokens) == (want.token, want.logprob, want.top, 5)
    with pytest.raises(ValueError, match="temperature"):
        model.finish_async(state, temperature=-1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_on_a_gpu_the_first_token_is_read_after_an_event_in_another_thread() -> None:
    dev = torch.device("cuda", 0)
    model = PrefillModel(GPTConfig(layers=2, d_model=64, heads=4, seq_len=128, vocab=512), seed=3).place(dev)
    state = model.run_layers(model.start(list(range(1, 100))))
    pending = model.finish_async(state, top_logprobs=5)
    assert pending.event is not None and pending.logits.is_pinned() and pending.logits.device.type == "cpu"
    got = await asyncio.to_thread(pending.result)  # as an answer reads it
    assert pending.ready()
    want = model.finish(state, top_logprobs=5)
    assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-5)
    clock = LaneClock(model.lane)
    mark = clock.begin()
    model.run_piece(model.start(list(range(1, 100))), 64)
    clock.end(mark, 64)
    model.lane.wait()
    ((tokens, seconds),) = clock.measured()
    assert tokens == 64 and seconds > 0


def test_on_the_cpu_nothing_is_in_flight_once_a_piece_returns() -> None:
    clock = LaneClock(Lane.prefill(torch.device("cpu")))
    mark = clock.begin()
    torch.ones(64, 64) @ torch.ones(64, 64)
    clock.end(mark, 32)
    assert clock.in_flight_tokens() == 0 and [n for n, _ in clock.measured()] == [32]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_a_gpu_a_launched_piece_is_in_flight_until_the_device_is_done() -> None:
    """The fit rule counts the work still on the device (issue 62): a piece just launched is in flight
    (the host runs ahead), and once the device is done it is measured, not in flight."""
    lane = Lane.prefill(torch.device("cuda", 0))
    clock = LaneClock(lane)
    x = torch.randn(4096, 4096, device="cuda")
    with lane.scope():
        mark = clock.begin()
        for _ in range(20):  # long enough to be running when the host looks
            x = x @ x / 4096
        clock.end(mark, 128)
    assert clock.in_flight_tokens() == 128
    torch.cuda.synchronize()
    assert clock.in_flight_tokens() == 0 and [n for n, _ in clock.measured()] == [128]
