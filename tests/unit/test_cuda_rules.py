"""CUDA's rules (docs/STYLE: "CUDA's rules, from its docs"), held by what a CPU can check: the pure
plans and choices the CUDA paths obey, and the source itself where the rule is "never call this".
The halves that need a GPU skip without one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from services.stage_worker.fill.announcer import GuestMemory
from services.stage_worker.train.warm import guest_model
from shared.config.spec import parse_spec
from shared.dataplane import kvstore
from shared.model.devices import gpu_sharers, guest_dtype
from shared.model.gpt import GPTConfig
from shared.model.graphs import BUCKETS, bucket, capture_plan, graph_for
from shared.model.prefill import PrefillModel
from shared.policies.guest import guest_memory_cap

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false (a CPU-only torch build, or no visible GPU)"
ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "datacenters": [{"name": "a", "gpus": 2}],
    "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
    "parallelism": {"pp": 2, "dp": 1},
    "training": {"microbatches": 1, "microbatch_size": 2},
    "prefill": {"model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 32, "vocab": 256, "seed": 1}},
}
PROMPTS = [[(7 * i + j) % 256 for i in range(n)] for j, n in enumerate((1, 5, 17, 40, 63))]


def calls_of(name: str, *folders: str) -> list[str]:
    """`path:line` of every call of an attribute or function named `name` in the folders' modules."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    f = node.func
                    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if called == name:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_nothing_the_services_run_empties_the_cuda_cache() -> None:
    """`torch.cuda.empty_cache` waits for the whole device (training's stream too): never on a hot
    path, and a failed prefill request no longer calls it (the allocator frees its cache itself
    when an allocation does not fit)."""
    assert calls_of("empty_cache", "services", "shared") == []


# --- CUDA graphs (shared/model/graphs.py): captured at set-up, for every bucket, never later ---------


def test_graphs_are_planned_for_every_layer_and_every_bucket_a_prompt_up_to_the_limit_replays() -> None:
    plan = capture_plan(2, 96)  # the demo's ~96-token prompts: bucket 128, not only 64
    assert plan == tuple((layer, b) for layer in (0, 1) for b in (16, 32, 64, 128))
    for n in range(1, 97):
        assert (1, bucket(n)) in plan
    assert capture_plan(1, 10) == ((0, 16),)
    # longer prompts than the largest bucket: their first pieces may fill it
    assert capture_plan(3, 4096) == tuple((layer, b) for layer in range(3) for b in BUCKETS)


def test_a_block_whose_bucket_has_no_graph_runs_eagerly() -> None:
    graphs = {(0, 16): "g16", (1, 32): "g32"}
    assert graph_for(graphs, 0, 9, past=False) == "g16"
    assert graph_for(graphs, 1, 32, past=False) == "g32"
    assert graph_for(graphs, 0, 20, past=False) is None  # bucket 32 of layer 0 was not captured
    assert graph_for(graphs, 0, 9, past=True) is None  # attends over earlier pieces
    assert graph_for(graphs, 0, 257, past=False) is None  # beyond every bucket
    assert graphs == {(0, 16): "g16", (1, 32): "g32"}  # looking up captures nothing


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_a_gpu_every_graph_is_captured_at_set_up_and_none_while_prompts_run() -> None:
    cfg = GPTConfig(layers=2, d_model=32, heads=4, seq_len=512, vocab=256)
    model = PrefillModel(cfg, seed=2, max_prompt_tokens=100).place(torch.device("cuda", 0)).use_graphs()
    assert model.graphs is not None and model.graphs.captured() == len(capture_plan(2, 100)) == 10
    for n in (1, 17, 64, 100):
        model.prefill([(3 * i) % 256 for i in range(n)])
    assert model.graphs.captured() == 10


# --- the guest's dtype: bfloat16 on a GPU, its logits float32; float32 on the CPU -------------------


