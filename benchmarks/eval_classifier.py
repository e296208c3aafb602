"""Measure r1sup's log classifier on real vLLM failure excerpts, per source and in total.

Sources (JSON lines: ``id``, ``label``, ``phase``, ``excerpt``, ``error_line_present``, ``url`` ...):

* ``../shared/vllm-logs/dev.jsonl``: the shared development set, looked for in a ``shared/`` folder
  beside the checkout or above it; CI has none, and then it is said to be skipped;
* ``benchmarks/data/vllm-logs-extra.jsonl``: excerpts collected for this repository from public
  threads (each with its source URL), labelled by reading the thread before the classifier ran;
* ``benchmarks/data/vllm-logs-heldout.jsonl``: real excerpts of the kinds a held-out set showed the
  classifier getting wrong (issue 36: hangs, V1 "no KV memory", illegal memory accesses, a runtime OOM, an
  OOM kill, and other programs' text labelled ``not_vllm``), each with ``before``: the class the classifier
  gave it before that issue's changes, printed beside today's.

A record labelled ``not_vllm`` is another program's output: right when ``diagnose`` says it is no vLLM log
(exit 6). The other records are scored on their class, as before; those that ``diagnose`` would call no vLLM
log are counted and named apart.

Scored: records whose exception line is present (``error_line_present``). Printed: exact class accuracy
per source and in total, per class, per kind (``kind``: the form of log a record was collected for, such
as an OOM while serving, a death printed before its cause, an NCCL failure, host memory; records without
one are counted as ``earlier``), the phase accuracy, the printed figures the verdict carries, and every
miss (expected -> got), memory vs non-memory confusions marked. The phase expected is the step an
out-of-memory class names (its weights, profiling, KV cache allocation, CUDA graph capture, serving), and
for the other classes
start-up vs serving as the record's ``phase`` says (records whose phase is unknown are not counted).
The records without the exception line are shown apart, for information.

Figures: a record's ``numbers`` whose value is printed in its excerpt must be in the verdict's numbers
(under r1sup's key, converted to its unit: ``NUMBER_KEYS``); figures from the thread's title or its
context are not printed in the excerpt and are not counted.

Exit status: 0 when exact accuracy >= 95% over the sources read, there is no memory/non-memory
confusion and every printed figure is extracted, 1 otherwise, 2 when a data file cannot be read.

    python benchmarks/eval_classifier.py [--data PATH ...] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from r1sup.core import failure as fl
from r1sup.core.logparse import LogReader

ROOT = Path(__file__).resolve().parent.parent
SHARED_DEV = Path("shared") / "vllm-logs" / "dev.jsonl"
EXTRA = ROOT / "benchmarks" / "data" / "vllm-logs-extra.jsonl"
HELDOUT = ROOT / "benchmarks" / "data" / "vllm-logs-heldout.jsonl"
NOT_VLLM = "not_vllm"  # the label of another program's output: diagnose exits 6
TARGET = 0.95

# a record's figure -> r1sup's key and the factor to its unit (collection named some figures otherwise)
NUMBER_KEYS: dict[str, tuple[str, float]] = {
    "max_seq_len": ("max_model_len", 1.0),
    "requested_max_model_len": ("max_model_len", 1.0),
    "requested_util": ("gpu_memory_utilization", 1.0),
    "total_capacity_gib": ("device_total_gib", 1.0),
    "free_mib": ("device_free_mib", 1.0),
    "device_free_gib": ("device_free_mib", 1024.0),
    "tried_to_allocate_gib": ("tried_to_allocate_mib", 1024.0),
    "reserved_unallocated_gib": ("reserved_unallocated_mib", 1024.0),
}

OOM_STEP = {
    fl.OOM_WEIGHTS: fl.PHASE_LOAD_WEIGHTS,
    fl.OOM_PROFILE: fl.PHASE_PROFILE,
    fl.OOM_KV_ALLOC: fl.PHASE_KV_CACHE,
    fl.OOM_CUDAGRAPH: fl.PHASE_CUDA_GRAPH,
    fl.OOM_RUNTIME: fl.PHASE_SERVING,
}


def find_shared_dev() -> Path | None:
    """``shared/vllm-logs/dev.jsonl`` beside the checkout or above it (a worktree sits deeper)."""
    for folder in ROOT.parents:
        candidate = folder / SHARED_DEV
        if candidate.is_file():
            return candidate
    return None


def load(path: Path) -> list[dict[str, object]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path.name}:{number}: {exc}") from exc
    return records


def printed(value: float, excerpt: str) -> bool:
    """Whether a figure is printed in the excerpt (as an integer, with two decimals, or as given)."""
    forms = {repr(value), f"{value:.2f}", f"{value:g}"}
    if value == int(value):
        forms |= {str(int(value)), f"{int(value):,}"}
    return any(form in excerpt for form in forms)


def missed_figures(rec: dict[str, object], numbers: dict[str, float]) -> list[str]:
    """The record's figures printed in its excerpt that the verdict does not carry."""
    missed = []
    excerpt = str(rec["excerpt"])
    for key, value in dict(rec.get("numbers") or {}).items():  # type: ignore[call-overload]
        if key.endswith("_from_title") or not isinstance(value, (int, float)) or not printed(value, excerpt):
            continue
        name, factor = NUMBER_KEYS.get(key, (key, 1.0))
        got = numbers.get(name)
        want = value * factor
        if got is None or abs(got - want) > max(0.01 * abs(want), 0.011):
            missed.append(f"{key}={value} (got {got})")
    return missed


