"""A finished prefill's first token, read off the device after it is there, not by the thread that
ran the prefill (`PrefillModel.finish_async`).

On a GPU the prompt's last logits are computed (the final norm and head) and copied into pinned
host memory without blocking, behind an event, on the finishing lane (`Lane.finishing`: as urgent
as training; on prefill's low-priority lane training's kernels could starve that one GEMM and copy
past the bubble, and the answer with them); the prefill thread goes straight on to the next block. Whoever
answers the request (off the training path) waits for that event and samples the token and reads
the logprobs on the host in a thread (`result`: `Outcome.read`). On the CPU the logits are already
on the host: `ready` at once, and the prefill thread reads the result itself, exactly what
`PrefillModel.finish` always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.model.causal import KV
from shared.model.lanes import Lane
from shared.model.prefill_state import PrefillResult
from shared.model.sampling import sample
from shared.model.tokenizer import Tokenizer, token_text


def to_host(logits: Tensor, lane: Lane) -> tuple[Tensor, torch.cuda.Event | None]:
    """`logits` (vocab,), launched on `lane`, on their way to the host as float32: on a GPU a copy
    into pinned memory on `lane` and the event it passes once done; elsewhere the host's at once."""
    if lane.stream is None:
        return logits.float().cpu(), None
    with torch.inference_mode(), lane.scope():
        host = torch.empty(logits.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(logits, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # on the lane's stream (the scope's current stream)
    return host, event


@dataclass
class Finishing:
    """A done prefill whose last logits are on their way to the host."""

    logits: Tensor  # (vocab,) float32 on the host, written by a copy until `ready`
    event: torch.cuda.Event | None  # passed once the copy is done (None: on the host already)
    temperature: float
    seed: int | None
    top_logprobs: int
    prompt_tokens: int
    kv: list[KV]
    tokenizer: Tokenizer

    def ready(self) -> bool:
        """Whether the logits are on the host (never blocks)."""
        return self.event is None or bool(self.event.query())

    def result(self) -> PrefillResult:
        """The first token (`sample`: the argmax at temperature 0, else a draw seeded by `seed`),
        its logprob and the top logprobs at temperature 1, on the host; blocks until `ready`."""
        if self.event is not None:
            self.event.synchronize()
        with torch.inference_mode():
            logits = self.logits
            logprobs = F.log_softmax(logits, dim=-1)  # (vocab,)
            token = sample(logits, self.temperature, seed=self.seed)
            k = min(self.top_logprobs, logits.shape[-1])
            top_vals, top_ids = torch.topk(logprobs, k)  # (k,), (k,): sorted, most likely first
        top = [(int(i), float(lp)) for i, lp in zip(top_ids.tolist(), top_vals.tolist(), strict=True)]
        return PrefillResult(
            token=token,
            text=token_text(self.tokenizer, token),
            logprob=float(logprobs[token].item()),
            top=top,
            prompt_tokens=self.prompt_tokens,
            kv=self.kv,
        )