def test_the_guest_computes_in_bfloat16_on_a_gpu_and_in_float32_on_the_cpu() -> None:
    assert guest_dtype(torch.device("cuda", 0)) is torch.bfloat16
    assert guest_dtype(torch.device("cuda", 1), bf16_supported=False) is torch.float32  # a GPU without it
    assert guest_dtype(torch.device("cpu")) is torch.float32  # CPU answers stay bit-equal
    spec = parse_spec(SPEC)
    assert guest_model(spec, torch.device("cpu")).dtype is torch.float32


def test_a_bfloat16_guest_gives_the_float32_guests_tokens_with_float32_logits() -> None:
    """The bfloat16 path, run on the CPU (the worker takes it on a GPU only): the same greedy tokens,
    logits float32 for sampling, KV caches stored as float32 whatever they were computed in, and a
    snapshot taken in one dtype resumes in the other."""
    cfg = GPTConfig(layers=4, d_model=64, heads=4, seq_len=64, vocab=256)
    fp32 = PrefillModel(cfg, seed=11)
    bf16 = PrefillModel(cfg, seed=11).place(torch.device("cpu"), torch.bfloat16)
    assert bf16.dtype is torch.bfloat16 and fp32.dtype is torch.float32
    for prompt in PROMPTS:
        want = fp32.prefill(prompt, top_logprobs=3)
        state = bf16.run_layers(bf16.start(prompt))
        assert bf16.last_logits(state).dtype is torch.float32
        got = bf16.finish(state, top_logprobs=3)
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=0.05)
        assert all(k.dtype is torch.bfloat16 for k, _ in got.kv)
        stored = kvstore.read_kv_file(kvstore.kv_file("r", "m", prompt, got.token, got.kv))
        assert all(k.dtype is torch.float32 and v.dtype is torch.float32 for k, v in stored.kv)
        half = fp32.run_layers(fp32.start(prompt), max_layers=2)
        resumed = kvstore.restore(kvstore.snapshot("r", half), cfg.layers)
        assert bf16.finish(bf16.run_layers(resumed)).token == want.token


# --- the guest's memory: measured after training's first step, capped --------------------------------

GIB = 1 << 30


def test_the_guests_memory_is_what_training_left_free_less_a_headroom_shared_by_the_gpus_workers() -> None:
    # an 80 GiB GPU with 50 GiB free once training's first step peaked
    assert guest_memory_cap(50 * GIB, 80 * GIB) == 42 * GIB  # 8 GiB (10%) kept free
    assert guest_memory_cap(50 * GIB, 80 * GIB, sharers=2) == 21 * GIB  # two workers on one GPU
    assert guest_memory_cap(50 * GIB, 80 * GIB, ceiling=10 * GIB) == 10 * GIB  # the spec's figure caps it
    assert guest_memory_cap(5 * GIB, 80 * GIB) == 0  # training left less than the headroom: nothing
    assert guest_memory_cap(50 * GIB, 80 * GIB, ceiling=-1) == 0
    assert guest_memory_cap(50 * GIB, 80 * GIB, headroom=0.0) == 50 * GIB
    with pytest.raises(ValueError, match="sharers"):
        guest_memory_cap(GIB, GIB, sharers=0)
    with pytest.raises(ValueError, match="headroom"):
        guest_memory_cap(GIB, GIB, headroom=1.0)


def test_the_workers_sharing_a_gpu_are_the_slots_mapped_to_it() -> None:
    assert [gpu_sharers(s, 4, 4) for s in range(4)] == [1, 1, 1, 1]  # a GPU each
    assert [gpu_sharers(s, 4, 2) for s in range(4)] == [2, 2, 2, 2]
    assert [gpu_sharers(s, 5, 2) for s in range(5)] == [3, 2, 3, 2, 3]  # slots 0, 2, 4 on GPU 0
    assert gpu_sharers(0, 2, 8) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_a_gpu_the_guests_memory_is_measured_from_what_is_free() -> None:
    dev = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(dev)
    got = GuestMemory.on_gpu(dev, 0, 1, ceiling=1 << 50).measure()
    assert abs(got - (free - total // 10)) < 256 << 20  # what else runs may move it a little
