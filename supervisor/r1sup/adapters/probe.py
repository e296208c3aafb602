"""The load probe: real chat completions through the ``openai`` client, sized in tokens.

Prompts are built to a token count with the server's own ``/tokenize`` (chat form, so the template
is counted), each one different from its first word so that prefix caching cannot share KV blocks
between them. Requests run ``concurrency`` at a time; ``/metrics`` is polled meanwhile for the peak
KV-cache usage, the preemptions and the requests vLLM ran and queued (``vllm:num_requests_running``,
``vllm:num_requests_waiting``).

What the probe proves is the concurrency that really ran, not the one it sent: ``concurrency_proven``
is the most requests seen running at once, by vLLM's gauge or by the probe's own streams (two requests
whose tokens were arriving at the same time ran together), never more than were sent. Requests that
queued behind a full batch (``max_num_seqs``) or a full KV cache still succeed, so the probe passes,
and its result says so (``queued``, ``waiting_peak``); the capacity r1sup records and shows is the
proven figure (:mod:`r1sup.core.capacity`).

The probe runs in a child process (``python -m r1sup.adapters.probe``: the spec as JSON on stdin, the result
as JSON on stdout, read back once into a :class:`r1sup.core.probing.ProbeResult`), so that the openai
client, httpx and their pools never stay resident in the long-running supervisor, and a wedged client
can be killed. The API key travels on stdin, never argv.
The child imports the client before it reads its spec, so the runner starts it together with vLLM
(:class:`ProbeProcess`): the import (seconds on a small machine) overlaps the engine's start-up, and so
does building its clients (:class:`Clients`) when it is told the connection at its start. A child whose
stdin closes without a spec (r1sup stopped the launch, or died) exits at once; one that wrote its result
exits without the interpreter's teardown.

A launch with the flags of a saved profile that passed the full probe on a box of the same
fingerprint gets the short probe (:func:`probe_requests`): one wave of ``concurrency`` requests of the
same size, instead of ``probe.requests``. Where vLLM allocated at least the KV cache that full probe
passed with, its prompts are short (:func:`short_prompt_tokens`) and that probe's concurrency wave stands
for this launch's when it sent as many requests, all passed (:func:`proven_wave`): none is sent.

Once the context requests passed, the **concurrency wave** shows how many requests vLLM runs at once:
ordinary requests (``WAVE_PROMPT_TOKENS`` of prompt, at least ``WAVE_OUTPUT_TOKENS`` of output), all sent
at once, as many as the launch's ``max_num_seqs`` and vLLM's KV figure allow, up to
``probe.max_concurrency`` (:func:`wave_size`, computed by the runner), within what is left of the
probe's timeout. Its result (``wave``) has the same figures as the context requests' (running and
waiting peaks, streams, proven, tokens/s, TTFT); a failed wave request fails the probe. A wave that all
passed with none waiting, yet showed fewer at once than it sent (answers too fast to overlap, or a starved
API server writing each in one burst), is sent once more with ``WAVE_LONGER`` times the output tokens
(:func:`longer_wave_tokens`, within the context), and the longer wave is the record.

A request whose connection failed (:func:`request_fault`: refused, reset, never an answer of vLLM's,
before its first token or in the middle of its stream) is sent again after each wait of ``RETRY_S``
before it counts (``retried``); so is one answered with a 5xx that is not vLLM's engine-dead reply,
before its stream or in it (``server_retried``: a proxy's 502/503, vLLM's ``cannot schedule new futures
after shutdown``, the ``Internal server error`` event of a request that failed in generation). One that
still failed so after its retries (``connection_errors``, ``server_errors``) has the probe ask
``/health`` (``health_ok``), the engine's own word: only the engine's evidence (an ``EngineDeadError``
answer or error event, never retried; a failing ``/health``; its process gone) is its death. A 4xx
answer is counted apart (``rejected``): r1sup's own request was wrong.

A request that got no answer within ``probe.request_timeout_s`` (``request_timeouts``) is not sent again
and is no evidence of death either: the engine may be busy (a flood beside the probe, a loaded machine).
The probe keeps, with the time of each ``/metrics`` read, vLLM's prompt and generation token counters,
and records the fewest tokens they moved by while one timed-out request waited
(``timeout_progress_tokens``, :func:`progress_while_waiting`; None when ``/metrics`` gave no two
readings in any such wait), and asks ``/health``. The runner classes the result from these
(:func:`r1sup.core.probing.probe_failure`).

The prompts are deterministic (seeded by their number), so what the sizing found (the words each prompt
kept, its token count, a digest of its text) is recorded with the result (``sizing``) and saved in the
profile. A later probe of the same flags reuses it (:func:`recorded_prompt`) when it was made for the
same served model and the same prompt size and the rebuilt text has the same digest; one ``/tokenize``
call then checks that this server still counts the first prompt as recorded (another chat template or
tokenizer under the same fingerprint does not) before the record stands in for the sizing round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from r1sup.core.liveness import engine_dead_reply
from r1sup.core.probing import ProbeFault, ProbeResult, Wave

if TYPE_CHECKING:
    import httpx

WORDS = (
    "river stone lantern orbit quiet copper meadow signal harbor velvet thunder pixel garden "
    "marble compass falcon ember glacier violet canyon anchor willow saffron beacon cobalt "
    "prairie summit harvest lattice nectar quartz tundra zephyr mosaic cinder delta fjord grove "
    "horizon island jade kernel ledger mirror nimbus oasis pepper quiver ripple sierra timber "
    "umber vertex walnut yonder"
).split()
PROMPT_MARGIN_FRACTION = 0.02
PROMPT_MARGIN_TOKENS = 8
PROMPT_FILL = 0.97  # a built prompt holds at least this fraction of the tokens asked for
SHORT_PROMPT_TOKENS = 64  # a short probe's prompts once vLLM's KV figure matches the proven launch's
POLL_S = 0.05  # /metrics is read this often while the requests run
WAVE_PROMPT_TOKENS = 256  # the prompt of an ordinary request, as the concurrency wave sends it
WAVE_OUTPUT_TOKENS = 32  # at least this many tokens each, so that the wave's streams overlap in time
WAVE_LONGER = 4  # a wave too short to show what ran at once is sent again with this many times the tokens
WAVE_SEED = 100_000  # the wave's prompts are seeded from here (never a context prompt's seed)
# a request whose connection failed (refused, reset: a listen backlog that overflowed on a loaded box), or
# that was answered with a 5xx that is not vLLM's engine-dead reply, is sent again after each of these
# waits, then counts as failed
RETRY_S = (0.25, 0.5, 1.0)
RETRIED_FAULTS = frozenset({"connection", "server"})  # the faults of request_fault that are sent again
TIMEOUT = "timeout"  # request_fault's fault of a request that got no answer in time: counted, not sent again


@dataclass(frozen=True)
class ProbeSpec:
    base_url: str  # http://host:port (no /v1)
    model: str
    requests: int
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    request_timeout_s: float
    timeout_s: float
    api_key: str | None = None
    sizing: dict[str, Any] | None = None  # a passed probe's record of its prompts (ProbeResult.sizing)
    # the concurrency wave (:func:`wave_size`): this many ordinary requests sent at once after the
    # context requests passed, with prompts of ``wave_prompt_tokens``; 0: none
    wave_requests: int = 0
    wave_prompt_tokens: int = WAVE_PROMPT_TOKENS
    context: int = 0  # the launch's max_model_len (0: unknown): the most a longer wave may ask


def wave_output_tokens(output_tokens: int) -> int:
    """max_tokens of each of the wave's requests: the probe's, and at least ``WAVE_OUTPUT_TOKENS``."""
    return max(output_tokens, WAVE_OUTPUT_TOKENS)


def longer_wave_tokens(output_tokens: int, prompt_tokens: int, context: int) -> int:
    """max_tokens of a wave sent again because the first was too short to overlap: ``WAVE_LONGER``
    times as many, within what the context leaves after the prompt and its template margin (0:
    unknown context, as many as asked); never fewer than the first wave's."""
    longer = output_tokens * WAVE_LONGER
    if context > 0:
        longer = min(longer, context - prompt_tokens - prompt_margin(context))
    return max(output_tokens, longer)


