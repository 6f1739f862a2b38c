"""A spare made ready while it waits (issue 49: "spares that are ready").

A spare worker (every slot held when it started) waits for a slot to free. Meanwhile it loads what
every slot of the run needs alike: the training corpus and the served prefill model (on the CPU:
the slot's device is known only once it has one). When it takes a slot, those are there; what is
left is the slot's own stage and its data plane. The training stage itself depends on the slot
(its stage, its device), so it is built after, as by any worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.model.prefill import PrefillModel
from shared.model.training import Corpus, load_corpus
from shared.runtime.logs import get_logger
from shared.spec.config import ClusterSpec

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
