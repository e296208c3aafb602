"""The verified capacity of a configuration that passed the load probe: what it was shown to serve.

Pure: the probe's result (:class:`r1sup.core.probing.ProbeResult`), the context of the flags, vLLM's
figures and what was asked (:class:`Asked`) in, a :class:`Capacity` out. :meth:`Capacity.to_dict` is what
the profile records (``capacity``), ``status.json`` and ``tune --json`` hold, ``r1sup status`` shows and
``/metrics`` exports:

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
  result's ``reduced``, which weighs what the box could give);
- ``context_from_profile``, ``wave_from_profile``: the context requests' figures, the wave's, are those
  of the saved profile's full probe of the same flags, not this launch's: its short probe sent short
  prompts (or no wave) because vLLM allocated at least the KV cache that full probe passed with
  (:func:`r1sup.adapters.probe.short_prompt_tokens`, :func:`r1sup.adapters.probe.proven_wave`). Written
  only when true.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from r1sup.core.figures import Figures, known_numbers

if TYPE_CHECKING:  # a stored capacity (``status``) is read without the probe's types
    from r1sup.core.probing import ProbeResult, Wave


@dataclass(frozen=True)
class Reduction:
    """Flags that give up more than half the asked context, or run fewer sequences at once than the
    user gets without r1sup: what they give, what was asked, the ways out that would give it, and
    ``reason``, one line saying so (:meth:`r1sup.core.search.Search.reduction`; the ``config_reduced``
    line, a tune result's and a plan's ``reduced``, a profile's ``conditions.reduced``)."""

    reason: str
    context: int
    asked_context: int
    max_num_seqs: int
    wanted_max_num_seqs: int
    ways_out: tuple[str, ...] = ()

    @property
    def halved(self) -> bool:
        """Whether more than half the asked context or the wanted sequences at once is given up: what
        ``r1sup plan`` calls "fits only reduced" (issue 36)."""
        return 2 * self.context < self.asked_context or 2 * self.max_num_seqs < self.wanted_max_num_seqs

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "context": self.context,
            "asked_context": self.asked_context,
            "max_num_seqs": self.max_num_seqs,
            "wanted_max_num_seqs": self.wanted_max_num_seqs,
            "ways_out": list(self.ways_out),
        }


@dataclass(frozen=True)
class Asked:
    """What a config asks to serve: requests at once, the context of each, and ordinary requests at
    once (see the module's docstring); None: not asked (a run record written before it was kept)."""

    requests: int | None = None
    context: int | None = None
    concurrent: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Asked:
        """A run record's ``asked``: the numbers of its keys; anything else is None."""
        return cls(**known_numbers(data or {}, ("requests", "context", "concurrent")))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, int | None]:
        return {"requests": self.requests, "context": self.context, "concurrent": self.concurrent}


