"""Load levels against a running server: streamed chat completions over plain HTTP (``aiohttp``) at a
fixed concurrency, a bounded count and time, each request's time to first token, chunk times (the
inter-token latency), end-to-end time, tokens and error recorded (:class:`r1sup.core.slo.Sample`).

:func:`search` steps the levels as :func:`r1sup.core.slo.next_concurrency` says (double until a target
breaks, then bisect) on the server as it runs: no relaunch, the flags stay as the memory search left them.
The judgement is :mod:`r1sup.core.slo`'s; this module only measures, each level in a child process of
its own (:func:`run_level_apart`). Traffic goes to the server r1sup launched (its own address), never
elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from r1sup.core import slo as S
from r1sup.core.errors import ConfigError, InternalError

SAMPLE_NAME = "sample"  # slo.prompts_file = "sample": the JSONL shipped with r1sup
SAMPLE_FILE = "slo_prompts.jsonl"  # in r1sup/data
MAX_PROMPTS_BYTES = 16 * 1024 * 1024  # a prompts file is read whole; past this it is not a sample
CALIBRATION_WORDS = 200  # words of the text /tokenize counts once, to size the generated prompts
# unmeasured requests before each level: vLLM's bench sends the first request of its workload once as a
# test before it measures (``vllm bench serve``'s initial single prompt run; its --num-warmups is 0)
WARMUP_REQUESTS = 1
LEVEL_GRACE_S = 30.0  # a level child is given its level's timeout and this long to start and answer


@dataclass(frozen=True)
class Request:
    text: str
    max_tokens: int


@dataclass(frozen=True)
class LevelSpec:
    base_url: str  # http://host:port (no /v1)
    model: str
    concurrency: int
    requests: tuple[Request, ...]
    request_timeout_s: float
    timeout_s: float  # the whole level, its warm-up included
    api_key: str | None = None
    # sent before the level, one at a time, neither timed nor judged (vLLM's bench sends one test request
    # of its workload before it measures each level)
    warmup: tuple[Request, ...] = ()


# --- the workload ----------------------------------------------------------------------------------


def sample_path() -> Path:
    """The shipped sample of prompts (package data)."""
    return Path(__file__).resolve().parent.parent / "data" / SAMPLE_FILE


def read_prompts(name: str) -> list[tuple[str, int | None]]:
    """The prompts of a JSONL file: each line ``{"prompt": "...", "output_tokens": N}`` (the latter
    optional). ConfigError naming ``slo.prompts_file`` and the line when it is not one."""
    path = sample_path() if name == SAMPLE_NAME else Path(name)
    field = "slo.prompts_file"
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PROMPTS_BYTES + 1)
    except OSError as exc:
        raise ConfigError(field, f"{name}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_PROMPTS_BYTES:
        raise ConfigError(field, f"{name}: larger than {MAX_PROMPTS_BYTES // (1024 * 1024)} MiB")
    out: list[tuple[str, int | None]] = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(field, f"{name} line {number}: not JSON") from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(field, f'{name} line {number}: no "prompt" string')
        tokens = row.get("output_tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ConfigError(field, f"{name} line {number}: output_tokens must be an integer >= 1")
        out.append((text, tokens))
    if not out:
        raise ConfigError(field, f"{name}: holds no prompt")
    return out


def spread(low: int, high: int, i: int) -> int:
    """The ``i``-th length of a range, spread evenly over it in a fixed order (golden-ratio steps)."""
    if high <= low:
        return low
    return low + round((high - low) * ((i * 0.6180339887) % 1.0))


def workload_of(slo: Any) -> S.Workload:
    """The workload a ``[slo]`` section describes."""
    prompt = (slo.prompt_tokens, slo.prompt_tokens_max or slo.prompt_tokens)
    output = (slo.output_tokens, slo.output_tokens_max or slo.output_tokens)
    source = ""
    if slo.prompts_file:
        source = SAMPLE_FILE if slo.prompts_file == SAMPLE_NAME else Path(slo.prompts_file).name
    return S.Workload(prompt, output, source)


def build_requests(
    slo: Any, count: int, words_per_token: float, file_prompts: list[tuple[str, int | None]] | None
) -> tuple[Request, ...]:
    """``count`` requests of the workload: the file's prompts in turn, or generated text of the asked
    token lengths (``words_per_token`` from the server's tokenizer, :func:`words_per_token`)."""
    from r1sup.adapters.probe import prompt_text

    low_out, high_out = slo.output_tokens, slo.output_tokens_max or slo.output_tokens
    low_in, high_in = slo.prompt_tokens, slo.prompt_tokens_max or slo.prompt_tokens
    out: list[Request] = []
    for i in range(count):
        max_tokens = spread(low_out, high_out, i)
        if file_prompts:
            text, own = file_prompts[i % len(file_prompts)]
            out.append(Request(text, own or max_tokens))
        else:
            words = max(1, round(spread(low_in, high_in, i) * words_per_token))
            out.append(Request(prompt_text(1000 + i, words), max_tokens))
    return tuple(out)


def words_per_token(base_url: str, model: str, api_key: str | None, timeout_s: float) -> float:
    """Words of generated text per token, as the server's ``/tokenize`` counts a sample; 1.0 when the
    server has no ``/tokenize`` (the lengths are then estimates)."""
    import httpx

    from r1sup.adapters.probe import prompt_text

    text = prompt_text(999, CALIBRATION_WORDS)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.post(
            f"{base_url}/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": False},
            headers=headers,
            timeout=timeout_s,
        )
        tokens = int(reply.json()["count"]) if reply.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        tokens = 0
    return CALIBRATION_WORDS / tokens if tokens > 0 else 1.0