def wave_size(
    cap: int, max_num_seqs: int | None, kv_cache_tokens: float | None, block_size: int, request_tokens: int
) -> int:
    """How many ordinary requests of ``request_tokens`` (prompt and output) the concurrency wave sends
    at once: what vLLM would run together, bounded by ``cap`` (``probe.max_concurrency``).

    vLLM runs at most ``max_num_seqs`` sequences (None: vLLM's default, 256 or more on GPUs; where it
    is lower than the cap the requests beyond it wait, and the wave records what ran) and admits
    a request only when the KV blocks it holds are free: of vLLM's own ``KV cache size`` figure (None:
    not printed, the gauges will say what ran) the blocks less one (vLLM keeps a null block), each
    request taking its tokens rounded up to whole blocks. Never below 1."""
    n = cap
    if max_num_seqs:
        n = min(n, max_num_seqs)
    if kv_cache_tokens is not None and block_size > 0:
        blocks = int(kv_cache_tokens) // block_size - 1
        each = -(-max(1, request_tokens) // block_size)
        n = min(n, blocks // each)
    return max(1, n)


def probe_requests(
    requests: int, concurrency: int, prompt_tokens: int, proven: ProbeResult | None
) -> tuple[int, bool]:
    """(requests to send, short) for a probe of ``requests`` at ``concurrency`` with prompts of
    ``prompt_tokens``, given the probe record of a saved profile with the same flags (None: none).

    The short probe is one wave of ``concurrency`` requests. It is given only when that record passed
    every request of a probe at least as large as this one (as many requests, as many at once,
    prompts as long, within what a built prompt may fall short). It still sends its prompts at the
    target concurrency through the openai client and streams their tokens, so an engine that cannot
    take a request (dead behind a /health that answers, failing at its first real request) fails it
    as it fails the full probe; what it leaves out is the repeat waves that the same engine on the
    same box has already passed. Its prompts are full-size unless vLLM's KV figure shows the capacity
    they proved (:func:`short_prompt_tokens`).
    """
    if proven is None or not proven.ok or concurrency >= requests:
        return requests, False
    sent, succeeded, at_once, size = (
        proven.requests,
        proven.succeeded,
        proven.concurrency,
        proven.prompt_tokens,
    )
    if sent is None or succeeded is None or succeeded < sent or sent < requests:
        return requests, False
    if at_once is None or at_once < concurrency:
        return requests, False
    if size is None or size < prompt_tokens * PROMPT_FILL:
        return requests, False
    return concurrency, True


def short_prompt_tokens(full: int, proven_kv_tokens: float | None, kv_tokens: float | None) -> int | None:
    """The prompt size of a short probe whose full-length prompts may be left out, or None.

    A full probe of the same flags passed on this box with a KV cache of ``proven_kv_tokens`` (vLLM's
    own figure then); when vLLM allocated at least as much this launch (``kv_tokens``), the capacity
    those prompts proved is shown again by vLLM's figure, and the prompts only need to prove that the
    engine serves: ``SHORT_PROMPT_TOKENS`` each, still at the target concurrency through the openai
    client. A smaller cache (another process holds memory now), or a figure vLLM did not print, keeps
    the full-length prompts."""
    if proven_kv_tokens is None or kv_tokens is None or kv_tokens < proven_kv_tokens:
        return None
    return min(full, SHORT_PROMPT_TOKENS)


def proven_wave(proven: Wave | None, size: int) -> Wave | None:
    """The concurrency wave a full probe of the same flags passed on this box, to stand for this
    launch's wave of ``size`` requests, or None (the wave is sent). Given only where the short probe's
    prompts are short (:func:`short_prompt_tokens`: vLLM allocated at least the KV cache that probe
    passed with, so the same requests fit at once): a wave that was sent, at least ``size`` requests,
    every one of which passed. vLLM's figure allowing more than it sent, or a wave left out or failed
    then, sends it again."""
    if proven is None or proven.skipped is not None or proven.concurrency_proven is None:
        return None
    if (
        proven.sent is None
        or proven.succeeded is None
        or proven.sent < size
        or proven.succeeded < proven.sent
    ):
        return None
    return proven


def prompt_margin(context: int) -> int:
    """Tokens a request leaves free of its ``context`` for the chat template's rounding."""
    return max(PROMPT_MARGIN_TOKENS, int(context * PROMPT_MARGIN_FRACTION))


def default_prompt_tokens(context: int, output_tokens: int) -> int:
    """Near the context limit, leaving room for the output and the chat template's rounding."""
    return max(1, context - output_tokens - prompt_margin(context))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def parse_metrics(text: str) -> dict[str, float]:
    """The figures the probe records, from Prometheus text: the KV usage (the largest label set), and
    the preemptions, the running and waiting requests and the prompt and generation tokens processed
    (``tokens``: summed over label sets, one per engine)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            out["kv_usage"] = max(out.get("kv_usage", 0.0), value)
        elif name == "vllm:num_preemptions_total":
            out["preemptions"] = out.get("preemptions", 0.0) + value
        elif name == "vllm:num_requests_running":
            out["running"] = out.get("running", 0.0) + value
        elif name == "vllm:num_requests_waiting":
            out["waiting"] = out.get("waiting", 0.0) + value
        elif name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            out["tokens"] = out.get("tokens", 0.0) + value
    return out


PEAKS = ("kv_usage", "running", "waiting")  # the figures whose largest sample the probe keeps


def keep_peaks(peaks: dict[str, float], sample: Mapping[str, float]) -> None:
    for key in PEAKS:
        if key in sample:
            peaks[key] = max(peaks.get(key, 0.0), sample[key])


def progress_while_waiting(
    readings: list[tuple[float, float]], waits: list[tuple[float, float]]
) -> int | None:
    """The fewest tokens vLLM's counters moved by while one of ``waits`` lasted (``(start, end)`` of a
    request that got no answer in time, from its last token or its start, monotonic), from ``readings``
    (``(time, tokens)`` of the /metrics reads, in time order): each wait's last reading in it less its
    first. A wait with fewer than two readings in it says nothing; None when none had two (progress
    unknown, never taken for a stall)."""
    moved: list[float] = []
    for start, end in waits:
        inside = [tokens for at, tokens in readings if start <= at <= end]
        if len(inside) >= 2:
            moved.append(max(0.0, inside[-1] - inside[0]))
    return int(min(moved)) if moved else None


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most ``(start, end)`` spans open at one moment (a span ending as another starts does not
    overlap it; a span of one instant, a request of one token, counts alone): how many requests were
    delivering tokens together."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return max(best, 1) if spans else 0


def proven_concurrency(sent: int, running_peak: int | None, streams_peak: int) -> int:
    """Requests proven to run at once: the larger of vLLM's running gauge at its peak and the streams
    seen delivering together (each only ever undercounts), never more than were sent at once."""
    return max(0, min(sent, max(running_peak or 0, streams_peak)))


def _pool(seed: int, words: int) -> list[str]:
    """The first ``words`` words of prompt ``seed`` (the first is its own, so no two share a prefix);
    a longer pool of the same seed starts with the same words."""
    rng = random.Random(seed)
    return [f"r{seed}"] + [rng.choice(WORDS) for _ in range(words - 1)]


def prompt_text(seed: int, words: int) -> str:
    """The text of prompt ``seed`` cut at ``words`` words."""
    return " ".join(_pool(seed, words))


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as the server's /tokenize counted it (chat form), or estimated
    words: int

    def record(self) -> dict[str, Any]:
        return {"words": self.words, "tokens": self.tokens, "sha256": text_digest(self.text)}


def sizing_record(model: str, target: int, prompts: list[Prompt]) -> dict[str, Any]:
    return {"model": model, "prompt_tokens": target, "prompts": [p.record() for p in prompts]}


def recorded_prompt(sizing: Mapping[str, Any] | None, model: str, target: int, seed: int) -> Prompt | None:
    """Prompt ``seed`` of ``target`` tokens for ``model`` rebuilt from a sizing record, or None when the
    record does not hold it: none, another model or size, no entry for this seed, an unreadable entry,
    or a rebuilt text whose digest differs (the way prompts are built changed)."""
    if not sizing or sizing.get("model") != model or sizing.get("prompt_tokens") != target:
        return None
    entries = sizing.get("prompts")
    if not isinstance(entries, list) or seed >= len(entries) or not isinstance(entries[seed], Mapping):
        return None
    entry = entries[seed]
    words, tokens, digest = entry.get("words"), entry.get("tokens"), entry.get("sha256")
    if not (_count(words) and _count(tokens) and isinstance(digest, str)) or tokens > target:
        return None
    text = prompt_text(seed, words)
    return Prompt(text, tokens, words) if text_digest(text) == digest else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _Prompts:
    def __init__(self, http: httpx.AsyncClient, spec: ProbeSpec) -> None:
        self.http = http
        self.spec = spec
        self.estimated = False
        self.calls = 0

    async def count(self, text: str) -> int | None:
        import httpx

        body = {"model": self.spec.model, "messages": [{"role": "user", "content": text}]}
        self.calls += 1
        try:
            resp = await self.http.post("/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return int(resp.json()["count"])
        except (ValueError, KeyError, TypeError):
            return None

    async def build(self, seed: int, target: int) -> Prompt:
        """A prompt of at most ``target`` tokens (within a few percent), distinct per seed."""
        pool = _pool(seed, 1 + max(16, target * 2))
        n = max(1, target // 2)
        best = Prompt(pool[0], 1, 1)
        for _ in range(8):
            n = min(n, len(pool))
            text = " ".join(pool[:n])
            count = await self.count(text)
            if count is None:  # no /tokenize: estimate 1 token per word plus template
                self.estimated = True
                words = max(1, target - 16)
                return Prompt(" ".join(pool[:words]), target, words)
            if count <= target:
                best = Prompt(text, count, n)
                if count >= target * PROMPT_FILL or n == len(pool):
                    break
            ratio = count / n
            n = max(1, int((target - 2) / ratio)) if count > target else max(n + 1, int(n * target / count))
        return best

    async def all(self) -> tuple[list[Prompt], bool]:
        """The spec's prompts, and whether they came from its sizing record: every one it holds, once
        this server has counted the first as recorded; else each sized with /tokenize."""
        spec = self.spec
        recorded = [
            recorded_prompt(spec.sizing, spec.model, spec.prompt_tokens, i) for i in range(spec.requests)
        ]
        first = recorded[0] if recorded else None
        if first is not None and await self.count(first.text) == first.tokens:
            return [
                p if p is not None else await self.build(i, spec.prompt_tokens)
                for i, p in enumerate(recorded)
            ], True
        return [await self.build(i, spec.prompt_tokens) for i in range(spec.requests)], False


@dataclass(frozen=True)
class Connection:
    """What the probe's clients are built from; known at the launch, before the spec."""

    base_url: str  # http://host:port (no /v1)
    request_timeout_s: float
    api_key: str | None = None

    @classmethod
    def of(cls, spec: ProbeSpec) -> Connection:
        return cls(spec.base_url, spec.request_timeout_s, spec.api_key)


class Clients:
    """The probe's two clients (httpx for /tokenize and /metrics, openai for the requests). Building
    them costs a fifth of a second on the 2-core test box (each loads the CA bundle, though vLLM is
    reached over plain HTTP), so the child builds them while vLLM loads when it is told the
    connection at its start; they are bound to no event loop until their first request."""

    def __init__(self, conn: Connection) -> None:
        import httpx
        import openai

        self.conn = conn
        headers = {"Authorization": f"Bearer {conn.api_key}"} if conn.api_key else {}
        timeout = httpx.Timeout(conn.request_timeout_s)
        self.http = httpx.AsyncClient(base_url=conn.base_url, headers=headers, timeout=timeout)
        self.openai = openai.AsyncOpenAI(
            base_url=conn.base_url + "/v1",
            api_key=conn.api_key or "r1sup-no-key",
            timeout=conn.request_timeout_s,
            max_retries=0,
        )


@dataclass
class _Sent:
    """What one batch of requests did: sent ``concurrency`` at a time (the context requests), or all
    at once (the concurrency wave)."""

    succeeded: int = 0
    error_count: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens_total: int = 0
    ttfts: list[float] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (first, last token), monotonic
    peaks: dict[str, float] = field(default_factory=dict)  # /metrics while they ran, and just after
    final: dict[str, float] = field(default_factory=dict)  # /metrics just after
    duration_s: float = 0.0
    timed_out: bool = False
    retried: int = 0  # requests sent again after their connection failed
    connection_errors: int = 0  # requests that failed on the connection after every retry
    rejected: int = 0  # requests vLLM answered with a 4xx
    server_retried: int = 0  # requests sent again after a 5xx that is not vLLM's engine-dead reply
    server_errors: int = 0  # requests answered with such a 5xx after every retry
    timeouts: int = 0  # requests that got no answer within probe.request_timeout_s (never sent again)
    # (its last token, or its start, and its end) of each of those, monotonic: how long it waited in vain
    waits: list[tuple[float, float]] = field(default_factory=list)
    readings: list[tuple[float, float]] = field(default_factory=list)  # (time, tokens) of /metrics reads

    def tokens_per_s(self) -> float | None:
        return round(self.output_tokens_total / self.duration_s, 2) if self.duration_s > 0 else None

    def note(self, error: str) -> None:
        """A failed request's line: the first few are kept."""
        if len(self.errors) < 5:
            self.errors.append(error)


async def _send(
    http: httpx.AsyncClient,
    client: Any,
    spec: ProbeSpec,
    texts: list[str],
    concurrency: int,
    timeout_s: float,
    label: str,
    output_tokens: int,
) -> _Sent:
    """Send ``texts`` as streamed chat completions, ``concurrency`` at a time, within ``timeout_s``;
    /metrics is polled meanwhile."""
    sent = _Sent()
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_metrics(http, sent.peaks, stop, sent.readings))
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    heard: dict[int, float] = {}  # each request in flight: its last token, or its start before one

    async def attempt(i: int) -> tuple[str, BaseException] | None:
        """Request ``i`` once: None when it passed or failed for good (recorded here); (fault, error)
        when it failed in a way that may be sent again (:data:`RETRIED_FAULTS`): on the connection, or
        with a 5xx that is not vLLM's engine-dead reply, before its stream or in its middle (what
        came of it is dropped: only a request that passed counts its tokens)."""
        start = time.monotonic()
        first: float | None = None
        last = heard[i] = start  # its last token (its start before one): a timed-out request waited since
        tokens = 0
        try:
            stream = await client.chat.completions.create(
                model=spec.model,
                messages=[{"role": "user", "content": texts[i]}],
                max_tokens=output_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage_tokens = None
            async for chunk in stream:
                if chunk.choices and delivers(chunk.choices[0]):
                    last = heard[i] = time.monotonic()
                    if first is None:
                        first = last - start
                    tokens += 1
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
            sent.output_tokens_total += usage_tokens if usage_tokens is not None else tokens
            if first is not None:
                sent.ttfts.append(first)
                sent.spans.append((start + first, last))
            sent.succeeded += 1
            return None
        except Exception as exc:
            if not request_error(exc):
                raise  # r1sup's own bug: the child fails and the parent says so
            kind = request_fault(exc)
            if kind in RETRIED_FAULTS:
                return kind, exc
            sent.error_count += 1
            if kind == "rejected":
                sent.rejected += 1
            if kind == TIMEOUT:  # no answer in time: the engine may be busy; what it did meanwhile decides
                sent.timeouts += 1
                sent.waits.append((last, time.monotonic()))
                waited = f"no answer within probe.request_timeout_s ({spec.request_timeout_s:g}s)"
                sent.note(f"{label} {i}: {waited}: {error_line(exc)}")
                return None
            sent.note(f"{label} {i}: {error_line(exc)}")
            return None

    async def one(i: int) -> None:
        async with sem:
            again: set[str] = set()  # the faults request i was sent again after
            for n, delay in enumerate((*RETRY_S, None)):
                failed = await attempt(i)
                if failed is None:
                    return
                kind, exc = failed
                if delay is None:  # failed so every time: it counts, the last fault's way
                    sent.error_count += 1
                    if kind == "connection":
                        sent.connection_errors += 1
                    else:
                        sent.server_errors += 1
                    sent.note(f"{label} {i}: {error_line(exc)} (sent {n + 1} times)")
                    return
                if kind not in again:
                    again.add(kind)
                    if kind == "connection":
                        sent.retried += 1
                    else:
                        sent.server_retried += 1
                await asyncio.sleep(delay)

    tasks = [asyncio.create_task(one(i)) for i in range(len(texts))]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(0.001, timeout_s))
    except asyncio.TimeoutError:
        sent.timed_out = True
        # the requests still in flight at the deadline waited since their last token, as a timed-out one
        now = time.monotonic()
        sent.waits.extend((heard[t], now) for t, task in enumerate(tasks) if t in heard and not task.done())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sent.error_count = len(texts) - sent.succeeded
        sent.errors.append(f"probe timed out after {timeout_s:.0f}s")
    sent.duration_s = time.monotonic() - t0
    stop.set()
    await poller
    sent.final = await _scrape(http)
    keep_peaks(sent.peaks, sent.final)
    return sent