@dataclass(frozen=True)
class Capacity:
    """What a passed probe proved a configuration serves (the fields: the module's docstring)."""

    requests: int | None = None
    concurrent_prompt_tokens: int | None = None
    context_requests: int | None = None
    context_tokens: int | None = None
    probe_tokens: int | None = None
    output_tokens_per_second: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    kv_cache_tokens: int | None = None
    asked_requests: int | None = None
    asked_context: int | None = None
    asked_concurrent: int | None = None
    concurrent_limit: int | None = None
    reduced: bool = False
    reduced_because: tuple[str, ...] = ()
    context_from_profile: bool = False
    wave_from_profile: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Capacity | None:
        """A stored capacity (a profile's, ``status.json``'s): the numbers of known keys, ``reduced``
        when a boolean, the phrases of ``reduced_because`` that are strings; None for no object."""
        if not isinstance(data, Mapping):
            return None
        values: dict[str, Any] = known_numbers(data, FIELDS)
        reduced, because = data.get("reduced"), data.get("reduced_because")
        return cls(
            **values,
            reduced=reduced if isinstance(reduced, bool) else False,
            reduced_because=tuple(b for b in because if isinstance(b, str))
            if isinstance(because, list)
            else (),
            **{name: True for name in CARRIED if data.get(name) is True},
        )

    def to_dict(self) -> dict[str, Any]:
        """The record (profiles' ``capacity``, ``status.json``, ``tune --json``): every field by name."""
        out: dict[str, Any] = {name: getattr(self, name) for name in FIELDS}
        out["reduced"] = self.reduced
        out["reduced_because"] = list(self.reduced_because)
        out.update({name: True for name in CARRIED if getattr(self, name)})
        return out

    def shortfalls(self) -> list[str]:
        """How this capacity falls short of what was asked, one phrase each (empty: it does not)."""
        out = []
        got, want = self.context_requests, self.asked_requests
        if got is not None and want is not None and got < want:
            out.append(f"{got} request(s) at once of {want} asked")
        got, want = self.concurrent_limit, self.asked_concurrent
        if got is not None and want is not None and got < want:
            size = self.concurrent_prompt_tokens
            of = f" of ~{size:,} prompt tokens" if size is not None else ""
            # the limit is what ran only when requests waited; else the wave's size, which vLLM's
            # figures (max_num_seqs, the KV cache) allowed: computed, and said so where the measured
            # group is the wave's and a different figure
            waves = self.requests is not None and self.requests != self.context_requests
            whose = "vLLM's figures allow " if waves and got != self.requests else ""
            out.append(f"{whose}{got} request(s) at once{of} of {want} asked")
        got, want = self.context_tokens, self.asked_context
        if got is not None and want is not None and got < want:
            out.append(f"context {got:,} of {want:,} asked")
        return out

    def text(self) -> str:
        """One line, what was measured apart from what is computed: ``measured: 16 request(s) at once
        of ~250 prompt tokens (812.0 output tok/s, TTFT p50 0.05s p95 0.09s), 1 at once of ~8,036
        tokens; computed: context 8,192 tokens, 12.38 such requests fit vLLM's 101,456-token KV
        cache``. Each group of requests says its own size (the wave's prompts, the context requests'
        prompt and output); tokens/s and TTFT are those of the first group (``requests`` at once, the
        figures ``status`` and ``/metrics`` show); the context is the flags' and how many requests of
        it the KV cache holds is vLLM's figure divided, never seen running. A group measured by the
        saved profile's full probe rather than this launch's says so (``(the profile's full probe)``, once
        after ``measured`` when every group is).
        Then how it falls short of what was asked when it does."""
        groups: list[tuple[str, bool]] = []  # each group's text, and whether the profile measured it
        if self.requests is None:
            groups.append(("requests at once not measured", False))
        else:
            two = self.context_requests is not None and self.context_requests != self.requests
            size = self.concurrent_prompt_tokens if two else self.probe_tokens
            unit = "prompt tokens" if two else "tokens"
            if not two and size is None:
                size, unit = self.concurrent_prompt_tokens, "prompt tokens"
            # the first group is the wave's when it proved more than the context requests
            wave_first = two or self.context_requests is None
            first = self.wave_from_profile if wave_first else self.context_from_profile
            groups.append((f"{self.requests} request(s) at once {_size(size, unit)}{self._speed()}", first))
            if two:
                at_context = f"{self.context_requests} at once {_size(self.probe_tokens, 'tokens')}"
                groups.append((at_context, self.context_from_profile))
        if all(earlier for _, earlier in groups):  # the profile's full probe measured every group
            line = f"measured{EARLIER}: " + ", ".join(text for text, _ in groups)
        else:
            line = "measured: " + ", ".join(text + (EARLIER if earlier else "") for text, earlier in groups)
        if self.context_tokens:
            line += f"; computed: context {self.context_tokens:,} tokens"
            if self.kv_cache_tokens:
                held = self.kv_cache_tokens / self.context_tokens
                line += f", {held:.2f} such requests fit vLLM's {self.kv_cache_tokens:,}-token KV cache"
        if self.reduced:
            because = "; ".join(self.reduced_because) or "less than asked"
            line += f" (REDUCED: {because})"
        return line

    def _speed(self) -> str:
        """`` (812.0 output tok/s, TTFT p50 0.05s p95 0.09s)``: measured at ``requests`` at once."""
        parts = []
        if self.output_tokens_per_second is not None:
            parts.append(f"{self.output_tokens_per_second:.1f} output tok/s")
        if self.ttft_p50_s is not None:
            p95 = self.ttft_p95_s
            parts.append(f"TTFT p50 {self.ttft_p50_s:.2f}s" + (f" p95 {p95:.2f}s" if p95 is not None else ""))
        return f" ({', '.join(parts)})" if parts else ""


