"""The memory model against real GPU start-up logs: ``r1sup plan --json`` run as a user would, per record.

Records are real vLLM start-up logs (one JSON object per line, each with its source URL, a verbatim
excerpt, the flags and only the figures the log printed): ``benchmarks/data/gpu-truth.jsonl`` in this
repository, and ``../shared/gpu-truth/dev.jsonl`` next to it when it exists (it does not in CI; the
output says which files were read). ``--records FILE`` (repeatable) replaces both. A record's
``model_dir`` is a folder with a ``config.json`` under ``models/`` next to its file.

For every in-scope record this runs ``python -m r1sup.cli.app plan --json`` in a subprocess with the
record's flags (``--max-model-len``, ``--gpu-memory-utilization``, ``--kv-cache-dtype``,
``--quantization``, ``--enforce-eager``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--dtype``),
the GPU (``--gpu NAME`` when the catalog knows it, and ``--gpu-memory-gib`` with the log's own total),
``--gpus`` and ``--vllm-version`` (a V0 log without a printed version is sized as V0, 0.7.0), and
prints predicted beside logged for every term the log printed: weights, non-torch, activation peak,
CUDA-graph pool and estimate, available KV memory and KV tokens; then the median and worst errors.

What the log says of the engine's installation is passed on as the engine's environment would pass it:
a sampler that printed ``Using FlashInfer for top-p & top-k sampling`` runs ``plan`` with
``VLLM_USE_FLASHINFER_SAMPLER=1``, one that printed FlashInfer unavailable or disabled with ``=0``
(the record's ``environment.top_k_top_p_sampler``, else that of this repository's record of the same
log file, else the excerpt's own line); nothing otherwise.

The errors are summed up overall, by GPU family (the catalog's card) and by vLLM release.

Targets: every in-scope record within 0.5 GiB of the logged KV memory, the median KV-memory error at
most 0.15 GiB, and within +-10% of the logged KV tokens where the logged cache is 2 GiB or more. Exit
status 1 when a target is missed.

    python benchmarks/bench_planner_truth.py [--records FILE ...] [--json OUT] [--all]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPO_RECORDS = ROOT / "benchmarks" / "data" / "gpu-truth.jsonl"


def _shared_records() -> Path:
    """``shared/gpu-truth/dev.jsonl`` in the nearest folder above the checkout that has one."""
    for folder in ROOT.parents:
        candidate = folder / "shared" / "gpu-truth" / "dev.jsonl"
        if candidate.exists():
            return candidate
    return ROOT.parent / "shared" / "gpu-truth" / "dev.jsonl"


SHARED_RECORDS = _shared_records()
V0_VERSION = "0.7.0"  # a V0 log that did not print its version: any V0 release has the same rules here
TARGET_TOKENS = 0.10
TARGET_TOKENS_FROM_GIB = 2.0  # the token target holds where the logged cache is at least this large
TARGET_KV_GIB = 0.5
TARGET_MEDIAN_KV_GIB = 0.15
PLAN_TIMEOUT_S = 60

sys.path.insert(0, str(ROOT / "supervisor"))

from r1sup.core import catalog, planner  # noqa: E402

# record flag -> r1sup plan option
FLAG_OPTIONS = (
    ("max_model_len", "--max-model-len"),
    ("gpu_memory_utilization", "--gpu-memory-utilization"),
    ("kv_cache_dtype", "--kv-cache-dtype"),
    ("quantization", "--quantization"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("dtype", "--dtype"),
)
# term: (plan --json path, record's observed key)
TERMS = (
    ("weights", ("weights_gib",), "weights_gib"),
    ("non_torch", ("breakdown", "non_torch_gib"), "non_torch_gib"),
    ("activation", ("breakdown", "activation_gib"), "activation_peak_gib"),
    ("graph", ("breakdown", "cudagraph_gib"), "cuda_graph_gib"),
    ("graph_est", ("breakdown", "cudagraph_estimate_gib"), "cuda_graph_estimated_gib"),
    ("kv_gib", ("breakdown", "kv_gib"), "kv_available_gib"),
    ("kv_tokens", ("kv_capacity_tokens",), "kv_tokens"),
)


@dataclass
class Row:
    record: dict[str, Any]
    argv: list[str]
    version: str
    predicted: dict[str, float | None] = field(default_factory=dict)
    logged: dict[str, float | None] = field(default_factory=dict)
    error: str = ""

    @property
    def id(self) -> str:
        return str(self.record["id"])

    def token_error(self) -> float | None:
        p, o = self.predicted.get("kv_tokens"), self.logged.get("kv_tokens")
        if p is None or not o:
            return None
        return p / o - 1

    def kv_gib_error(self) -> float | None:
        p, o = self.predicted.get("kv_gib"), self.logged.get("kv_gib")
        return None if p is None or o is None else p - o

    def tokens_judged(self) -> bool:
        """The token target applies: the logged cache is 2 GiB or more (or its size was not printed)."""
        logged = self.logged.get("kv_gib")
        return logged is None or logged >= TARGET_TOKENS_FROM_GIB

    def meets(self) -> bool:
        tok, gib = self.token_error(), self.kv_gib_error()
        ok_tokens = tok is None or not self.tokens_judged() or abs(tok) <= TARGET_TOKENS
        ok_gib = gib is None or abs(gib) <= TARGET_KV_GIB
        return not self.error and (tok is not None or gib is not None) and ok_tokens and ok_gib

    @property
    def family(self) -> str:
        return gpu_family(self.record)


def load_records(paths: Iterable[Path]) -> list[tuple[dict[str, Any], Path]]:
    """Records with the folder their model configs live in; a later file's record replaces an earlier
    one of the same log (``log_url``, else ``id``)."""
    by_key: dict[str, tuple[dict[str, Any], Path]] = {}
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{n}: not JSON: {exc}") from None
            by_key[str(record.get("log_url") or record["id"])] = (record, path.parent / "models")
    return list(by_key.values())


def gpu_family(record: dict[str, Any]) -> str:
    """The catalog's card for the record's GPU, else its name without the vendor."""
    name = str(record.get("gpu") or "")
    found = catalog.find_gpu(name)
    return found[0] if found is not None else name.replace("NVIDIA ", "").strip() or "?"


def release(record: dict[str, Any]) -> str:
    """``major.minor`` of the record's vLLM (V0 when the log printed none)."""
    text = str(record.get("vllm_version") or "")
    parts = text.split(".")
    if len(parts) >= 2 and parts[0].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return "V0 (unknown)" if record.get("engine") == "V0" else "?"