@dataclass
class Result:
    source: str
    rec_id: str
    label: str
    got: str
    phase_expected: str | None  # None: the record's phase is unknown
    phase_got: str
    evidence: str
    kind: str = "earlier"
    before: str | None = None  # the class given before issue 36's changes (the held-out set records it)
    exit6: bool = False  # diagnose would call it no vLLM log
    figures: int = 0  # printed figures of the record
    missed: tuple[str, ...] = ()  # of which the verdict does not carry these

    @property
    def ok(self) -> bool:
        return self.got == self.label

    @property
    def confusion(self) -> bool:
        return self.confused(self.got)

    def confused(self, cls: str) -> bool:
        """Whether ``cls`` puts the record on the wrong side of memory / non-memory."""
        return (self.label in fl.MEMORY_CLASSES) != (cls in fl.MEMORY_CLASSES)

    @property
    def phase_ok(self) -> bool:
        if self.label in OOM_STEP:
            return self.phase_got == self.phase_expected
        return (self.phase_got == fl.PHASE_SERVING) == (self.phase_expected == fl.PHASE_SERVING)


def expected_phase(rec: dict[str, object]) -> str | None:
    label = str(rec["label"])
    if label in OOM_STEP:
        return OOM_STEP[label]
    phase = str(rec.get("phase") or "").strip().lower()
    if phase.startswith("serving"):
        return fl.PHASE_SERVING
    if phase.startswith("startup") and not phase.startswith("startup/serving"):
        return fl.PHASE_STARTUP
    return None


def classify(source: str, rec: dict[str, object]) -> Result:
    reader = LogReader()
    reader.feed_lines(str(rec["excerpt"]).split("\n"))
    diagnosis = reader.diagnose()
    failure = diagnosis.failure
    excerpt = str(rec["excerpt"])
    figures = [
        k
        for k, v in dict(rec.get("numbers") or {}).items()  # type: ignore[call-overload]
        if not k.endswith("_from_title") and isinstance(v, (int, float)) and printed(v, excerpt)
    ]
    return Result(
        source=source,
        rec_id=str(rec["id"]),
        label=str(rec["label"]),
        got=NOT_VLLM if rec["label"] == NOT_VLLM and not diagnosis.vllm_log else failure.cls,
        exit6=not diagnosis.vllm_log,
        phase_expected=expected_phase(rec),
        phase_got=failure.phase,
        evidence=failure.evidence,
        kind=str(rec.get("kind") or "earlier"),
        before=str(rec["before"]) if rec.get("before") else None,
        figures=len(figures),
        missed=tuple(missed_figures(rec, failure.numbers.to_dict())),
    )


def percent(good: int, total: int) -> str:
    return f"{good}/{total} = {100.0 * good / total:5.1f}%" if total else "0/0"


