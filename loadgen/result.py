"""The result JSON as `vllm bench serve` writes it, and where it is saved (pure but for `write`).

The keys come in vLLM's order: the setup (`date`, `backend`, `label`, `model_id`, `tokenizer_id`,
`num_prompts`), the --metadata pairs at the top level, the traffic (`request_rate`, `burstiness`,
`max_concurrency`), the measurements (`report.summarize`), then loadgen's own record of the rest
of its configuration. No key is written twice: a --metadata key that would replace another key is
refused before the run.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from loadgen import report
from loadgen.client import BACKENDS
from loadgen.config import BenchmarkConfig

#: vLLM's `date` format, also the file name's time stamp.
DATE_FORMAT = "%Y%m%d-%H%M%S"
#: The setup keys vLLM writes first.
TRAFFIC = ("request_rate", "burstiness", "max_concurrency")


def run_date(now: datetime) -> str:
    return now.strftime(DATE_FORMAT)


def assemble(
    config: BenchmarkConfig, summary: dict[str, Any], *, model: str | None, base_url: str, date: str
) -> dict[str, Any]:
    """The whole result: setup, metadata, traffic, measurements, configuration."""
    described = config.describe()
    setup = {
        "date": date,
        "backend": BACKENDS[config.endpoint],
        "label": described.pop("label"),
        "model_id": model,
        "tokenizer_id": None,  # no tokenizer: the prompts are token ids already (byte-level model)
        "num_prompts": described.pop("num_prompts"),
    }
    traffic = {key: described.pop(key) for key in TRAFFIC}
    settings = {**described, "base_url": base_url, "model": model}
    parts = [setup, traffic, summary, settings]
    seen: set[str] = set()
    for part in parts:
        clash = seen & part.keys()
        assert not clash, f"result keys written twice: {clash}"
        seen |= part.keys()
    clash = seen & config.metadata.keys()
    if clash:
        raise ValueError(f"--metadata would replace the result's {', '.join(sorted(clash))}")
    return {**setup, **config.metadata, **traffic, **summary, **settings}


def check_metadata(config: BenchmarkConfig) -> None:
    """Refuse, before the run, a --metadata key that the result already has (ValueError)."""
    empty = report.summarize(
        [],
        0.0,
        metrics=config.percentile_metrics,
        percentiles=config.metric_percentiles,
        goodput=config.goodput,
    )
    assemble(config, empty, model=None, base_url="", date="")


def default_filename(config: BenchmarkConfig, model: str | None, date: str) -> str:
    """vLLM's name: `{label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json`, the label
    defaulting to the backend ("openai", "bubbletea"). A trace replay has no rate: `trace` stands
    in for `{request_rate}qps`."""
    label = config.label or BACKENDS[config.endpoint]
    rate = "trace" if config.dataset == "trace" else f"{float(config.request_rate)}qps"  # "20.0qps", "infqps"
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    base_model = (model or "unknown-model").split("/")[-1]
    return f"{label}-{rate}{concurrency}-{base_model}-{date}.json"


def save_paths(config: BenchmarkConfig, result: dict[str, Any]) -> list[Path]:
    """Where the result is written: --json-out, and with --save-result the file vLLM would write
    (--result-filename or the default name, in --result-dir or the working directory)."""
    paths = [Path(config.json_out)] if config.json_out is not None else []
    if config.save_result:
        name = config.result_filename or default_filename(config, result["model_id"], result["date"])
        paths.append(Path(config.result_dir or ".") / name)
    return paths


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