def _size(tokens: int | None, unit: str) -> str:
    return f"of ~{tokens:,} {unit}" if tokens is not None else "of a size not recorded"


EARLIER = " (the profile's full probe)"
"""Said of figures a saved profile's full probe of the same flags measured, not this launch's probe."""


CARRIED: tuple[str, ...] = ("context_from_profile", "wave_from_profile")
"""The marks of figures a saved profile's full probe measured (a record holds them only when true)."""

FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(Capacity) if f.name not in ("reduced", "reduced_because", *CARRIED)
)
"""The figures of a capacity, in the order its record holds them."""


def asked(config: Any) -> Asked:
    """What a config asks to serve: requests at once and the context of each."""
    target, probe = config.target, config.probe
    seqs = config.start.max_num_seqs
    return Asked(
        requests=target.concurrency or probe.concurrency or 1,
        context=target.context or config.start.max_model_len,
        concurrent=min(seqs, probe.max_concurrency) if seqs else probe.max_concurrency,
    )


def verified(
    probe: ProbeResult | None,
    max_model_len: int | None,
    figures: Figures | None,
    asked_for: Asked | None = None,
    reduced: bool = False,
    stands_on: ProbeResult | None = None,
) -> Capacity | None:
    """The capacity a passed probe proved; None when there is no passed probe. ``max_model_len``: the
    flags' (else vLLM's figure is the context); ``reduced``: the search's own verdict; ``stands_on``: the
    saved profile's full probe of the same flags, where this launch's short probe sent short prompts
    because vLLM allocated at least the KV cache that one passed with: its context requests are the
    figures (this probe's short prompts proved only that the engine serves)."""
    if probe is None or not probe.ok:
        return None
    want = asked_for or Asked()
    obs = figures or Figures()
    context = _count(max_model_len) or _count(obs.max_model_len)
    measured = stands_on if stands_on is not None and stands_on.ok else probe
    earlier = measured is not probe
    prompt, output = _count(measured.prompt_tokens), _count(measured.output_tokens)
    at_context = _count(measured.concurrency_proven)
    wave = probe.wave
    waved = _count(wave.concurrency_proven) if wave is not None else None
    # the figures at the most requests proven at once: the wave's when it proved more
    best: ProbeResult | Wave = (
        wave if wave is not None and waved is not None and waved > (at_context or 0) else measured
    )
    out = Capacity(
        requests=waved if best is wave else at_context,
        concurrent_prompt_tokens=_count(best.prompt_tokens),
        context_requests=at_context,
        context_tokens=context,
        probe_tokens=(prompt or 0) + (output or 0) or None,
        output_tokens_per_second=_number(best.output_tokens_per_s),
        ttft_p50_s=_number(best.ttft_p50_s),
        ttft_p95_s=_number(best.ttft_p95_s),
        kv_cache_tokens=_count(obs.kv_cache_tokens),
        asked_requests=_count(want.requests),
        asked_context=_count(want.context),
        # judged only when the probe was asked for a wave (a record from before has none)
        asked_concurrent=_count(want.concurrent) if wave is not None else None,
        concurrent_limit=_count(wave.limit) if wave is not None else None,
        context_from_profile=earlier,
        # the short probe took the full probe's wave (runner: proven_wave) rather than sending one
        wave_from_profile=earlier and wave is not None and wave == measured.wave,
    )
    because = out.shortfalls()
    if reduced and not because:
        because = ["the search gave up part of what was asked"]
    return replace(out, reduced=bool(because), reduced_because=tuple(because))


def check(data: Any) -> dict[str, Any]:
    """A capacity read from a file (a profile): the fields above with their types, else ValueError."""
    if not isinstance(data, dict):
        raise ValueError("capacity must be an object")
    known = {*FIELDS, "reduced", "reduced_because", *CARRIED}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"capacity: unknown field(s): {', '.join(unknown)}")
    for name in FIELDS:
        value = data.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and (not number or value < 0):
            raise ValueError(f"capacity.{name} must be a non-negative number or null, got {value!r}")
    for name in ("reduced", *CARRIED):
        if not isinstance(data.get(name, False), bool):
            raise ValueError(f"capacity.{name} must be true or false")
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
