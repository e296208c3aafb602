"""Measure r1sup's log classifier on real vLLM excerpts (../shared/vllm-logs/dev.jsonl).

Scored: records whose exception line is present (``error_line_present``). Printed: per-class
accuracy, overall exact accuracy, memory/non-memory confusions, and every miss. The records without
the exception line are shown apart, for information.

Exit status: 0 when exact accuracy >= 90% and there is no memory/non-memory confusion, 1 otherwise,
2 when the data file cannot be read.

    python benchmarks/eval_classifier.py [--data PATH] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from r1sup.failure import MEMORY_CLASSES
from r1sup.logparse import diagnose_text

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "vllm-logs" / "dev.jsonl"
TARGET = 0.90


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
                raise ValueError(f"{path}:{number}: {exc}") from exc
    return records


def evaluate(records: list[dict[str, object]], verbose: bool) -> tuple[int, int, int, list[str]]:
    per_class: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    confusions = 0
    misses: list[str] = []
    correct = 0
    for rec in records:
        label = str(rec["label"])
        failure, _ = diagnose_text(str(rec["excerpt"]).split("\n"))
        ok = failure.cls == label
        per_class[label][1] += 1
        if ok:
            per_class[label][0] += 1
            correct += 1
        else:
            if (label in MEMORY_CLASSES) != failure.memory:
                confusions += 1
            misses.append(
                f"  {rec['id']}: expected {label}, got {failure.cls} ({failure.phase}) "
                f"<- {failure.evidence[:100]!r}"
            )
        if verbose:
            mark = "ok " if ok else "MISS"
            print(f"  {mark} {rec['id']:<24} {label:<20} -> {failure.cls:<20} {failure.phase}")
    width = max((len(c) for c in per_class), default=5)
    for cls in sorted(per_class):
        good, total = per_class[cls]
        kind = "memory" if cls in MEMORY_CLASSES else "other"
        print(f"  {cls:<{width}}  {kind:<6}  {good:>2}/{total:<2}  {100.0 * good / total:5.1f}%")
    return correct, len(records), confusions, misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="JSON lines with label and excerpt")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per record")
    args = parser.parse_args(argv)
    try:
        records = load(args.data)
    except (OSError, ValueError) as exc:
        print(f"eval_classifier: cannot read {args.data}: {exc}", file=sys.stderr)
        return 2
    scored = [r for r in records if r.get("error_line_present")]
    info = [r for r in records if not r.get("error_line_present")]

    print(f"records with the exception line present: {len(scored)} (of {len(records)})")
    correct, total, confusions, misses = evaluate(scored, args.verbose)
    accuracy = correct / total if total else 0.0
    print(f"exact class accuracy: {correct}/{total} = {100 * accuracy:.1f}% (target >= {100 * TARGET:.0f}%)")
    print(f"memory/non-memory confusions: {confusions} (target 0)")
    if misses:
        print("misses:")
        print("\n".join(misses))

    if info:
        print(f"\nfor information, records whose exception line is missing: {len(info)}")
        icorrect, itotal, iconf, imisses = evaluate(info, args.verbose)
        print(f"exact: {icorrect}/{itotal}, memory/non-memory confusions: {iconf}")
        if imisses and args.verbose:
            print("\n".join(imisses))

    passed = total > 0 and accuracy >= TARGET and confusions == 0
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