# --- one level -------------------------------------------------------------------------------------


def run_level(spec: LevelSpec) -> tuple[list[S.Sample], float]:
    """Send the level's warm-up, then its requests, ``concurrency`` in flight at a time, within
    ``timeout_s``; each measured request's sample and the level's duration in seconds (first measured
    send to last answer; the warm-up is in neither)."""
    return asyncio.run(_level(spec))


def run_level_apart(spec: LevelSpec, python: str = sys.executable) -> tuple[list[S.Sample], float]:
    """:func:`run_level` in a process of its own (``python -m r1sup.adapters.loadlevel``: the spec on
    its stdin, the samples and the duration on its stdout), as vLLM's bench runs apart from the server
    it measures: the client's event loop then shares no interpreter lock with the supervisor's loop,
    its relay of vLLM's output and its log writer, whose turns can delay the stamps of its chunks.
    Bounded by the level's timeout and ``LEVEL_GRACE_S``; a child that fails or answers nothing is
    r1sup's internal error, never a level whose requests failed."""
    from r1sup.adapters.probe import child_failure

    where = "r1sup.adapters.loadlevel (the level child)"
    proc = subprocess.Popen(  # noqa: S603 - an argument list
        [python, "-m", "r1sup.adapters.loadlevel"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(json.dumps(asdict(spec)).encode(), timeout=spec.timeout_s + LEVEL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise InternalError(where, f"no answer within {spec.timeout_s + LEVEL_GRACE_S:g} s") from None
    except BaseException:  # a stop signal while the level runs: nothing is left behind
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise InternalError(*child_failure(err.decode("utf-8", "replace"), proc.returncode, where))
    try:
        answer = json.loads(out)
        samples = [S.Sample(**{**row, "itl_s": tuple(row["itl_s"])}) for row in answer["samples"]]
        return samples, float(answer["duration_s"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InternalError(where, f"an unreadable answer: {type(exc).__name__}: {exc}") from None


def spec_of(data: Mapping[str, Any]) -> LevelSpec:
    """A level spec from its JSON (:func:`run_level_apart`'s to its child)."""
    fields = dict(data)
    for name in ("requests", "warmup"):
        fields[name] = tuple(Request(**row) for row in fields.get(name, ()))
    return LevelSpec(**fields)


def main() -> int:
    """``python -m r1sup.adapters.loadlevel``: a level spec as JSON on stdin; its samples and duration
    as JSON on stdout."""
    samples, duration = run_level(spec_of(json.loads(sys.stdin.read())))
    sys.stdout.write(json.dumps({"samples": [asdict(s) for s in samples], "duration_s": duration}))
    sys.stdout.flush()
    return 0


async def _level(spec: LevelSpec) -> tuple[list[S.Sample], float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # one connection per request in flight, kept between requests, as vLLM's bench keeps them (one
    # aiohttp session, no connection limit); the request timeout bounds the connect and each read, as
    # httpx's did (a long stream that keeps sending is not cut)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=spec.request_timeout_s, sock_read=spec.request_timeout_s
    )
    url = f"{spec.base_url}/v1/chat/completions"
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:

        async def send(request: Request) -> S.Sample:
            return await _one(client, url, spec.model, request)

        return await drive(spec, send)


async def drive(
    spec: LevelSpec,
    send: Callable[[Request], Awaitable[S.Sample]],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[S.Sample], float]:
    """One level through ``send``: the warm-up requests one after the other (their samples dropped, their
    time not counted), then the level's requests with ``concurrency`` in flight, all within
    ``spec.timeout_s``; a request the time ran out on is a failed sample."""
    samples: list[S.Sample | None] = [None] * len(spec.requests)
    queue = list(range(len(spec.requests)))
    started = clock()
    t0 = started

    async def warm() -> None:
        for request in spec.warmup:
            await send(request)

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            samples[i] = await send(spec.requests[i])

    workers: list[asyncio.Task[None]] = []
    try:
        await asyncio.wait_for(warm(), timeout=spec.timeout_s)
        t0 = clock()
        left = max(0.0, spec.timeout_s - (t0 - started))
        workers = [asyncio.create_task(worker()) for _ in range(min(spec.concurrency, len(spec.requests)))]
        await asyncio.wait_for(asyncio.gather(*workers), timeout=left)
    except asyncio.TimeoutError:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    duration = clock() - t0
    timed_out = S.Sample(ok=False, error=f"level timed out after {spec.timeout_s:g} s")
    return [s if s is not None else timed_out for s in samples], duration


def stream_sample(start: float, chunks: list[tuple[float, Mapping[str, Any]]], end: float) -> S.Sample:
    """A request's sample from its streamed chunks (each the JSON of one ``data:`` line, with the time
    it arrived), as vLLM's benchmark (``vllm bench serve``) reads a stream: every chunk with a choice is
    one step of output, the first the first token (TTFT), the gaps between them the inter-token
    latencies, even where a chunk's text is empty (vLLM streams a chunk per output step while its
    detokenizer holds back text that is not yet a whole character); the output tokens from the usage
    chunk, else one per chunk. A chunk with an ``error`` (vLLM's error in the stream) fails the request."""
    for _, chunk in chunks:
        if chunk.get("error"):
            return S.Sample(
                ok=False, e2e_s=end - start, error=f"error in the stream: {str(chunk['error'])[:200]}"
            )
    times = [t for t, chunk in chunks if chunk.get("choices")]
    usage = [
        chunk["usage"]["completion_tokens"]
        for _, chunk in chunks
        if isinstance(chunk.get("usage"), Mapping)
        and isinstance(chunk["usage"].get("completion_tokens"), int)
    ]
    if not times:
        return S.Sample(ok=False, e2e_s=end - start, error="no token streamed")
    gaps = tuple(b - a for a, b in zip(times, times[1:], strict=False))
    tokens = usage[-1] if usage else len(times)
    return S.Sample(ok=True, ttft_s=times[0] - start, itl_s=gaps, e2e_s=end - start, output_tokens=tokens)


async def _one(client: Any, url: str, model: str, request: Request) -> S.Sample:
    """One streamed chat completion, read as vLLM's bench reads it: aiohttp (its C HTTP parser), each
    ``data:`` line stamped when it arrives and parsed as JSON, nothing more (a client that spends more
    CPU per chunk takes it from the engine where both share the cores: httpx's pure-Python stack spent
    about twice aiohttp's CPU a level, ``benchmarks/bench_slo_client.py``)."""
    import aiohttp

    payload = {
        "model": model,
        "messages": [{"role": "user", "content": request.text}],
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM's: the asked output length, not the model's whim
    }
    start = time.monotonic()
    chunks: list[tuple[float, Mapping[str, Any]]] = []
    try:
        async with client.post(url, json=payload) as reply:
            if reply.status != 200:
                body = (await reply.read()).decode("utf-8", "replace")
                return S.Sample(
                    ok=False, e2e_s=time.monotonic() - start, error=f"HTTP {reply.status}: {body[:200]}"
                )
            async for raw in reply.content:  # one line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                stamp = time.monotonic()
                chunk = json.loads(data)
                if isinstance(chunk, Mapping):
                    chunks.append((stamp, chunk))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        return S.Sample(
            ok=False, e2e_s=time.monotonic() - start, error=f"{type(exc).__name__}: {str(exc)[:200]}"
        )
    return stream_sample(start, chunks, time.monotonic())


# --- the search ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    base_url: str
    model: str
    api_key: str | None
    request_timeout_s: float


def search(
    slo: Any,
    server: Server,
    *,
    flags: dict[str, Any] | None = None,
    cap: int | None = None,
    check: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    measure: Callable[[LevelSpec], tuple[list[S.Sample], float]] = run_level_apart,
    tell: Callable[[S.Level], None] = lambda level: None,
) -> S.SloResult:
    """The highest concurrency that meets ``slo``'s targets on the running ``server``: levels from one
    request at a time up (double, then bisect), within ``slo.budget_s`` (a level is given what is left
    of it, at most ``slo.level_timeout_s``). Measured as vLLM's sweep measures a level: one unmeasured
    warm-up request first, then ``slo.requests_per_level`` requests (at least the concurrency), the rate
    over the measured requests' span. ``cap``: the most levels may reach (``max_num_seqs``
    where it is lower than ``slo.max_concurrency``). ``check`` is called between levels (it raises on
    a stop signal)."""
    targets = S.Targets(slo.ttft_p95_s, slo.itl_p95_s, slo.e2e_p95_s)
    workload = workload_of(slo)
    t0 = clock()
    deadline = t0 + slo.budget_s
    top = min(slo.max_concurrency, cap) if cap else slo.max_concurrency
    file_prompts = read_prompts(slo.prompts_file) if slo.prompts_file else None
    ratio = (
        1.0
        if file_prompts
        else words_per_token(server.base_url, server.model, server.api_key, server.request_timeout_s)
    )
    levels: list[S.Level] = []
    budget_ended = False
    while True:
        check()
        concurrency = S.next_concurrency(levels, top)
        if concurrency is None:
            break
        left = deadline - clock()
        if left <= 0:
            budget_ended = True
            break
        requests = build_requests(
            slo, S.level_requests(concurrency, slo.requests_per_level), ratio, file_prompts
        )
        spec = LevelSpec(
            base_url=server.base_url,
            model=server.model,
            concurrency=concurrency,
            requests=requests,
            request_timeout_s=server.request_timeout_s,
            timeout_s=min(slo.level_timeout_s, left),
            api_key=server.api_key,
            warmup=requests[:WARMUP_REQUESTS],
        )
        samples, duration = measure(spec)
        level = S.judge(concurrency, samples, duration, targets)
        levels.append(level)
        tell(level)
    return S.conclude(targets, workload, levels, budget_ended=budget_ended, seconds=clock() - t0, flags=flags)


if __name__ == "__main__":
    sys.exit(main())