SAMPLER_ON = "Using FlashInfer for top-p & top-k sampling"
SAMPLER_OFF = ("FlashInfer is not available", "FlashInfer top-p/top-k sampling disabled", "falling back")


def log_key(url: str | None) -> str | None:
    """A log file's URL without the commit it was read at (``.../blob/<sha>/path`` -> ``.../path``)."""
    if not url:
        return None
    return re.sub(r"/blob/[0-9a-f]{7,40}/", "/", url.split("#")[0])


def _known_environments() -> dict[str, dict[str, Any]]:
    """The ``environment`` this repository's records read from their logs, by log file: a record of the
    same log from elsewhere (whose excerpt may leave the sampler line out) gets it too."""
    out: dict[str, dict[str, Any]] = {}
    if REPO_RECORDS.exists():
        for line in REPO_RECORDS.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                key = log_key(record.get("log_url"))
                if key and record.get("environment"):
                    out[key] = record["environment"]
    return out


KNOWN_ENVIRONMENTS = _known_environments()


def engine_env(record: dict[str, Any]) -> dict[str, str]:
    """What the log says of the engine's environment, as the variables vLLM reads (see the docstring)."""
    environment = record.get("environment") or KNOWN_ENVIRONMENTS.get(log_key(record.get("log_url")) or "")
    sampler = (environment or {}).get("top_k_top_p_sampler")
    excerpt = str(record.get("excerpt") or "")
    if sampler is None and SAMPLER_ON in excerpt:
        sampler = "flashinfer"
    elif sampler is None and any(s in excerpt for s in SAMPLER_OFF) and "top-k" in excerpt:
        sampler = "native"
    if sampler == "flashinfer":
        return {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    if sampler == "native":
        return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return {}


def plan_argv(record: dict[str, Any], models: Path) -> tuple[list[str], str]:
    flags = record.get("flags") or {}
    version = record.get("vllm_version") or (V0_VERSION if record.get("engine") == "V0" else None)
    argv = [sys.executable, "-m", "r1sup.cli.app", "--log-level", "error", "plan", "--json"]
    argv += ["--model", str(models / record["model_dir"])]
    found = catalog.find_gpu(str(record.get("gpu") or ""))
    if found is not None:
        argv += ["--gpu", found[0]]
    if record.get("gpu_total_gib") is not None:  # the log's own total; else the catalog's for the named card
        argv += ["--gpu-memory-gib", str(record["gpu_total_gib"])]
    elif found is None:
        raise ValueError(
            f"{record['id']}: no total memory in the log and no catalog card named {record.get('gpu')!r}"
        )
    argv += ["--gpus", str(record.get("gpus") or 1)]
    if version:
        argv += ["--vllm-version", str(version)]
    for key, option in FLAG_OPTIONS:
        value = flags.get(key)
        if value is None or (key in ("kv_cache_dtype", "dtype") and value == "auto"):
            continue
        if key == "dtype" and value in ("half",):
            value = "float16"
        argv += [option, str(value)]
    if flags.get("enforce_eager"):
        argv.append("--enforce-eager")
    return argv, str(version or "newest")


def _get(data: dict[str, Any], path: Sequence[str]) -> float | None:
    value: Any = data
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) else None


