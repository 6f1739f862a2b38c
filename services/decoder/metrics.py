"""Prometheus metrics of the decoder, in its own registry, under vLLM's names for the same things
(with our prefix): what a dashboard built for vLLM's decode reads here too.

* `bubbletea:generation_tokens_total`: tokens generated (vLLM's `generation_tokens`), the
  prefill's first token not counted: the bubbles computed it;
* `bubbletea:time_per_output_token_seconds`: per completion, its decode time over the tokens it
  generated after the first (vLLM's TPOT histogram);
* `bubbletea:inter_token_latency_seconds`: per generated token, the time since the one before
  (vLLM's ITL histogram; tokens are generated one step at a time in the decoder's thread);
* `bubbletea:decoder_prompt_tokens_total`: tokens of the prompts the decoder computed itself
  (`shared.policies.prompt_placement` placed them here; vLLM's is `prompt_tokens`, a name the
  front door's own count of every answered prompt has here);
* `bubbletea:num_requests_running`: completions being decoded now (set at scrape time);
* `bubbletea:request_success_total{finished_reason}` and `bubbletea:request_failures_total{reason}`.

Tested by: tests/integration/test_decoder.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from shared.service.telemetry import FAST_BUCKETS, StreamMetrics
from shared.wire.status import FailureReason

#: Seconds per output token: from a fast GPU's few ms to a small CPU's tenths of a second.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class DecoderMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r, model = self.registry, ["model_name"]
        self.streams = StreamMetrics(r)
        self._tokens = Counter(
            "bubbletea:generation_tokens",
            "Tokens the decoder generated (the prefill's first token, computed in the bubbles, not counted).",
            model,
            registry=r,
        ).labels(model_name)
        self._tpot = Histogram(
            "bubbletea:time_per_output_token_seconds",
            "Per completion: its decode time over the tokens generated after the first (TPOT).",
            model,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._itl = Histogram(
            "bubbletea:inter_token_latency_seconds",
            "Per generated token: the time since the token before it (ITL).",
            model,
            buckets=FAST_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._prompt_tokens = Counter(
            "bubbletea:decoder_prompt_tokens",
            "Tokens of the prompts the decoder computed itself (placed on it, not in the bubbles).",
            model,
            registry=r,
        ).labels(model_name)
        self._running = Gauge(
            "bubbletea:num_requests_running", "Completions being decoded now.", model, registry=r
        ).labels(model_name)
        self._success = Counter(
            "bubbletea:request_success",
            "Completions decoded to their end, by why they ended (length: max_tokens; stop: a stop sequence or EOS).",
            [*model, "finished_reason"],
            registry=r,
        )
        self._failures = Counter(
            "bubbletea:request_failures",
            "Completions the decoder failed explicitly, by reason (kv_missing, deadline, model_refused).",
            [*model, "reason"],
            registry=r,
        )
        self.model_name = model_name
        for reason in ("length", "stop"):  # every series exists from the start, at 0
            self._success.labels(model_name, reason)
        for failure in (FailureReason.KV_MISSING, FailureReason.DEADLINE, FailureReason.MODEL_REFUSED):
            self._failures.labels(model_name, failure.value)

    def token(self, gap_s: float) -> None:
        """A token was generated `gap_s` after the one before it."""
        self._tokens.inc()
        self._itl.observe(max(0.0, gap_s))

    def prompt(self, tokens: int) -> None:
        """A prompt of `tokens` tokens was computed here."""
        self._prompt_tokens.inc(tokens)

    def finished(self, reason: str, generated: int, decode_s: float) -> None:
        """A completion ended (`reason`: length or stop) after `generated` tokens past the first."""
        self._success.labels(self.model_name, reason).inc()
        if generated > 0:
            self._tpot.observe(decode_s / generated)

    def failed(self, reason: FailureReason) -> None:
        self._failures.labels(self.model_name, reason.value).inc()

    def running(self, n: int) -> None:
        self._running.set(n)