def _proven(sent: _Sent, at_once: int) -> tuple[int | None, int | None, int, int]:
    """(running peak, waiting peak, streams peak, requests proven at once) of requests sent
    ``at_once`` at a time."""
    running = waiting = None
    if "running" in sent.peaks:
        running = int(sent.peaks["running"])
        waiting = int(sent.peaks.get("waiting", 0.0))
    streams = most_at_once(sent.spans)
    return running, waiting, streams, proven_concurrency(at_once, running, streams)


async def _run(spec: ProbeSpec, ready: Clients | None = None) -> ProbeResult:
    clients = (
        ready if ready is not None and ready.conn == Connection.of(spec) else Clients(Connection.of(spec))
    )
    client = clients.openai
    async with clients.http as http:
        prompts = _Prompts(http, spec)
        baseline = await _scrape(http)
        built, sizing_reused = await prompts.all()  # all first, so the load itself is concurrent
        t0 = time.monotonic()
        texts = [p.text for p in built]
        main = await _send(
            http, client, spec, texts, spec.concurrency, spec.timeout_s, "request", spec.output_tokens
        )
        wave: _Sent | None = None
        record: Wave | None = None
        calls = prompts.calls  # the context prompts' sizing (the wave sizes one prompt of its own)
        if spec.wave_requests:
            wave, record = await _wave(http, client, spec, prompts, main, t0)
        lost = main.connection_errors + (wave.connection_errors if wave is not None else 0)
        answered = main.server_errors + (wave.server_errors if wave is not None else 0)
        timeouts = main.timeouts + (wave.timeouts if wave is not None else 0)
        late = main.timed_out or (wave is not None and wave.timed_out)  # a deadline of the probe's passed
        # the engine's word, not the connection's, a 5xx's that is not vLLM's engine-dead reply, nor a
        # request's that got no answer in time, nor the probe's deadline
        health = await _healthy(http) if lost or answered or timeouts or late else None
        await client.close()
    error_count, errors, timed_out = main.error_count, list(main.errors), main.timed_out
    metrics = main.peaks
    if "kv_usage" in baseline:  # the baseline came before any request: only its KV usage counts
        metrics["kv_usage"] = max(metrics.get("kv_usage", 0.0), baseline["kv_usage"])
    final = main.final
    if wave is not None:
        final = wave.final or final
        if "kv_usage" in wave.peaks:
            metrics["kv_usage"] = max(metrics.get("kv_usage", 0.0), wave.peaks["kv_usage"])
        error_count += wave.error_count
        errors.extend(wave.errors[: max(0, 5 - len(errors))])
        timed_out = timed_out or wave.timed_out
    sent = min(spec.concurrency, spec.requests)
    running, waiting, streams, proven = _proven(main, sent)
    preemptions = None
    if "preemptions" in final:
        preemptions = int(final["preemptions"] - baseline.get("preemptions", 0.0))
    wave_ok = wave is None or wave.error_count == 0
    return ProbeResult(
        ok=main.succeeded == spec.requests and not timed_out and wave_ok,
        requests=spec.requests,
        succeeded=main.succeeded,
        error_count=error_count,
        errors=tuple(errors),
        concurrency=spec.concurrency,
        prompt_tokens=max(p.tokens for p in built),
        prompt_tokens_estimated=prompts.estimated,
        sizing=None if prompts.estimated else sizing_record(spec.model, spec.prompt_tokens, built),
        sizing_reused=sizing_reused,
        tokenize_calls=calls,
        output_tokens=spec.output_tokens,
        output_tokens_total=main.output_tokens_total,
        ttft_p50_s=_round(percentile(main.ttfts, 0.5)),
        ttft_p95_s=_round(percentile(main.ttfts, 0.95)),
        output_tokens_per_s=main.tokens_per_s(),
        duration_s=round(main.duration_s, 3),
        peak_kv_usage=round(metrics["kv_usage"], 4) if "kv_usage" in metrics else None,
        preemptions=preemptions,
        running_peak=running,
        waiting_peak=waiting,
        streams_peak=streams,
        concurrency_proven=proven,
        queued=main.succeeded > 0 and proven < sent,
        timed_out=timed_out,
        retried=main.retried + (wave.retried if wave is not None else 0),
        connection_errors=lost,
        rejected=main.rejected + (wave.rejected if wave is not None else 0),
        server_retried=main.server_retried + (wave.server_retried if wave is not None else 0),
        server_errors=answered,
        health_ok=health,
        request_timeouts=timeouts,
        timeout_progress_tokens=_waited(main, wave) if timeouts or late else None,
        wave=record,
    )


