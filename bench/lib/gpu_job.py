"""The GPU check's job (bench/gpu_check.py `--job llama`): a model and a load sized so the GPU, not
Python, sets the pace.

* **The model**: a Llama-family Hugging Face directory made here (`bubbletea init-model`'s
  config.json and tokenizer, and weights initialised as transformers initialises the family,
  written as safetensors), trained with bf16 autocast and served by the same directory's prefill.
  `full`: hidden 1,024, 8 layers a stage, sequences of 1,024 tokens; `tiny`: the same path at a
  size a CPU runs in seconds (the smoke test).
* **The WAN**: an inter-datacenter link as one is: 25 Gb/s, 20 ms one way, 4 connections.
* **The load**: prompt lengths from the Azure 2023 conversation trace
  (`loadgen/traces/azure2023_conv_synthetic.csv`) clipped to the model's context, at Poisson
  arrivals of the rate that offers the stated share of the bubbles' measured capacity (the load
  generator's `--input-lens-from`): its capacity in tokens is divided by the trace's mean clipped
  prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "loadgen" / "traces" / "azure2023_conv_synthetic.csv"


@dataclass(frozen=True)
class Job:
    size: str
    hidden: int
    layers_per_stage: int
    heads: int
    kv_heads: int
    seq_len: int  # training sequences, and the prompts' clip
    microbatches: int
    microbatch_size: int
    latency_ms: float = 20.0
    bandwidth_gbps: float = 25.0

    def model_dir(self, workdir: Path) -> Path:
        return workdir / f"llama-{self.size}"

    def spec_overrides(self, model_dir: Path, pp: int) -> dict[str, Any]:
        """What the job changes in the bench's spec (`bubble_fill_run.bench_spec`)."""
        return {
            "wan": {
                "sharing": "temporal",
                "default": {"latency_ms": self.latency_ms, "bandwidth_gbps": self.bandwidth_gbps, "connections": 4},
            },
            "model": {"seq_len": self.seq_len, "seed": 0},
            "parallelism": {"split": "params"},
            "training": {
                "model": str(model_dir),
                "microbatches": self.microbatches,
                "microbatch_size": self.microbatch_size,
                "precision": "auto",
            },
            "prefill": {
                "checkpoint": str(model_dir),
                "model_name": f"llama-{self.size}",
                "max_prompt_tokens": self.seq_len,
            },
        }


SIZES = {
    "full": Job("full", hidden=1024, layers_per_stage=8, heads=16, kv_heads=8, seq_len=1024, microbatches=8,
                microbatch_size=4),
    "tiny": Job("tiny", hidden=64, layers_per_stage=1, heads=4, kv_heads=2, seq_len=128, microbatches=4,
                microbatch_size=2),
}  # fmt: skip


def make_model(job: Job, workdir: Path, pp: int) -> Path:
    """The job's model directory (made once per workdir): config.json, tokenizer.json and
    model.safetensors of a freshly initialised Llama of `pp` x `layers_per_stage` layers."""
    directory = job.model_dir(workdir)
    if (directory / "model.safetensors").is_file():
        return directory
    from transformers import AutoConfig, AutoModelForCausalLM

    from bubbletea.initmodel import default_texts, init_model

    init_model(
        directory,
        "llama",
        layers=pp * job.layers_per_stage,
        hidden=job.hidden,
        heads=job.heads,
        kv_heads=job.kv_heads,
        positions=job.seq_len,
        tokenizer_vocab=1000,
        texts=default_texts(),
    )
    config = AutoConfig.from_pretrained(directory)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    json.loads((directory / "config.json").read_text())  # written back by save_pretrained: still readable
    return directory


def mean_prompt_tokens(max_len: int) -> float:
    """The trace's mean prompt length, each clipped to `max_len` (what the load sends)."""
    from loadgen.datasets import read_trace, trace_lengths

    lengths = trace_lengths(read_trace(TRACE), max_len)
    return sum(lengths) / len(lengths)


@dataclass(frozen=True)
class Prepared:
    """A job ready to run: the spec's overrides, and its load's prompts."""

    overrides: dict[str, Any]
    prompt_tokens: float  # their mean, clipped: what the capacity in tokens is divided by
    max_prompt: int

    def load_args(self) -> list[str]:
        """The load generator's prompt options for this job (instead of fixed-length prompts)."""
        return ["--input-lens-from", str(TRACE), "--max-input-len", str(self.max_prompt)]


def prepare(size: str, workdir: Path, pp: int) -> Prepared:
    job = SIZES[size]
    directory = make_model(job, workdir, pp)
    return Prepared(job.spec_overrides(directory, pp), mean_prompt_tokens(job.seq_len), job.seq_len)