def run(record: dict[str, Any], models: Path) -> Row:
    argv, version = plan_argv(record, models)
    row = Row(record, argv, version)
    observed = record.get("observed") or {}
    for term, _, key in TERMS:
        value = observed.get(key)
        row.logged[term] = (
            float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}
    env.update(engine_env(record))
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PLAN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    if proc.returncode not in planner.VERDICTS.values():  # plan's exit status is its verdict's
        row.error = (proc.stderr.strip() or proc.stdout.strip())[-300:]
        return row
    data = json.loads(proc.stdout)
    for term, path, _ in TERMS:
        row.predicted[term] = _get(data, path)
    return row


def _cell(p: float | None, o: float | None, digits: int = 2) -> str:
    if o is None:
        return f"{'-':>13}" if p is None else f"{p:>6.{digits}f}/{'-':>6}"
    if p is None:
        return f"{'?':>6}/{o:>6.{digits}f}"
    return f"{p:>6.{digits}f}/{o:>6.{digits}f}"


def render(rows: list[Row], sources: list[str], skipped: list[dict[str, Any]]) -> str:
    out = [f"records: {', '.join(sources)}"]
    head = (
        f"{'record':<46} {'gpu':<10} {'tp':>2} {'vllm':<7} | {'weights':>13} {'non-torch':>13} "
        f"{'activation':>13} {'graph':>13} {'graph est':>13} {'KV GiB':>15} | {'KV tokens':>21} {'err':>7}"
    )
    out += ["", "predicted/logged (GiB); KV tokens predicted/logged and the error", head, "-" * len(head)]
    for r in rows:
        gpu = str(r.record.get("gpu", "")).replace("NVIDIA ", "")[:10]
        if r.error:
            out.append(f"{r.id[:46]:<46} {gpu:<10} error: {r.error}")
            continue
        p, o = r.predicted, r.logged
        tok = r.token_error()
        kv = f"{p['kv_gib'] or 0:>7.2f}/{o['kv_gib'] if o['kv_gib'] is not None else float('nan'):>7.2f}"
        tokens = f"{int(p['kv_tokens'] or 0):>10,}/{int(o['kv_tokens'] or 0):>10,}"
        out.append(
            f"{r.id[:46]:<46} {gpu:<10} {r.record.get('gpus', 1):>2} {r.version:<7} | "
            f"{_cell(p['weights'], o['weights'])} {_cell(p['non_torch'], o['non_torch'])} "
            f"{_cell(p['activation'], o['activation'])} {_cell(p['graph'], o['graph'])} "
            f"{_cell(p['graph_est'], o['graph_est'])} {kv} | {tokens} "
            + (f"{100 * tok:>+6.1f}%" if tok is not None else f"{'-':>7}")
            + ("" if r.meets() else "  MISS")
        )
    if skipped:
        out.append("")
        out.append(
            f"out of scope ({len(skipped)}): "
            + "; ".join(f"{s['id']} ({s.get('scope_reason')})" for s in skipped)
        )
    return "\n".join(out)


def _group_line(name: str, rows: list[Row]) -> str:
    gib = [abs(e) for r in rows if (e := r.kv_gib_error()) is not None]
    worst = max((r.kv_gib_error() or 0.0 for r in rows), key=abs, default=0.0)
    tok = [abs(t) for r in rows if r.tokens_judged() and (t := r.token_error()) is not None]
    median = f"{statistics.median(gib):.3f}" if gib else "-"
    median_tok = f"{100 * statistics.median(tok):.1f}%" if tok else "-"
    met = sum(r.meets() for r in rows)
    return f"  {name:<16} {len(rows):>3} {median:>10} {worst:>+9.2f} {median_tok:>13}   {met} of {len(rows)}"