def _waited(main: _Sent, wave: _Sent | None) -> int | None:
    """:func:`progress_while_waiting` over the timed-out requests of the context requests and the wave,
    and those still in flight when a deadline of the probe passed."""
    found = [
        moved
        for sent in (main, wave)
        if sent is not None and sent.waits
        if (moved := progress_while_waiting(sent.readings, sent.waits)) is not None
    ]
    return min(found) if found else None


async def _wave(
    http: httpx.AsyncClient,
    client: Any,
    spec: ProbeSpec,
    prompts: _Prompts,
    main: _Sent,
    t0: float,
) -> tuple[_Sent | None, Wave]:
    """The concurrency wave: ``spec.wave_requests`` ordinary requests sent at once, once the context
    requests all passed, within what is left of the probe's timeout (and one request's). Its prompts
    are one sized prompt's word count over distinct seeds (the first word differs), so their size is
    that prompt's, within a token or two."""
    n = spec.wave_requests
    output = wave_output_tokens(spec.output_tokens)
    if n < 2:
        skipped = "vLLM would run no more than one such request at once"
        return None, Wave(requests=n, output_tokens=output, limit=n, skipped=skipped)
    if main.succeeded < spec.requests or main.error_count or main.timed_out:
        return None, Wave(requests=n, output_tokens=output, skipped="the context requests did not all pass")
    left = spec.timeout_s - (time.monotonic() - t0)
    if left < 1.0:
        return None, Wave(requests=n, output_tokens=output, skipped="no time left in probe.timeout_s")
    calls = prompts.calls
    first = await prompts.build(WAVE_SEED, spec.wave_prompt_tokens)
    texts = [first.text] + [prompt_text(WAVE_SEED + i, first.words) for i in range(1, n)]
    left = spec.timeout_s - (time.monotonic() - t0)
    timeout = min(left, spec.request_timeout_s)
    sent = await _send(http, client, spec, texts, n, timeout, "wave request", output)
    running, waiting, streams, proven = _proven(sent, n)
    longer = longer_wave_tokens(output, first.tokens, spec.context)
    left = min(spec.timeout_s - (time.monotonic() - t0), spec.request_timeout_s)
    if sent.succeeded == n and proven < n and not waiting and longer > output and left >= 1.0:
        # all passed, none waited, yet fewer were seen at once than were sent: the answers came too
        # fast (or a starved API server sent each in one burst) for vLLM's gauge or the streams to
        # show them together. Once more, longer; the record is the longer wave's.
        output = longer
        sent = await _send(http, client, spec, texts, n, left, "wave request", output)
        running, waiting, streams, proven = _proven(sent, n)
    proven = proven if sent.succeeded else 0
    queued = sent.succeeded > 0 and proven < n
    return sent, Wave(
        requests=n,
        output_tokens=output,
        sent=n,
        prompt_tokens=first.tokens,
        tokenize_calls=prompts.calls - calls,
        succeeded=sent.succeeded,
        running_peak=running,
        waiting_peak=waiting,
        streams_peak=streams,
        concurrency_proven=proven,
        queued=queued,
        # what vLLM's figures allow at once, as the wave found it: all it sent, unless requests
        # waited (then what ran); fewer proven with none waiting is a wave too short to overlap
        limit=proven if queued and waiting else n,
        output_tokens_total=sent.output_tokens_total,
        output_tokens_per_s=sent.tokens_per_s(),
        ttft_p50_s=_round(percentile(sent.ttfts, 0.5)),
        ttft_p95_s=_round(percentile(sent.ttfts, 0.95)),
        duration_s=round(sent.duration_s, 3),
    )


