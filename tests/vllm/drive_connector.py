"""BubbleTea's vLLM connector inside a real vLLM scheduler, in one process, on the CPU, in seconds.

Run by `tests/vllm/test_connector_in_scheduler.py` under vLLM's own python (`make vllm`), which
BubbleTea's environment cannot import; the KV holder it loads from is that test's, a real
`shared.dataplane.kv.KvServer` in BubbleTea's environment, as in production. As vLLM's own
connector tests do, it builds a `Scheduler` from a `VllmConfig` with a `kv_transfer_config`, adds
requests and steps them with model-runner outputs made here in place of a model; the worker side is
the connector in its worker role, writing into real CPU attention layers' KV caches through their
backend, as in a model worker.

    python drive_connector.py SPEC.json REPORT.json

SPEC: {"workdir", "holder", "frozen", "gone", "caches": {name: {"key", "prompt"}}} (the test's).
REPORT: {scenario: {"ok": true} or {"ok": false, "error": the traceback}}, every scenario run.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bubbletea_vllm.kvclient import KvClient, KvUnavailable
from safetensors.torch import load as st_load
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.logging import LoggingConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.logger import configure_logging
from vllm.model_executor.layers.attention import Attention
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK, BLOCKS, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 16, 2, 4, 2, 64
#: The token BubbleTea's prefill sampled, sent after the prompt; and the one every step "samples".
FIRST, SAMPLED = 7, 5
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM,
    "intermediate_size": 512, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}  # fmt: skip
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class Engine:
    """A vLLM scheduler with the connector's scheduler side, and its worker side over two real
    attention layers; `step` is one engine step with no model: every scheduled request samples."""

    def __init__(self, spec: dict[str, Any], policy: str = "fail", fetch_timeout_s: float = 5.0) -> None:
        model = Path(spec["workdir"]) / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256),
            cache_config=CacheConfig(block_size=BLOCK),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, is_encoder_decoder=False
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="BubbleTeaConnector",
                kv_connector_module_path="bubbletea_vllm.connector",
                kv_role="kv_consumer",
                kv_load_failure_policy=policy,
                kv_connector_extra_config={"fetch_timeout_s": fetch_timeout_s},
            ),
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = BLOCKS  # what a worker's profiling would have found
        kv_spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, kv_spec)]
        )
        with set_current_vllm_config(self.config):
            self.layers = [
                Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, prefix=name) for name in LAYER_NAMES
            ]
            # the metadata builder tells the layers which CPU kernels to use, as in a model runner
            self.layers[0].attn_backend.get_builder_cls()(kv_spec, LAYER_NAMES, self.config, torch.device("cpu"))
        for layer in self.layers:  # vLLM's per-layer view of its paged cache: (blocks, heads, slots, K and V)
            layer.kv_cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.finished: dict[str, str] = {}  # request -> why it finished
        self.stats: list[Any] = []  # the scheduler's stats, step by step
        self.last: Any = None  # the last step's SchedulerOutput

    @property
    def side(self) -> Any:
        """The connector's scheduler side (the scheduler made the connector itself)."""
        return self.scheduler.connector.scheduler

    def add(self, req_id: str, prompt: list[int], handle: dict[str, Any] | None, max_tokens: int = 3) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": handle})
        request = Request(req_id, [*prompt, FIRST], params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step, the worker side driven as a model runner drives it (start the loads,
        then collect what finished, what failed and the stats)."""
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        with set_forward_context(None, self.config):
            self.worker.start_load_kv(get_forward_context())
        results = self.worker.get_transfer_results(out.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_recving=results.finished_recving or None,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_stats=self.worker.get_kv_connector_stats(),
        )
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        model_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[SAMPLED] for _ in ids],
            kv_connector_output=connector_output,
        )
        self.last = out
        for outputs in self.scheduler.update_from_output(out, model_output).values():
            self.finished.update({o.request_id: str(o.finish_reason) for o in outputs.outputs if o.finish_reason})
            if outputs.scheduler_stats is not None:
                self.stats.append(outputs.scheduler_stats)
        return out

    def until(self, done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
            self.step()
            time.sleep(0.005)  # the loads run on the connector's threads: let them

    def counted(self, name: str) -> int:
        """The connector's count `name` over every step's stats so far (as vLLM's logger adds them)."""
        return sum((s.kv_connector_stats or {}).get(name, 0) for s in self.stats)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_nothing_pending(self) -> None:
        """Every request gone, every load shipped and reported, every free done, every block back."""
        assert self.side.frees.wait_idle(timeout_s=10), "the frees did not finish"
        self.step()  # tells the workers what finished; collects the scheduler side's counts (the frees)
        assert not self.scheduler.has_requests(), "the scheduler still holds requests"
        assert not self.side.pending, f"loads noted and never shipped: {list(self.side.pending)}"
        assert not self.side.shipped, f"loads shipped and never reported: {list(self.side.shipped)}"
        assert not self.side.requests and not self.side.failed, (self.side.requests, self.side.failed)
        assert not self.worker.worker.inflight, f"loads never reported: {self.worker.worker.inflight}"
        # every block back but one, vLLM's null block
        assert self.free_blocks() == BLOCKS - 1, f"{self.free_blocks()} blocks free of {BLOCKS - 1}"
        self.scheduler.shutdown()  # both sides stop as in vLLM: nothing left to wait for
        self.worker.shutdown()


def handle(spec: dict[str, Any], name: str, holder: str | None = None) -> dict[str, Any]:
    """The front door's kv_transfer_params for cache `name` (on `holder`, else the test's holder)."""
    cache = spec["caches"][name]
    return {
        "remote_engine_id": "bubbletea", "store": "plane", "key": cache["key"],
        "holder": holder or spec["holder"], "prompt_tokens": len(cache["prompt"]), "expires_at": 0,
    }  # fmt: skip


def expected_cache(engine: Engine, spec: dict[str, Any], name: str, request: Request) -> list[torch.Tensor]:
    """Each layer's KV cache as it must be once `request` loaded cache `name`: a zeroed cache with
    the file's rows written, by the test, through the backend into the request's blocks."""
    cache = spec["caches"][name]
    tensors = st_load(KvClient(timeout_s=5).fetch(spec["holder"], cache["key"]))
    n = len(cache["prompt"])
    (blocks,) = engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    want = []
    for i, layer in enumerate(engine.layers):
        kv = torch.zeros_like(layer.kv_cache)
        k, v = (tensors[f"layers.{i}.{x}"].transpose(0, 1).contiguous() for x in "kv")
        layer.impl.do_kv_cache_update(layer, k, v, kv, slots)
        want.append(kv)
    return want


def assert_loaded(engine: Engine, want: list[torch.Tensor]) -> None:
    for i, (layer, kv) in enumerate(zip(engine.layers, want, strict=True)):
        assert torch.equal(layer.kv_cache, kv), f"layer {i}'s KV cache is not the file's rows in the request's blocks"


def assert_freed(spec: dict[str, Any], key: str) -> None:
    try:
        KvClient(timeout_s=5).fetch(spec["holder"], key)
    except KvUnavailable:
        return
    raise AssertionError(f"the KV cache of {key} is still held after its request finished")


# ---------------------------------------------------------------- scenarios


def a_new_request_waits_for_its_load_then_computes_only_the_first_token(spec: dict[str, Any]) -> None:
    e = Engine(spec)
    prompt = spec["caches"]["new"]["prompt"]
    r = e.add("new", prompt, handle(spec, "new"))
    out = e.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, r.status
    assert out.num_scheduled_tokens == {}, "a request computed while its cache loads"
    assert [load.req_id for load in out.kv_connector_metadata.loads] == ["new"]
    want = expected_cache(e, spec, "new", r)
    e.until(lambda: r.status == RequestStatus.RUNNING, "scheduled after its load")
    assert_loaded(e, want)
    # vLLM computed one position, the first token's: every prompt position was loaded
    assert r.num_computed_tokens == len(prompt) + 1, r.num_computed_tokens
    e.until(lambda: "new" in e.finished, "finished")
    assert e.finished["new"] == "length", e.finished
    # vLLM's prefix-cache stats for the connector: every loaded position a hit, from a peer
    hits = [s.connector_prefix_cache_stats for s in e.stats if s.connector_prefix_cache_stats]
    external = sum(h.hits for h in hits)
    by_source: dict[Any, int] = {}
    for h in hits:
        for source, n in h.hits_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    assert external == len(prompt) and by_source == {CacheHitSource.P2P: len(prompt)}, (external, by_source)
    e.assert_nothing_pending()
    assert_freed(spec, spec["caches"]["new"]["key"])
    assert (e.counted("loads"), e.counted("tokens_loaded"), e.counted("frees")) == (1, len(prompt), 1)


def a_preempted_request_loads_its_cache_again_when_resumed(spec: dict[str, Any]) -> None:
    e = Engine(spec)
    prompt = spec["caches"]["preempted"]["prompt"]
    r = e.add("preempted", prompt, handle(spec, "preempted"), max_tokens=4)
    e.until(lambda: r.status == RequestStatus.RUNNING, "scheduled after its load")
    e.step()  # a decode step: two tokens out
    assert r.num_output_tokens == 2, r.num_output_tokens
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts every running request
    assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0, (r.status, r.num_computed_tokens)
    for layer in e.layers:  # so that what the resumed request finds is what its second load wrote
        layer.kv_cache.zero_()
    e.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, r.status
    (load,) = e.last.kv_connector_metadata.loads
    assert (load.req_id, load.start, load.end) == ("preempted", 0, len(prompt)), load
    want = expected_cache(e, spec, "preempted", r)  # its new blocks
    e.until(lambda: r.status == RequestStatus.RUNNING, "resumed after its second load")
    assert "preempted" in e.last.scheduled_cached_reqs.resumed_req_ids
    # resumed with the prompt loaded: vLLM computes the first token and the two it had sampled
    assert e.last.num_scheduled_tokens == {"preempted": 3}, e.last.num_scheduled_tokens
    assert_loaded(e, want)
    e.until(lambda: "preempted" in e.finished, "finished")
    assert e.finished["preempted"] == "length", e.finished
    e.assert_nothing_pending()
    assert (e.counted("loads"), e.counted("tokens_loaded"), e.counted("frees")) == (2, 2 * len(prompt), 1)


def a_frozen_holder_holds_up_only_its_own_loads(spec: dict[str, Any]) -> None:
    """A holder that accepts and never answers: its load fails after the fetch timeout (here 1 s),
    and a load from another holder, shipped in the same step behind it, is not kept waiting."""
    e = Engine(spec, fetch_timeout_s=1.0)
    frozen = e.add("frozen", spec["caches"]["frozen"]["prompt"], handle(spec, "frozen", spec["frozen"]))
    beside = e.add("beside", spec["caches"]["beside"]["prompt"], handle(spec, "beside"))
    e.step()
    assert [load.req_id for load in e.last.kv_connector_metadata.loads] == ["frozen", "beside"]
    e.until(lambda: beside.status == RequestStatus.RUNNING, "loaded beside a frozen holder")
    assert frozen.status == RequestStatus.WAITING_FOR_REMOTE_KVS, frozen.status
    e.until(lambda: "frozen" in e.finished and "beside" in e.finished, "finished")
    assert e.finished == {"beside": "length", "frozen": "error"}, e.finished
    e.assert_nothing_pending()
    assert (e.counted("loads"), e.counted("load_failures")) == (1, 1)


def a_load_error_fails_the_request_under_policy_fail(spec: dict[str, Any]) -> None:
    """vLLM's default policy: a cache not held (expired or freed) or whose holder is gone fails
    its request, and frees its blocks."""
    e = Engine(spec, policy="fail")
    e.add("missing", spec["caches"]["missing"]["prompt"], handle(spec, "missing"))
    e.add("gone", spec["caches"]["gone"]["prompt"], handle(spec, "gone", spec["gone"]))
    e.until(lambda: len(e.finished) == 2, "failed")
    assert e.finished == {"missing": "error", "gone": "error"}, e.finished
    e.assert_nothing_pending()
    assert (e.counted("loads"), e.counted("load_failures"), e.counted("frees")) == (0, 2, 0)


def a_load_error_recomputes_the_prompt_under_policy_recompute(spec: dict[str, Any]) -> None:
    e = Engine(spec, policy="recompute")
    prompt = spec["caches"]["missing"]["prompt"]
    r = e.add("missing", prompt, handle(spec, "missing"))
    e.until(lambda: r.status == RequestStatus.RUNNING, "scheduled after its failed load")
    assert e.last.num_scheduled_tokens == {"missing": len(prompt) + 1}, "vLLM did not compute the whole prompt"
    e.until(lambda: "missing" in e.finished, "finished")
    assert e.finished["missing"] == "length", e.finished
    e.assert_nothing_pending()
    assert (e.counted("loads"), e.counted("load_failures")) == (0, 1)


def a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(spec: dict[str, Any]) -> None:
    """vLLM frees an aborted request's blocks only once the worker reports its load: the connector
    must report every load it was shipped, even one whose request is gone."""
    e = Engine(spec, fetch_timeout_s=1.0)
    r = e.add("aborted", spec["caches"]["aborted"]["prompt"], handle(spec, "aborted", spec["frozen"]))
    e.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, r.status
    held = e.free_blocks()
    e.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    e.step()
    assert e.free_blocks() == held, "an aborted request's blocks were freed while its load could still write them"
    e.until(lambda: e.free_blocks() == BLOCKS - 1, "its blocks freed once its load ended")
    e.assert_nothing_pending()


def a_handle_without_a_cache_has_vllm_compute_the_prompt(spec: dict[str, Any]) -> None:
    """A handle whose cache was not kept (the front door's store "none"): a fallback, counted."""
    e = Engine(spec)
    prompt = spec["caches"]["missing"]["prompt"]
    kept_none = {**handle(spec, "missing"), "store": "none", "why": "the KV byte budget was full"}
    e.add("fallback", prompt, kept_none)
    e.step()
    assert e.last.num_scheduled_tokens == {"fallback": len(prompt) + 1}, e.last.num_scheduled_tokens
    assert not e.last.kv_connector_metadata.loads
    e.until(lambda: "fallback" in e.finished, "finished")
    e.assert_nothing_pending()
    assert (e.counted("fallbacks"), e.counted("loads"), e.counted("frees")) == (1, 0, 0)


SCENARIOS: list[Callable[[dict[str, Any]], None]] = [
    a_new_request_waits_for_its_load_then_computes_only_the_first_token,
    a_preempted_request_loads_its_cache_again_when_resumed,
    a_frozen_holder_holds_up_only_its_own_loads,
    a_load_error_fails_the_request_under_policy_fail,
    a_load_error_recomputes_the_prompt_under_policy_recompute,
    a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends,
    a_handle_without_a_cache_has_vllm_compute_the_prompt,
]


def main() -> None:
    configure_logging(LoggingConfig())  # vLLM's log, as its server sets it up (VLLM_LOGGING_LEVEL, its format)
    spec = json.loads(Path(sys.argv[1]).read_text())
    report: dict[str, Any] = {}
    for scenario in SCENARIOS:
        t0 = time.perf_counter()
        try:
            scenario(spec)
            report[scenario.__name__] = {"ok": True}
        except Exception:
            report[scenario.__name__] = {"ok": False, "error": traceback.format_exc()}
        report[scenario.__name__]["seconds"] = round(time.perf_counter() - t0, 2)
    Path(sys.argv[2]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
