"""decoder: generates the rest of a completion from the KV cache a worker prefilled in a bubble.

For `/v1/completions` with ``max_tokens > 1`` the front door has the prompt prefilled inside the
pipeline bubbles as for any request; the answer carries the first token and the KV cache's handle.
The front door then publishes a `DecodeRequest` on its run's `bt:{<run>}:decode:requests`, and one of
the run's decoders (BUBBLETEA_RUN, as every service of the run):

1. loads the KV cache: from the memory of the worker that prefilled it, over the data plane
   (`shared.dataplane.kv.KvClient`, one kept connection per holder; `prefill.kv_store: plane`), or from Redis
   (`shared.dataplane.kvstore.fetch_kv`, `redis`): safetensors bytes, whose metadata carry the prompt and
   its first token; a missing or expired cache, or a holder that is gone, fails the request explicitly
   (`FailureReason.KV_MISSING`: the front door answers 503 and the client may retry);
2. continues it token by token (`shared.model.generate.Continuation`: greedy, or seeded per
   position, so the tokens equal a local full generation with the same model) in a thread, so
   the event loop keeps the heartbeat and the other completions going;
3. sends the tokens to the accepting front door's results stream as `DecodeChunk`s, at least every
   `decode.chunk_ms` (a streamed completion arrives as it is generated), until `max_tokens` or a
   `stop` sequence in the completion's text (the first token's included); the last chunk says why
   it ended (the front door makes the text from the tokens and cuts it at the stop sequence);
4. frees the KV cache (a FREE to its holder, or a Redis DEL): none is left behind.

A request that carries its `prompt` (the front door placed the prompt on the decoder:
`shared.policies.prompt_placement`, the bubbles could not meet its TTFT objective) has no cache to
load: the decoder computes the prompt itself (`PrefillModel.prefill`, the same sampling as a
bubble's), sends its first token at once in a chunk of index 0, then continues as above.

The request's entry is acked only after its last chunk, so a decoder that dies mid-completion
leaves it pending for another, which starts it again from the KV cache (the front door drops
chunks it already has, by their `index`). Past its deadline a completion stops with a failure.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.decoder.metrics import DecoderMetrics
from shared.bus import Bus, Delivery
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec
from shared.control import serving
from shared.control.health import Heartbeat, instance_id
from shared.dataplane import kvstore
from shared.dataplane.kv_client import KvClient
from shared.model.generate import Continuation
from shared.model.prefill import PrefillModel
from shared.model.tokenizer import find_stop, tokenizer_for
from shared.runtime.logs import get_logger
from shared.service.telemetry import MetricsServer
from shared.wire import DecodeChunk, DecodeRequest, WireError, keys
from shared.wire.status import FailureReason, RequestStatus

SERVICE = "decoder"

log = get_logger(__name__)


class Decoder:
    def __init__(self, bus: Bus, spec: ClusterSpec, model: PrefillModel, run: str) -> None:
        self.bus, self.spec, self.model, self.run = bus, spec, model, run
        self.metrics = DecoderMetrics(spec.prefill.model_name)
        #: KV caches on the data plane: one kept connection per holder (closed by `close`).
        self.kv = KvClient()
        self.tokenizer = tokenizer_for(spec.prefill)  # stop sequences are matched on the text
        self.chunk_s = spec.decode.chunk_ms / 1000
        self.running = 0
        self.completions = 0
        self.tokens = 0

    async def on_request(self, d: Delivery) -> None:
        req = d.message
        assert isinstance(req, DecodeRequest)
        self.running += 1
        try:
            await self._decode(req)
        finally:
            self.running -= 1

    async def _load(self, req: DecodeRequest) -> tuple[kvstore.StoredKV | None, str]:
        """The request's KV cache, from its holder's memory over the data plane or from Redis."""
        try:
            if req.kv_holder:
                data, why = await self.kv.fetch(req.kv_holder, req.id)
                return (kvstore.read_kv_file(data) if data is not None else None), why
            stored = await kvstore.fetch_kv(self.bus.redis, self.run, req.id)
        except WireError as exc:
            return None, f"the KV cache of {req.id} is unreadable: {exc}"
        return stored, f"no KV cache for {req.id}: it expired (prefill.kv_ttl_s) or was never stored"

    async def _compute(self, req: DecodeRequest) -> Continuation | None:
        """The decoder's own prefill of `req.prompt`: its continuation from the first token (None:
        the model refused the prompt, and the request was failed saying why)."""
        try:
            first = await asyncio.to_thread(self.model.prefill, req.prompt, temperature=req.temperature, seed=req.seed)
        except ValueError as exc:  # e.g. longer than the model's positions: the front door checks, but be safe
            await self._fail(req, 0, FailureReason.MODEL_REFUSED, f"the model cannot compute the prompt: {exc}")
            return None
        self.metrics.prompt(len(req.prompt))
        return Continuation(self.model, first.kv, len(req.prompt), first.token, req.temperature, req.seed)

    async def _free(self, req: DecodeRequest) -> None:
        if req.prompt:
            return  # computed here: its cache was never stored anywhere
        if req.kv_holder:
            freed, why = await self.kv.free(req.kv_holder, req.id)
            if not freed:  # expired meanwhile, or its holder is gone: nothing left behind either way
                log.info("KV cache not freed", id=req.id, reason=why)
        else:
            await kvstore.delete_kv(self.bus.redis, self.run, req.id)

    async def _decode(self, req: DecodeRequest) -> None:
        if req.prompt:
            c = await self._compute(req)
            if c is None:
                return
            sent = 0  # the first token is computed here: it goes out first, at once
        else:
            stored, why = await self._load(req)
            if stored is None:
                await self._fail(req, 1, FailureReason.KV_MISSING, why)
                return
            c = Continuation(self.model, stored.kv, len(stored.prompt), stored.first_token, req.temperature, req.seed)
            sent = 1  # the first token is the prefill's answer: the client has it
        finish, stop_reason = "length", None
        t0 = time.perf_counter()  # decoding starts: the first token is there
        last_token = [t0]  # when this completion's latest token came (its thread updates it)
        while True:
            if req.deadline is not None and time.time() > req.deadline:
                await self._fail(req, sent, FailureReason.DEADLINE, "deadline passed while decoding")
                return
            if sent and len(c.tokens) < req.max_tokens:
                try:
                    await asyncio.to_thread(self._steps, c, req.max_tokens, last_token)
                except ValueError as exc:  # e.g. past the model's positions: the front door checks, but be safe
                    await self._fail(req, sent, FailureReason.MODEL_REFUSED, f"the model cannot continue: {exc}")
                    return
            eos = next((i for i in range(sent, len(c.tokens)) if c.tokens[i] in req.eos), None)
            if eos is not None:  # the model ended the completion: nothing after its EOS token counts
                del c.tokens[eos + 1 :]
            hit = find_stop(self.tokenizer.decode(c.tokens), req.stop) if req.stop else None
            if hit is not None:
                finish, stop_reason = "stop", hit[1]
            elif eos is not None:
                finish = "stop"  # vLLM's finish reason for an EOS token (stop_reason stays None)
            done = hit is not None or eos is not None or len(c.tokens) >= req.max_tokens
            chunk = DecodeChunk(
                id=req.id,
                index=sent,
                tokens=tuple(c.tokens[sent:]),
                done=done,
                finish_reason=finish if done else None,
                stop_reason=stop_reason,
            )
            await self._send(req, chunk)
            sent = len(c.tokens)
            if done:
                break
        await self._free(req)
        self.completions += 1
        self.tokens += len(c.tokens) - 1
        self.metrics.finished(finish, len(c.tokens) - 1, time.perf_counter() - t0)
        log.info(
            "completion decoded",
            id=req.id,
            tokens=len(c.tokens),
            prompt_computed_here=bool(req.prompt),
            finish_reason=finish,
            tokens_per_s=round((len(c.tokens) - 1) / max(time.perf_counter() - t0, 1e-9), 1),
        )

    def _steps(self, c: Continuation, max_tokens: int, last_token: list[float]) -> None:
        """Generate until `chunk_s` has passed or the completion is long enough (in a thread)."""
        until = time.perf_counter() + self.chunk_s
        while len(c.tokens) < max_tokens:
            c.step()
            now = time.perf_counter()
            self.metrics.token(now - last_token[0])  # this completion's gap: others run in their own threads
            last_token[0] = now
            if now >= until:
                return

    async def _send(self, req: DecodeRequest, chunk: DecodeChunk) -> None:
        await self.bus.publish(req.reply_to, chunk, maxlen=serving.RESULTS_MAXLEN)

    async def _fail(self, req: DecodeRequest, index: int, reason: FailureReason, why: str) -> None:
        chunk = DecodeChunk(id=req.id, index=index, done=True, status=RequestStatus.FAILED, reason=reason, error=why)
        await self._send(req, chunk)
        await self._free(req)
        self.metrics.failed(reason)
        log.info("completion failed", id=req.id, reason=reason.value, detail=why)

    def info(self) -> dict[str, object]:
        return {"running": self.running, "completions": self.completions, "tokens": self.tokens}

    async def close(self) -> None:
        await self.kv.close()


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    spec = settings.spec
    model = await asyncio.to_thread(PrefillModel.from_spec, spec.prefill)
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE) as bus:
        d = Decoder(bus, spec, model, settings.run)
        me = f"{SERVICE}-{instance_id()}"

        async def refresh() -> None:
            d.metrics.running(d.running)
            await d.metrics.streams.refresh(bus.redis)

        server = MetricsServer(
            d.metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=refresh,
            api_key=settings.metrics_key,
        )
        url = await server.start()
        hb = Heartbeat(bus.redis, SERVICE, instance_id(), lambda: {**d.info(), "run": settings.run, "metrics_url": url})
        config = msgspec.structs.replace(spec.bus, concurrency=spec.decode.concurrency)
        consumer = bus.consumer(
            keys.decode_requests_stream(settings.run),
            SERVICE,
            {DecodeRequest: d.on_request},
            name=me,
            config=config,
        )
        d.metrics.streams.add(consumer)
        await hb.start()
        try:
            async with consumer:
                log.info("decoder ready", model=spec.prefill.model_name, concurrency=spec.decode.concurrency)
                while not stop.is_set() and not consumer.crashed.is_set():
                    try:
                        async with asyncio.timeout(1.0):
                            await stop.wait()
                    except TimeoutError:
                        pass
        finally:
            await d.close()  # after the consumer: its last completions may still free their caches
            await server.stop()
        await hb.stop()
        if consumer.error is not None:
            raise RuntimeError(f"the decode request consumer crashed: {consumer.error!r}")
