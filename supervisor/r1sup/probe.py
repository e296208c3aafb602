"""The load probe: real chat completions through the ``openai`` client, sized in tokens.

Prompts are built to a token count with the server's own ``/tokenize`` (chat form, so the template
is counted), each one different from its first word so that prefix caching cannot share KV blocks
between them. Requests run ``concurrency`` at a time; ``/metrics`` is polled meanwhile for the peak
KV-cache usage and the preemptions.

The probe runs in a child process (``python -m r1sup.probe``: the spec as JSON on stdin, the result as
JSON on stdout), so that the openai client, httpx and their pools never stay resident in the
long-running supervisor, and a wedged client can be killed. The API key travels on stdin, never argv.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

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


@dataclass
class ProbeResult:
    ok: bool
    requests: int
    succeeded: int = 0
    error_count: int = 0
    errors: list[str] = field(default_factory=list)
    concurrency: int = 1
    prompt_tokens: int = 0  # measured with /tokenize (the largest prompt sent)
    prompt_tokens_estimated: bool = False
    output_tokens: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    output_tokens_per_s: float | None = None
    duration_s: float = 0.0
    peak_kv_usage: float | None = None
    preemptions: int | None = None
    timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if not self.ok:
            first = self.errors[0] if self.errors else "no detail"
            return f"{self.error_count}/{self.requests} requests failed: {first}"
        kv = f", peak KV {self.peak_kv_usage:.0%}" if self.peak_kv_usage is not None else ""
        return (
            f"{self.succeeded}/{self.requests} ok at concurrency {self.concurrency}, "
            f"{self.prompt_tokens} prompt tokens, TTFT p50 {self.ttft_p50_s or 0:.2f}s "
            f"p95 {self.ttft_p95_s or 0:.2f}s, {self.output_tokens_per_s or 0:.1f} tok/s{kv}"
        )


def default_prompt_tokens(context: int, output_tokens: int) -> int:
    """Near the context limit, leaving room for the output and the chat template's rounding."""
    margin = max(PROMPT_MARGIN_TOKENS, int(context * PROMPT_MARGIN_FRACTION))
    return max(1, context - output_tokens - margin)


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
    """The two gauges the probe records, from Prometheus text (summed over label sets)."""
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
    return out


