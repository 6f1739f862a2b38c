"""A worker's models made ready before they are needed: a spare's while it waits (issue 49: "spares
that are ready"), and every worker's guest model, placed and warmed up at set-up (`guest_model`).

A spare worker (every slot held when it started) waits for a slot to free. Meanwhile it loads what
every slot of the run needs alike: the training corpus and the served prefill model (on the CPU:
the slot's device is known only once it has one). When it takes a slot, those are there; what is
left is the slot's own stage and its data plane. The training stage itself depends on the slot
(its stage, its device), so it is built after, as by any worker.

Tested by: tests/unit/test_guest_model.py, tests/unit/test_cuda_rules.py, tests/e2e/test_cuda.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.config.spec import ClusterSpec
from shared.model.devices import guest_dtype
from shared.model.prefill import PrefillModel
from shared.model.training import Corpus, load_corpus
from shared.runtime.logs import get_logger

log = get_logger(__name__)


@dataclass
class Warm:
    corpus: Corpus
    prefill: PrefillModel | None  # with BubbleTea on; on the CPU until the slot's device is known


def warm_up(spec: ClusterSpec) -> Warm:
    """Load, in the calling thread, what a spare can before it has a slot."""
    t0 = time.monotonic()
    corpus = load_corpus(spec)
    prefill = PrefillModel.from_spec(spec.prefill) if spec.bubbletea.enabled else None
    log.info(
        "spare ready: the corpus and the served model are loaded",
        seconds=round(time.monotonic() - t0, 3),
        served_model=spec.prefill.model_name if prefill is not None else "-",
    )
    return Warm(corpus, prefill)


def guest_model(spec: ClusterSpec, device: torch.device, built: PrefillModel | None = None) -> PrefillModel:
    """The guest model (`built` already: a spare's, `warm_up` above), on this worker's device (it creates
    its inputs where its weights are) in the guest's dtype there (`guest_dtype`: bfloat16 on a GPU),
    its blocks graphed where the spec asks and a GPU is (`bubbletea.cuda_graphs`: every graph
    captured now, before training's first step), and warmed up (`PrefillModel.warm_up`)."""
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    model = (built or PrefillModel.from_spec(spec.prefill)).place(device, guest_dtype(device, bf16_supported=bf16))
    if spec.bubbletea.cuda_graphs:
        if device.type == "cuda":
            model.use_graphs()
        else:
            log.info("bubbletea.cuda_graphs is on but this worker computes on the CPU: prefill runs eagerly")
    # Its first forward pays for the process's set-up: here, not in the first request's bubble.
    try:
        took = model.warm_up()
    except (RuntimeError, ValueError) as exc:  # a guest never stops training: the guest policy judges it
        log.warning("the prefill model's warm-up failed: its first requests pay for its set-up", error=str(exc))
    else:
        log.info("prefill model warmed up", device=str(device), ms=round(took * 1000, 1))
    return model


def model_bytes(model: PrefillModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())