def report(results: list[Result], verbose: bool) -> tuple[int, int, int]:
    """Print per-source, per-class and phase figures and the misses; (correct, total, confusions)."""
    sources = sorted({r.source for r in results}, key=lambda s: [r.source for r in results].index(s))
    width = max(len(s) for s in [*sources, "total"])
    for source in [*sources, "total"]:
        rows = [r for r in results if source in ("total", r.source)]
        good = sum(r.ok for r in rows)
        confusions = sum(r.confusion for r in rows)
        exact = percent(good, len(rows))
        line = f"  {source:<{width}}  exact {exact}   memory/non-memory confusions {confusions}"
        if rows and all(r.before is not None for r in rows):
            was = percent(sum(r.before == r.label for r in rows), len(rows))
            was_confused = sum(r.confused(r.before) for r in rows if r.before is not None)
            line += f"   (before issue 36: exact {was}, confusions {was_confused})"
        print(line)
    per_class: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in results:
        per_class[r.label][0] += r.ok
        per_class[r.label][1] += 1
    print("  per class:")
    cwidth = max(len(c) for c in per_class)
    for cls in sorted(per_class):
        good, total = per_class[cls]
        kind = "memory" if cls in fl.MEMORY_CLASSES else "other"
        print(f"    {cls:<{cwidth}}  {kind:<6}  {percent(good, total)}")
    per_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in results:
        per_kind[r.kind][0] += r.ok
        per_kind[r.kind][1] += 1
        per_kind[r.kind][2] += r.confusion
    print("  per kind:")
    kwidth = max(len(k) for k in per_kind)
    for kind in sorted(per_kind, key=lambda k: (k == "earlier", k)):
        good, total, confusions = per_kind[kind]
        rows = [r for r in results if r.kind == kind]
        was = ""
        if all(r.before is not None for r in rows):
            was = f"   (before issue 36: {percent(sum(r.before == r.label for r in rows), total)})"
        print(f"    {kind:<{kwidth}}  {percent(good, total)}   confusions {confusions}{was}")
    figures = sum(r.figures for r in results)
    missed = sum(len(r.missed) for r in results)
    print(f"  printed figures extracted: {percent(figures - missed, figures)}")
    for r in results:
        if r.missed:
            print(f"    {r.source}: {r.rec_id}: missed {', '.join(r.missed)}")
    oom = [r for r in results if r.label in OOM_STEP]
    coarse = [r for r in results if r.label not in OOM_STEP and r.phase_expected is not None]
    print(
        f"  phase: out-of-memory step {percent(sum(r.phase_ok for r in oom), len(oom))}; "
        f"start-up vs serving (other classes) {percent(sum(r.phase_ok for r in coarse), len(coarse))}"
    )
    unrecognised = [r for r in results if r.exit6 and r.label != NOT_VLLM]
    print(f"  vLLM excerpts diagnose calls no vLLM log (exit 6): {len(unrecognised)}")
    for r in unrecognised:
        print(f"    {r.source}: {r.rec_id}")
    misses = [r for r in results if not r.ok or (r.phase_expected is not None and not r.phase_ok)]
    if misses:
        print("  misses (expected -> got):")
        for r in misses:
            mark = " MEMORY/NON-MEMORY" if r.confusion else ""
            expected = f"{r.label} ({r.phase_expected or '?'})"
            got = f"{r.got} ({r.phase_got}){mark}"
            print(f"    {r.source}: {r.rec_id}: {expected} -> {got} <- {r.evidence[:90]!r}")
    if verbose:
        for r in results:
            was = f"  (before: {r.before})" if r.before is not None else ""
            mark = "ok " if r.ok else "MISS"
            print(f"    {mark} {r.rec_id:<26} {r.label:<20} -> {r.got:<20} {r.phase_got}{was}")
    return sum(r.ok for r in results), len(results), sum(r.confusion for r in results)


def figures_missed(results: list[Result]) -> int:
    return sum(len(r.missed) for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        type=Path,
        action="append",
        help="a JSON-lines file to measure on (repeatable; default: the shared set and the repository's)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per record")
    args = parser.parse_args(argv)

    sources: list[tuple[str, Path]] = []
    if args.data:
        sources = [(str(path), path) for path in args.data]
    else:
        dev = find_shared_dev()
        if dev is None:
            print("../shared/vllm-logs/dev.jsonl: not found (no shared/ folder here, as in CI): skipped")
        else:
            sources.append(("../shared/vllm-logs/dev.jsonl", dev))
        sources.append((str(EXTRA.relative_to(ROOT)), EXTRA))
        sources.append((str(HELDOUT.relative_to(ROOT)), HELDOUT))

    scored: list[Result] = []
    info: list[Result] = []
    for name, path in sources:
        try:
            records = load(path)
        except (OSError, ValueError) as exc:
            print(f"eval_classifier: cannot read {name}: {exc}", file=sys.stderr)
            return 2
        for rec in records:
            (scored if rec.get("error_line_present") else info).append(classify(name, rec))
    print(f"records with the exception line present: {len(scored)} (of {len(scored) + len(info)})")
    correct, total, confusions = report(scored, args.verbose)
    accuracy = correct / total if total else 0.0
    print(f"exact class accuracy: {percent(correct, total)} (target >= {100 * TARGET:.0f}%)")
    print(f"memory/non-memory confusions: {confusions} (target 0)")
    missed = figures_missed(scored)
    print(f"printed figures not extracted: {missed} (target 0)")
    if info:
        print(f"\nfor information, records whose exception line is missing: {len(info)}")
        report(info, verbose=False)

    passed = total > 0 and accuracy >= TARGET and confusions == 0 and missed == 0
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