class _Prompts:
    def __init__(self, http: httpx.AsyncClient, spec: ProbeSpec) -> None:
        self.http = http
        self.spec = spec
        self.estimated = False

    async def count(self, text: str) -> int | None:
        import httpx

        body = {"model": self.spec.model, "messages": [{"role": "user", "content": text}]}
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

    async def build(self, seed: int, target: int) -> tuple[str, int]:
        """A prompt of at most ``target`` tokens (within a few percent), distinct per seed."""
        rng = random.Random(seed)
        pool = [f"r{seed}"] + [rng.choice(WORDS) for _ in range(max(16, target * 2))]
        n = max(1, target // 2)
        best: tuple[str, int] = (" ".join(pool[:1]), 1)
        for _ in range(8):
            n = min(n, len(pool))
            text = " ".join(pool[:n])
            count = await self.count(text)
            if count is None:  # no /tokenize: estimate 1 token per word plus template
                self.estimated = True
                words = max(1, target - 16)
                return " ".join(pool[:words]), target
            if count <= target:
                best = (text, count)
                if count >= target * 0.97 or n == len(pool):
                    break
            ratio = count / n
            n = max(1, int((target - 2) / ratio)) if count > target else max(n + 1, int(n * target / count))
        return best


async def _run(spec: ProbeSpec) -> ProbeResult:
    import httpx
    import openai

    result = ProbeResult(ok=False, requests=spec.requests, concurrency=spec.concurrency)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    timeout = httpx.Timeout(spec.request_timeout_s)
    async with httpx.AsyncClient(base_url=spec.base_url, headers=headers, timeout=timeout) as http:
        client = openai.AsyncOpenAI(
            base_url=spec.base_url + "/v1",
            api_key=spec.api_key or "r1sup-no-key",
            timeout=spec.request_timeout_s,
            max_retries=0,
        )
        prompts = _Prompts(http, spec)
        metrics: dict[str, float] = {}
        baseline = await _scrape(http)
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_metrics(http, metrics, stop))
        ttfts: list[float] = []
        sem = asyncio.Semaphore(spec.concurrency)

        built: list[tuple[str, int]] = []
        for i in range(spec.requests):  # all prompts first, so the load itself is concurrent
            built.append(await prompts.build(i, spec.prompt_tokens))
        result.prompt_tokens = max(count for _, count in built)
        t0 = time.monotonic()

        async def one(i: int) -> None:
            async with sem:
                text = built[i][0]
                start = time.monotonic()
                first: float | None = None
                tokens = 0
                try:
                    stream = await client.chat.completions.create(
                        model=spec.model,
                        messages=[{"role": "user", "content": text}],
                        max_tokens=spec.output_tokens,
                        temperature=0.0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    usage_tokens = None
                    async for chunk in stream:
                        if chunk.choices and first is None:
                            first = time.monotonic() - start
                        if chunk.choices:
                            tokens += 1
                        if chunk.usage is not None:
                            usage_tokens = chunk.usage.completion_tokens
                    result.output_tokens += usage_tokens if usage_tokens is not None else tokens
                    if first is not None:
                        ttfts.append(first)
                    result.succeeded += 1
                except (openai.OpenAIError, httpx.HTTPError) as exc:
                    result.error_count += 1
                    if len(result.errors) < 5:
                        result.errors.append(f"request {i}: {type(exc).__name__}: {str(exc)[:300]}")

        tasks = [asyncio.create_task(one(i)) for i in range(spec.requests)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=spec.timeout_s)
        except asyncio.TimeoutError:
            result.timed_out = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            result.error_count = spec.requests - result.succeeded
            result.errors.append(f"probe timed out after {spec.timeout_s:.0f}s")
        result.duration_s = time.monotonic() - t0
        stop.set()
        await poller
        final = await _scrape(http)
        await client.close()
    for sample in (baseline, final):
        if "kv_usage" in sample:
            metrics["kv_usage"] = max(metrics.get("kv_usage", 0.0), sample["kv_usage"])
    if "kv_usage" in metrics:
        result.peak_kv_usage = round(metrics["kv_usage"], 4)
    if "preemptions" in final:
        result.preemptions = int(final["preemptions"] - baseline.get("preemptions", 0.0))
    result.prompt_tokens_estimated = prompts.estimated
    result.ttft_p50_s = _round(percentile(ttfts, 0.5))
    result.ttft_p95_s = _round(percentile(ttfts, 0.95))
    if result.duration_s > 0:
        result.output_tokens_per_s = round(result.output_tokens / result.duration_s, 2)
    result.duration_s = round(result.duration_s, 3)
    result.ok = result.succeeded == spec.requests and not result.timed_out
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    import httpx

    try:
        resp = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    return parse_metrics(resp.text) if resp.status_code == 200 else {}


async def _poll_metrics(http: httpx.AsyncClient, metrics: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        sample = await _scrape(http)
        if "kv_usage" in sample:
            metrics["kv_usage"] = max(metrics.get("kv_usage", 0.0), sample["kv_usage"])
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.1)
        except asyncio.TimeoutError:
            continue


def run_probe(spec: ProbeSpec) -> ProbeResult:
    """Run the probe to completion in this process (its own event loop)."""
    return asyncio.run(_run(spec))


def run_probe_isolated(
    spec: ProbeSpec,
    *,
    python: str = sys.executable,
    on_start: Callable[[subprocess.Popen[bytes]], None] = lambda proc: None,
) -> ProbeResult:
    """Run the probe in a child process; bounded by the spec's timeout plus a grace period."""
    proc = subprocess.Popen(  # noqa: S603 - an argument list
        [python, "-m", "r1sup.probe"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    on_start(proc)
    try:
        out, err = proc.communicate(json.dumps(asdict(spec)).encode(), timeout=spec.timeout_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        return ProbeResult(
            ok=False, requests=spec.requests, errors=["the probe process did not finish"], timed_out=True
        )
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return ProbeResult(
            ok=False, requests=spec.requests, errors=[f"the probe process failed: {tail[0][:300]}"]
        )
    try:
        return ProbeResult(**json.loads(out))
    except (ValueError, TypeError) as exc:
        return ProbeResult(ok=False, requests=spec.requests, errors=[f"unreadable probe result: {exc}"])


def main() -> int:
    """``python -m r1sup.probe``: a ProbeSpec as JSON on stdin, the ProbeResult as JSON on stdout."""
    spec = ProbeSpec(**json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(run_probe(spec).to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