def _natural(name: str) -> tuple[Any, ...]:
    """``0.7`` before ``0.10``; names without numbers last."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.replace(" ", ".").split("."))


def groups(rows: list[Row]) -> list[str]:
    """KV-memory and KV-token errors by GPU family and by vLLM release (the README's table)."""
    good = [r for r in rows if not r.error]
    head = f"  {'':<16} {'n':>3} {'median GiB':>10} {'worst GiB':>9} {'median tokens':>13}   on target"
    out: list[str] = []
    for title, key in (
        ("by GPU family", lambda r: r.family),
        ("by vLLM release", lambda r: release(r.record)),
    ):
        out += [f"{title}:", head]
        names = sorted({key(r) for r in good}, key=_natural)
        for name in names:
            out.append(_group_line(name, [r for r in good if key(r) == name]))
    return out


def summary(rows: list[Row]) -> tuple[list[str], bool]:
    lines: list[str] = []
    good = [r for r in rows if not r.error]
    for term, _, _ in TERMS:
        errs = [
            (r.predicted[term] or 0) - (r.logged[term] or 0)
            for r in good
            if r.logged.get(term) is not None and r.predicted.get(term) is not None
        ]
        if not errs or term == "kv_tokens":
            continue
        worst = max(errs, key=abs)
        median = statistics.median(abs(e) for e in errs)
        lines.append(
            f"  {term:<11} {len(errs):>3} records: median |error| {median:.3f} GiB, worst {worst:+.3f} GiB"
        )
    tok = [t for r in good if r.tokens_judged() and (t := r.token_error()) is not None]
    tok_abs = [abs(t) for t in tok]
    median_tok = statistics.median(tok_abs) if tok_abs else 0.0
    worst_tok = max(tok, key=abs) if tok else 0.0
    lines.append(
        f"  kv_tokens   {len(tok_abs):>3} records with >= {TARGET_TOKENS_FROM_GIB:g} GiB of KV: "
        f"median |error| {100 * median_tok:.2f}%, worst {100 * worst_tok:+.2f}%"
    )
    gib = [abs(e) for r in good if (e := r.kv_gib_error()) is not None]
    median_gib = statistics.median(gib) if gib else float("inf")
    missed = [r.id for r in rows if not r.meets()]
    ok_each = not missed
    ok_median = median_gib <= TARGET_MEDIAN_KV_GIB
    lines.append("")
    lines += groups(rows)
    lines.append("targets:")
    lines.append(
        f"  {'PASS' if ok_each else 'FAIL'}  every record within {TARGET_KV_GIB} GiB of the KV memory and, "
        f"where the cache is >= {TARGET_TOKENS_FROM_GIB:g} GiB, +-{100 * TARGET_TOKENS:.0f}% of the KV "
        f"tokens: {len(rows) - len(missed)} of {len(rows)}"
        + (f" (missed: {', '.join(missed)})" if missed else "")
    )
    lines.append(
        f"  {'PASS' if ok_median else 'FAIL'}  median KV-memory error <= {TARGET_MEDIAN_KV_GIB} GiB: "
        f"{median_gib:.3f} GiB"
    )
    return lines, ok_each and ok_median


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", action="append", type=Path, help="JSONL of records (repeatable)")
    ap.add_argument("--json", type=Path, help="write every row as JSON here")
    ap.add_argument(
        "--all", action="store_true", help="also run the out-of-scope records (not in the targets)"
    )
    args = ap.parse_args(argv)
    if args.records:
        paths = list(args.records)
        note = " (as given)"
    else:
        paths = [p for p in (SHARED_RECORDS, REPO_RECORDS) if p.exists()]
        note = (
            ""
            if SHARED_RECORDS.exists()
            else "; ../shared/gpu-truth not found (CI): the repository's records alone"
        )
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise SystemExit(f"no such records file: {missing[0]}")
    t0 = time.monotonic()
    records = load_records(paths)
    in_scope = [(r, m) for r, m in records if r.get("scope") == "in" or (args.all and r.get("model_dir"))]
    skipped = [r for r, _ in records if (r, _) not in in_scope]
    rows = [run(r, m) for r, m in in_scope]
    sources = [os.path.relpath(p, ROOT) for p in paths]
    print(render(rows, [s + note if i == len(sources) - 1 else s for i, s in enumerate(sources)], skipped))
    lines, ok = summary([r for r in rows if r.record.get("scope") == "in"])
    print("")
    print(f"errors over {len(rows)} in-scope records (predicted - logged):")
    print("\n".join(lines))
    print(f"\n{len(rows)} records in {time.monotonic() - t0:.0f}s")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "id": r.id,
                        "argv": r.argv[3:],
                        "predicted": r.predicted,
                        "logged": r.logged,
                        "error": r.error,
                    }
                    for r in rows
                ],
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