def delivers(choice: Any) -> bool:
    """Whether a streamed chunk's choice carries generated text (an answer's, or a reasoning model's
    thinking), not only the role or the finish reason: the first such chunk is the first token."""
    delta = getattr(choice, "delta", None)
    if delta is None:
        return False
    return any(getattr(delta, name, None) for name in ("content", "reasoning_content", "reasoning"))


# The HTTP stacks under the openai client (httpx up to openai 2, httpx2 from openai 3) and our own:
# an exception of theirs is a request that failed, not a bug in the probe.
_TRANSPORT_PACKAGES = frozenset({"httpx", "httpx2", "httpcore", "httpcore2", "h11", "anyio", "aiohttp"})


def request_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a request ran, is the request's failure (the server's side or the
    connection): an openai error, a transport error, a timeout. Anything else is a bug in the probe."""
    import openai

    if isinstance(exc, (openai.OpenAIError, OSError, asyncio.TimeoutError)):
        return True
    return any(cls.__module__.split(".", 1)[0] in _TRANSPORT_PACKAGES for cls in type(exc).__mro__)


def request_fault(exc: BaseException) -> str:
    """What a request's failure (:func:`request_error`) was: ``"connection"`` when its connection
    failed (refused, reset, closed before vLLM's answer or in the middle of its stream: the openai
    client's connection error, a transport error of the stream, an OS error), not a timeout;
    ``"timeout"`` when it got no answer (or no next token) within ``probe.request_timeout_s``: a busy
    engine as well as a hung one, so what the engine did meanwhile decides, not the timeout;
    ``"rejected"`` when vLLM answered with a 4xx (r1sup's own request was wrong); ``"server"`` for a
    5xx that is not vLLM's engine-dead reply (a proxy's 502/503, a server shutting down, the error event
    of a request that failed in generation: no evidence of the engine's death, /health decides); else
    ``"engine"`` (vLLM's engine-dead answer or error event).

    An error in the middle of a stream comes after the 200, as an event (vLLM's
    ``create_streaming_error_response``: ``{"error": {"message", "type", "code"}}``, then ``[DONE]``),
    which the openai client raises as a bare ``APIError`` with that error as its body: its ``code``
    stands for the status (none: a 500) and its message says whether the engine died."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        if 400 <= exc.status_code < 500:
            return "rejected"
        return "engine" if engine_dead_reply(exc.status_code, answer_text(exc)) else "server"
    if isinstance(exc, (openai.APITimeoutError, asyncio.TimeoutError, TimeoutError)):
        return TIMEOUT
    if (code := stream_error_code(exc)) is not None:
        if 400 <= code < 500:
            return "rejected"
        return "engine" if engine_dead_reply(code, answer_text(exc)) else "server"
    if isinstance(exc, (openai.APIConnectionError, OSError)):
        return "connection"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"TimeoutException", "ReadTimeout", "WriteTimeout", "ConnectTimeout", "PoolTimeout"}:
        return TIMEOUT
    if names & {"TransportError", "NetworkError", "RemoteProtocolError", "ProtocolError"}:
        return "connection"
    return "engine"


def stream_error_code(exc: BaseException) -> int | None:
    """The status an error event in the middle of a stream stands for (its ``code``; 500 when it gives
    none, a 5xx it gives as text), or None when ``exc`` is not such an event (the openai client raises
    it as a bare ``APIError``: no HTTP status of its own, no connection error)."""
    import openai

    bare = isinstance(exc, openai.APIError) and not isinstance(
        exc, (openai.APIStatusError, openai.APIConnectionError, openai.APIResponseValidationError)
    )
    if not bare:
        return None
    body = getattr(exc, "body", None)
    code = body.get("code") if isinstance(body, Mapping) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
        return code
    return 500


def answer_text(exc: Any) -> str:
    """What an HTTP error answer said: the openai client's message and the body it parsed."""
    body = exc.body
    try:
        said = json.dumps(body) if isinstance(body, (Mapping, list)) else str(body or "")
    except (TypeError, ValueError):
        said = str(body)
    return f"{exc.message} {said}"


def error_line(exc: BaseException) -> str:
    """A failed request's line: vLLM's message for a 4xx (``rejected (HTTP 400): This model's maximum
    context length is ...``), an error event in the stream's (``error in the stream (500
    InternalServerError): Internal server error``), the exception with the HTTP status for another error
    answer, else the exception."""
    import openai

    if (code := stream_error_code(exc)) is not None:
        body = getattr(exc, "body", None)
        kind = body.get("type") if isinstance(body, Mapping) else None
        text = " ".join(str(getattr(exc, "message", "") or exc).split())[:300]
        if 400 <= code < 500:
            return f"rejected (HTTP {code}, in the stream): {text}"
        return f"error in the stream ({code}{f' {kind}' if kind else ''}): {text}"
    if isinstance(exc, openai.APIStatusError):
        body = exc.body
        said = body.get("message") if isinstance(body, Mapping) else None
        if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
            said = body["error"].get("message") or said
        if 400 <= exc.status_code < 500:
            text = " ".join(str(said or exc.message).split())[:300]
            return f"rejected (HTTP {exc.status_code}): {text}"
        # the status from the answer itself: the openai client's message names it only in its later
        # releases ("Error code: 503 - ..."); before, it is the body alone
        return f"{type(exc).__name__} (HTTP {exc.status_code}): {str(exc)[:300]}"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    import httpx

    try:
        resp = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    return parse_metrics(resp.text) if resp.status_code == 200 else {}


async def _healthy(http: httpx.AsyncClient) -> bool:
    """Whether vLLM's /health answers 200, asked after requests failed on the connection: a connection
    that keeps failing proves nothing about the engine, a failing /health does. Asked as the requests
    were sent (the same retries on the connection)."""
    import httpx

    for delay in (*RETRY_S, None):
        try:
            resp = await http.get("/health", timeout=10.0)
        except httpx.TimeoutException:
            return False
        except httpx.HTTPError:
            if delay is None:
                return False
            await asyncio.sleep(delay)
            continue
        return resp.status_code == 200
    return False


async def _poll_metrics(
    http: httpx.AsyncClient,
    metrics: dict[str, float],
    stop: asyncio.Event,
    readings: list[tuple[float, float]],
) -> None:
    """Read /metrics every ``POLL_S`` until ``stop``: the peaks into ``metrics``, and the token counters
    with the time each read came back into ``readings``."""
    while not stop.is_set():
        sample = await _scrape(http)
        keep_peaks(metrics, sample)
        if "tokens" in sample:
            readings.append((time.monotonic(), sample["tokens"]))
        try:
            await asyncio.wait_for(stop.wait(), timeout=POLL_S)
        except asyncio.TimeoutError:
            continue


def run_probe(spec: ProbeSpec, clients: Clients | None = None) -> ProbeResult:
    """Run the probe to completion in this process (its own event loop), with ``clients`` when they
    were built for the spec's connection."""
    return asyncio.run(_run(spec, clients))


class ProbeProcess:
    """A probe child, started before it is needed: it imports the openai client (and builds its
    clients when ``connection`` is given), then waits for its spec on stdin. :meth:`run` hands it the
    spec and reads the result (once); :meth:`kill` ends it, run or not."""

    def __init__(self, python: str = sys.executable, connection: Connection | None = None) -> None:
        self.proc = subprocess.Popen(  # noqa: S603 - an argument list
            [python, "-m", "r1sup.adapters.probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.used = False
        if connection is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # a child already dead says so when it is run
                self.proc.stdin.write(json.dumps({"connection": asdict(connection)}).encode() + b"\n")
                self.proc.stdin.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, spec: ProbeSpec) -> ProbeResult:
        """Run the probe in the child; bounded by the spec's timeout plus a grace period."""
        self.used = True
        proc = self.proc
        try:
            out, err = proc.communicate(json.dumps(asdict(spec)).encode(), timeout=spec.timeout_s + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
            return ProbeResult(
                ok=False, requests=spec.requests, errors=("the probe process did not finish",), timed_out=True
            )
        return _child_result(spec, proc.returncode, out, err)

    def kill(self) -> None:
        """End the child. One that never ran is also reaped here (a running one by :meth:`run`)."""
        if self.proc.poll() is None:
            self.proc.kill()
        if not self.used:
            self.used = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


def _child_result(spec: ProbeSpec, returncode: int, out: bytes, err: bytes) -> ProbeResult:
    """The result a finished probe child gave, or why it gave none (r1sup's own failure)."""
    if returncode != 0:
        where, error = child_failure(err.decode("utf-8", "replace"), returncode)
        return ProbeResult(
            ok=False,
            requests=spec.requests,
            errors=(f"the probe process failed in {where}: {error}",),
            internal=ProbeFault(where, error),
        )
    try:
        data = json.loads(out)
        if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
            raise TypeError(f"not a probe result: {str(data)[:100]}")
        return ProbeResult.from_dict(data)
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return ProbeResult(
            ok=False,
            requests=spec.requests,
            errors=(f"unreadable probe result: {error}",),
            internal=ProbeFault("r1sup.adapters.probe (its result)", error),
        )


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def child_failure(
    stderr: str, returncode: int, child: str = "r1sup.adapters.probe (the probe child)"
) -> tuple[str, str]:
    """(where, error) of a child of r1sup's that failed (the probe's, a load level's): the innermost
    frame of the r1sup package in its traceback, else ``child``, and the exception line, or the signal
    that killed it."""
    import signal

    from r1sup.core.errors import r1sup_module

    where = child
    for line in stderr.splitlines():
        m = _FRAME.match(line)
        module = r1sup_module(m["file"]) if m else None
        if m and module:
            where = f"{module} ({m['func']}, line {m['line']})"
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return where, f"killed by {name}"
    return where, (lines[-1][:300] if lines else f"exit code {returncode}")


def main() -> int:
    """``python -m r1sup.adapters.probe``: a ProbeSpec as JSON on stdin, the ProbeResult as JSON on stdout.

    The client is imported before the spec is read (the runner starts this child with vLLM); a first
    line ``{"connection": ...}`` has the clients built then too. stdin closed without a spec ends it
    quietly."""
    _import_client()
    first = sys.stdin.readline()
    clients = None
    if first.startswith('{"connection"'):
        clients = Clients(Connection(**json.loads(first)["connection"]))
        first = ""
    text = first + sys.stdin.read()
    if not text.strip():
        return 0
    spec = ProbeSpec(**json.loads(text))
    sys.stdout.write(json.dumps(run_probe(spec, clients).to_dict()))
    return 0


def _import_client() -> None:
    import httpx  # noqa: F401 - imported now, used by _run
    import openai  # noqa: F401


def _exit(code: int) -> None:
    """End the child once its result is out, without the interpreter's teardown: with the openai
    client's modules loaded that took 0.7 s after the result on the 2-core test box, and the parent
    waits for the child's end. Nothing is left to clean up (``_run`` closed its clients, ``asyncio.run``
    its loop)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
