"""The verified capacity of a configuration that passed the load probe: what it was shown to serve.

Pure: the probe's result, the flags, vLLM's figures and what was asked in, a plain dict out. The dict
is what the profile records (``capacity``), ``status.json`` and ``r1sup status`` show and ``/metrics``
exports:

- ``requests``: the most requests the probe saw running at once (``concurrency_proven``: vLLM's
  running gauge or the probe's own overlapping streams, never more than it sent), of its context
  requests or of its concurrency wave (ordinary requests sent at once, as many as vLLM's
  ``max_num_seqs`` and KV figure would run, up to ``probe.max_concurrency``), whichever proved more;
  None for a probe that did not measure it (a record saved before r1sup measured it);
- ``concurrent_prompt_tokens``: the prompt of each of those requests (the wave's ordinary size, or the
  context requests' near the context limit);
- ``context_requests``: the context requests' proven figure: requests at once with prompts near the
  context (``probe_tokens`` each); what ``target.concurrency`` is held against;
- ``context_tokens``: the context each request may use (``--max-model-len``, else vLLM's figure);
- ``probe_tokens``: the tokens each of the probe's context requests held (prompt and output);
- ``output_tokens_per_second``, ``ttft_p50_s``, ``ttft_p95_s``: measured at ``requests`` at once;
- ``kv_cache_tokens``: the KV cache vLLM allocated (its own figure);
- ``asked_requests``, ``asked_context``: what the config asked for (the target, else the probe's
  concurrency and ``start.max_model_len``); ``asked_concurrent``: the ordinary requests at once it
  asked for: ``start.max_num_seqs`` (else vLLM's default, at least the cap) up to
  ``probe.max_concurrency``, held against ``concurrent_limit`` when the probe was asked for a wave;
- ``concurrent_limit``: the ordinary requests at once vLLM's figures allow, as the wave found it: the
  wave's size (``max_num_seqs`` and the KV figure, up to the cap), or what ran when requests waited
  (``requests`` may be lower still: requests too short to overlap prove less, but show no limit);
- ``reduced``: the configuration serves less than asked, and ``reduced_because`` says how: fewer
  requests at once than asked, or a shorter context than asked, or the search's own verdict (a tune
  result's ``reduced``, which weighs what the box could give).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r1sup.core.figures import Figures

FIELDS = (
    "requests",
    "concurrent_prompt_tokens",
    "context_requests",
    "context_tokens",
    "probe_tokens",
    "output_tokens_per_second",
    "ttft_p50_s",
    "ttft_p95_s",
    "kv_cache_tokens",
    "asked_requests",
    "asked_context",
    "asked_concurrent",
    "concurrent_limit",
)


def asked(config: Any) -> dict[str, int | None]:
    """What a config asks to serve: requests at once and the context of each."""
    target, probe = config.target, config.probe
    seqs = config.start.max_num_seqs
    return {
        "requests": target.concurrency or probe.concurrency or 1,
        "context": target.context or config.start.max_model_len,
        "concurrent": min(seqs, probe.max_concurrency) if seqs else probe.max_concurrency,
    }


def verified(
    probe: Mapping[str, Any] | None,
    flags: Mapping[str, Any] | None,
    figures: Figures | None,
    asked_for: Mapping[str, Any] | None = None,
    reduced: bool | None = None,
) -> dict[str, Any] | None:
    """The capacity a passed probe proved; None when there is no passed probe."""
    if not probe or not probe.get("ok"):
        return None
    flags, want = flags or {}, asked_for or {}
    obs = figures or Figures()
    context = _count(flags.get("max_model_len")) or _count(obs.max_model_len)
    prompt, output = _count(probe.get("prompt_tokens")), _count(probe.get("output_tokens"))
    at_context = _count(probe.get("concurrency_proven"))
    wave = probe.get("wave")
    wave = wave if isinstance(wave, Mapping) else None
    waved = _count(wave.get("concurrency_proven")) if wave is not None else None
    # the figures at the most requests proven at once: the wave's when it proved more
    best = wave if wave is not None and waved is not None and waved > (at_context or 0) else probe
    out: dict[str, Any] = {
        "requests": waved if best is wave else at_context,
        "concurrent_prompt_tokens": _count(best.get("prompt_tokens")),
        "context_requests": at_context,
        "context_tokens": context,
        "probe_tokens": (prompt or 0) + (output or 0) or None,
        "output_tokens_per_second": _number(best.get("output_tokens_per_s")),
        "ttft_p50_s": _number(best.get("ttft_p50_s")),
        "ttft_p95_s": _number(best.get("ttft_p95_s")),
        "kv_cache_tokens": _count(obs.kv_cache_tokens),
        "asked_requests": _count(want.get("requests")),
        "asked_context": _count(want.get("context")),
        # judged only when the probe was asked for a wave (a record from before has none)
        "asked_concurrent": _count(want.get("concurrent")) if wave is not None else None,
        "concurrent_limit": _count(wave.get("limit")) if wave is not None else None,
    }
    because = shortfalls(out)
    if reduced and not because:
        because = ["the search gave up part of what was asked"]
    out["reduced"] = bool(because)
    out["reduced_because"] = because
    return out


def shortfalls(c: Mapping[str, Any]) -> list[str]:
    """How a capacity falls short of what was asked, one phrase each (empty: it does not)."""
    out = []
    got, want = c.get("context_requests", c.get("requests")), c.get("asked_requests")
    if isinstance(got, int) and isinstance(want, int) and got < want:
        out.append(f"{got} request(s) at once of {want} asked")
    got, want = c.get("concurrent_limit"), c.get("asked_concurrent")
    if isinstance(got, int) and isinstance(want, int) and got < want:
        size = c.get("concurrent_prompt_tokens")
        of = f" of ~{size:,} prompt tokens" if isinstance(size, int) else ""
        out.append(f"{got} request(s) at once{of} of {want} asked")
    got, want = c.get("context_tokens"), c.get("asked_context")
    if isinstance(got, int) and isinstance(want, int) and got < want:
        out.append(f"context {got:,} of {want:,} asked")
    return out


def text(c: Mapping[str, Any]) -> str:
    """One line: ``4 request(s) at once of up to 8,192 tokens, 412.3 output tok/s, TTFT p50 0.21s p95
    0.40s``, or when the concurrency wave proved more than the context requests, ``16 request(s) at once
    of ~250 prompt tokens; 1 of up to 8,192 tokens, ...`` (tokens/s and TTFT at the 16), and how it
    falls short of what was asked when it does."""
    requests = c.get("requests")
    head = f"{requests} request(s) at once" if requests is not None else "requests at once not measured"
    at_context, size = c.get("context_requests"), c.get("concurrent_prompt_tokens")
    if at_context is not None and requests != at_context and isinstance(size, int):
        # the wave proved more than the context requests: say both, each with its size
        head += f" of ~{size:,} prompt tokens; {at_context}"
    if c.get("context_tokens"):
        head += f" of up to {c['context_tokens']:,} tokens"
    parts = [head]
    if c.get("output_tokens_per_second") is not None:
        parts.append(f"{c['output_tokens_per_second']:.1f} output tok/s")
    if c.get("ttft_p50_s") is not None:
        p95 = c.get("ttft_p95_s")
        parts.append(f"TTFT p50 {c['ttft_p50_s']:.2f}s" + (f" p95 {p95:.2f}s" if p95 is not None else ""))
    line = ", ".join(parts)
    if c.get("reduced"):
        because = "; ".join(c.get("reduced_because") or []) or "less than asked"
        line += f" (REDUCED: {because})"
    return line


def wave_text(wave: Mapping[str, Any] | None) -> str:
    """``; wave: 16 of 16 ran at once, ~256 prompt tokens, 812.0 tok/s`` (empty without a wave)."""
    if not wave:
        return ""
    if wave.get("skipped"):
        return f"; no concurrency wave ({wave['skipped']})"
    proven = wave.get("concurrency_proven")
    return (
        f"; wave: {proven} of {wave.get('sent')} ran at once, ~{wave.get('prompt_tokens')} prompt tokens, "
        f"{wave.get('output_tokens_per_s') or 0:.1f} tok/s"
    )


def check(data: Any) -> dict[str, Any]:
    """A capacity read from a file (a profile): the fields above with their types, else ValueError."""
    if not isinstance(data, dict):
        raise ValueError("capacity must be an object")
    known = {*FIELDS, "reduced", "reduced_because"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"capacity: unknown field(s): {', '.join(unknown)}")
    for name in FIELDS:
        value = data.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and (not number or value < 0):
            raise ValueError(f"capacity.{name} must be a non-negative number or null, got {value!r}")
    if not isinstance(data.get("reduced", False), bool):
        raise ValueError("capacity.reduced must be true or false")
    because = data.get("reduced_because", [])
    if not isinstance(because, list) or not all(isinstance(b, str) for b in because):
        raise ValueError("capacity.reduced_because must be a list of strings")
    return dict(data)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return int(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
