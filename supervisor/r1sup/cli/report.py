"""The report of one tune or run, from its run record (r1sup.state.runrecord): text for the console and one
self-contained HTML page (inline CSS and SVG; no scripts, fonts or anything else from outside).

Pure: a record dict (and optionally the daemon's status.json) in, a string out.
"""

from __future__ import annotations

import html
import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from r1sup.core import capacity
from r1sup.core import memchart as M
from r1sup.core.catalog import catalog_total_beside
from r1sup.core.figures import Figures
from r1sup.core.flags import short
from r1sup.core.probing import ProbeResult
from r1sup.core.progress import LABELS as PHASE_LABELS
from r1sup.core.progress import PHASES, clock
from r1sup.state.runrecord import charts_of


def headline(record: Mapping[str, Any]) -> str:
    result = record.get("result") or {}
    command = record.get("command", "tune")
    if not result:
        done = len(record.get("attempts") or [])
        if record.get("finished_at"):
            return f"r1sup {command}: {record.get('final_state') or 'stopped'} before a working configuration"
        return f"r1sup {command}: in progress ({done} attempt(s) so far)"
    return f"r1sup {command}: " + (
        "found a working configuration" if result.get("ok") else "no working configuration"
    )


# --- text ----------------------------------------------------------------------------------------


def render_text(record: Mapping[str, Any]) -> str:
    """The report ``tune`` prints: each attempt with what it changed and why, the memory of each GPU
    (predicted beside measured), then the working flags or the reason and the ways out."""
    result = record.get("result") or {}
    lines = ["", headline(record), ""]
    lines += [f"model   {record.get('model')} (served as {record.get('served_name')})"]
    box = box_text(record.get("device"))
    if box:
        lines.append(f"box     {box}")
    target = target_text(record.get("target"))
    if target:
        lines.append(f"target  {target}")
    lines.append("")
    attempts = list(record.get("attempts") or [])
    for a in attempts:
        lines += _attempt_text(a)
    last = attempts[-1] if attempts else None
    charts = charts_of(last) if last else []
    if charts:
        lines.append("")
        lines.append(
            f"memory of attempt {last.get('launch', len(attempts)) if last else ''}, GiB per device:"
        )
        lines += ["  " + line if line else line for line in M.render_text(charts).rstrip("\n").splitlines()]
    lines.append("")
    lines.append(f"launches: {result.get('launches', len(attempts))}")
    if result.get("ok") and result.get("flags"):
        from r1sup.core.flags import EngineFlags

        lines.append("flags: " + " ".join(EngineFlags.from_dict(result["flags"]).to_argv()))
        for cost in result.get("costs") or []:
            lines.append(f"  costs: {cost}")
        reduced = result.get("reduced")
        if isinstance(reduced, Mapping) and reduced.get("reason"):
            lines.append(str(reduced["reason"]))
        probe = result.get("probe")
        if probe:
            lines.append("probe: " + probe_text(ProbeResult.from_dict(probe)))
        verified = record_capacity(record)
        if verified:
            lines.append("capacity: " + verified.text())
        lines += slo_text(result)
        lines.append("vLLM command line:")
        lines.append("  " + " ".join(shlex.quote(str(a)) for a in result.get("command") or []))
        lines.append(f"profile: {result.get('profile_path') or 'NOT saved (see the log)'}")
    elif result:
        lines.append(f"why: {result.get('reason')}")
        for s in result.get("suggestions") or []:
            lines.append(f"  way out: {s}")
    lines.append("")
    return "\n".join(lines)


def slo_of(result: Mapping[str, Any]) -> Any:
    """The service level a result proved ([slo], r1sup.core.slo.SloResult), or None (none asked, or a
    record it cannot read)."""
    from r1sup.core.slo import SloResult

    data = result.get("slo")
    if not data:
        return None
    try:
        return SloResult.from_dict(data)
    except ValueError:
        return None


def slo_text(result: Mapping[str, Any]) -> list[str]:
    """The service-level picture of the tune report (r1sup.core.slochart), or nothing."""
    from r1sup.core import slochart

    found = slo_of(result)
    return slochart.render_text(found).rstrip("\n").splitlines() if found is not None else []


def slo_html(result: Mapping[str, Any]) -> list[str]:
    """The HTML report's service-level section: the verdict, the chart, the levels."""
    from r1sup.core import slochart

    found = slo_of(result)
    if found is None:
        return []
    out = ['<section id="slo"><h2>Service level</h2>', f"<p>{_e(found.targets.describe())}; "]
    out.append(f"{_e(found.workload.describe())}</p><p>{_e(found.reason)}</p>")
    out.append(slochart.render_svg(found))
    out.append('<table class="slo"><tr><th>at once</th><th>TTFT p95</th><th>ITL p95</th><th>e2e p95</th>')
    out.append("<th>requests/s</th><th>goodput/s</th><th>broke</th></tr>")
    for lv in found.levels:
        out.append(
            f"<tr><td>{lv.concurrency}</td><td>{_e(lv.ttft_p95_s)}</td><td>{_e(lv.itl_p95_s)}</td>"
            f"<td>{_e(lv.e2e_p95_s)}</td><td>{lv.request_rate:g}</td><td>{lv.goodput:g}</td>"
            f"<td>{_e(', '.join(lv.broken) or '-')}</td></tr>"
        )
    out.append("</table></section>")
    return out


def record_capacity(record: Mapping[str, Any]) -> capacity.Capacity | None:
    """What the passed probe of a record's result proved (r1sup.core.capacity), held against what the config
    asked (``asked``; a record written before it was kept: the target)."""
    result = record.get("result") or {}
    asked = record.get("asked")
    if not isinstance(asked, Mapping):
        target = record.get("target") or {}
        asked = {"requests": target.get("concurrency"), "context": target.get("context")}
    probe, stands_on = result.get("probe"), result.get("stands_on")
    flags = result.get("flags")
    return capacity.verified(
        ProbeResult.from_dict(probe) if isinstance(probe, Mapping) else None,
        flags.get("max_model_len") if isinstance(flags, Mapping) else None,
        Figures.from_dict(obs if isinstance(obs := result.get("observations"), Mapping) else None),
        capacity.Asked.from_dict(asked),
        reduced=bool(result.get("reduced")),
        stands_on=ProbeResult.from_dict(stands_on) if isinstance(stands_on, Mapping) else None,
    )


def _attempt_text(a: Mapping[str, Any]) -> list[str]:
    ok = a.get("outcome") == "ok"
    head = f"attempt {a.get('launch', a.get('number'))}  {'ok' if ok else 'FAILED'}"
    if not ok:
        head += f"  {a.get('failure_class')} in {a.get('phase')}"
    head += f"  {_secs(a.get('seconds'))}  {short(a.get('flags') or {})}"
    out = [head, f"  why     {a.get('why') or 'as given'}"]
    if ok:
        out.append("  result  probe passed" if a.get("failure_class") == "none" else "  result  ok")
    else:
        where = f" ({a['where']})" if a.get("where") else ""
        out.append(f"  result  {a.get('evidence')}{where}")
        if a.get("change"):
            out.append(f"  next    {a.get('change')}")
    phases = phases_text(a.get("phase_seconds"))
    if phases:
        out.append(f"  phases  {phases}")
    return out


def box_text(device: Any) -> str:
    if not isinstance(device, Mapping):
        return ""
    gpus = device.get("gpus") or []
    if gpus:
        names = sorted({str(g.get("name")) for g in gpus})
        first = gpus[0]
        total = first.get("total_gib")
        beside = catalog_total_beside(str(first.get("name")), float(total)) if total is not None else ""
        text = f"{len(gpus)}x {', '.join(names)} ({total} GiB each{beside}"
        frees = ", ".join(f"{g.get('free_gib')}" for g in gpus)
        text += f"; free before the launch: {frees} GiB)"
    else:
        cpu = device.get("cpu_model") or "a CPU"
        text = f"vLLM CPU backend on {cpu}, NUMA node {device.get('host_total_gib')} GiB"
    procs = device.get("processes") or []
    if procs:
        held = "; ".join(
            f"pid {p.get('pid')} {p.get('name')} holds {p.get('used_gib')} GiB" for p in procs[:4]
        )
        text += f"; {held}"
    return text


def target_text(target: Any) -> str:
    if not isinstance(target, Mapping) or not (target.get("concurrency") or target.get("context")):
        return ""
    return f"{target.get('concurrency') or 1} request(s) of {target.get('context')} tokens at once"


def phases_text(phase_seconds: Any) -> str:
    if not isinstance(phase_seconds, Mapping) or not phase_seconds:
        return ""
    parts = [
        f"{PHASE_LABELS[p]} {_secs(phase_seconds[p])}"
        for p in PHASES
        if isinstance(phase_seconds.get(p), (int, float)) and phase_seconds[p] > 0
    ]
    return ", ".join(parts)


def probe_text(p: ProbeResult) -> str:
    return (
        f"{p.succeeded}/{p.requests} ok at concurrency {p.concurrency}{p.queued_text()}, prompts of "
        f"{p.prompt_tokens} tokens, {p.output_tokens} output tokens each, "
        f"TTFT p50 {_num(p.ttft_p50_s)}s p95 {_num(p.ttft_p95_s)}s, "
        f"{_num(p.output_tokens_per_s)} output tok/s, "
        f"peak KV usage {_pct(p.peak_kv_usage)}, preemptions {p.preemptions}"
        + (p.wave.text() if p.wave is not None else "")
    )


def _secs(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.1f}s" if value < 60 else clock(value)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


# --- HTML ----------------------------------------------------------------------------------------

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #1f1f1f; background: #ffffff; max-width: 1100px; }
h1 { font-size: 22px; margin: 0 0 6px 0; }
h2 { font-size: 18px; margin: 28px 0 8px 0; border-bottom: 1px solid #cccccc; }
h3 { font-size: 15px; margin: 0 0 6px 0; }
.verdict { padding: 10px 14px; color: #ffffff; font-weight: bold; border-radius: 4px; }
.verdict.ok { background: #2e7d32; }
.verdict.failed { background: #c62828; }
.verdict.running { background: #1565c0; }
.verdict.reduced { background: #8a4b00; }
table { border-collapse: collapse; }
th, td { text-align: left; vertical-align: top; padding: 4px 10px 4px 0; font-size: 13px; }
table.attempts th { border-bottom: 1px solid #999999; }
table.attempts td { border-bottom: 1px solid #eeeeee; }
td.ok { color: #2e7d32; font-weight: bold; }
td.failed { color: #c62828; font-weight: bold; }
section.attempt { border-left: 6px solid #c62828; padding: 8px 0 8px 12px; margin: 14px 0; }
section.attempt.ok { border-left-color: #2e7d32; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; margin: 4px 0 8px 0; }
dl { font-size: 13px; }
dt { font-weight: bold; }
dd { margin: 0; }
code, pre { font-family: monospace; font-size: 12px; background: #f4f4f4; }
pre { padding: 8px; white-space: pre-wrap; word-break: break-all; }
.muted { color: #666666; }
"""


def render_html(
    record: Mapping[str, Any], status: Mapping[str, Any] | None = None, source: str | None = None
) -> str:
    """One self-contained page: verdict, summary, the attempts (what changed and why), each attempt's
    memory per GPU as inline SVG, the result, and for a run the daemon's recent events."""
    result = record.get("result") or {}
    state = "running" if not result else ("ok" if result.get("ok") else "failed")
    if state == "ok" and reduced_text(record):
        state = "reduced"
    title = f"{headline(record)}: {record.get('model')}"
    body: list[str] = [
        f'<header id="verdict"><h1>{_e(headline(record))}</h1>',
        f'<p class="verdict {state}">{_e(_verdict_line(record))}</p></header>',
        '<section id="summary"><h2>Summary</h2><table class="summary">',
    ]
    rows = [
        ("model", f"{record.get('model')} (served as {record.get('served_name')})"),
        ("URL", record.get("url")),
        ("box", box_text(record.get("device"))),
        ("target", target_text(record.get("target")) or "one request of the full context (vLLM's own check)"),
        ("command", f"r1sup {record.get('command')} (pid {record.get('pid')})"),
        ("config", record.get("config")),
        ("started", record.get("started_at")),
        ("finished", record.get("finished_at") or "not yet (still running)"),
        ("launches", result.get("launches", len(record.get("attempts") or []))),
        *_outcome_rows(record),
        *_serves_rows(record),
        ("profile", result.get("profile_path")),
    ]
    body += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows if v not in (None, "")]
    body.append("</table></section>")

    attempts = list(record.get("attempts") or [])
    body.append('<section id="attempts"><h2>Attempts</h2><table class="attempts">')
    body.append(
        "<tr><th>#</th><th>outcome</th><th>class</th><th>phase</th><th>time</th><th>flags</th>"
        "<th>why these flags</th><th>what happened</th></tr>"
    )
    for a in attempts:
        ok = a.get("outcome") == "ok"
        happened = (
            "probe passed"
            if ok
            else f"{a.get('evidence', '')}" + (f" → {a.get('change')}" if a.get("change") else "")
        )
        body.append(
            f'<tr class="attempt-row"><td>{_e(a.get("launch"))}</td>'
            f'<td class="{"ok" if ok else "failed"}">{"ok" if ok else "failed"}</td>'
            f"<td>{_e(a.get('failure_class'))}</td><td>{_e('-' if ok else a.get('phase'))}</td>"
            f"<td>{_e(_secs(a.get('seconds')))}</td><td><code>{_e(short(a.get('flags') or {}))}</code></td>"
            f"<td>{_e(a.get('why') or 'as given')}</td><td>{_e(happened)}</td></tr>"
        )
    body.append("</table></section>")

    for a in attempts:
        body += _attempt_html(a)

    body.append('<section id="result"><h2>Result</h2>')
    if result.get("ok") and result.get("flags"):
        from r1sup.core.flags import EngineFlags

        body.append("<dl>")
        body.append(
            "<dt>flags</dt><dd><code>"
            + _e(" ".join(EngineFlags.from_dict(result["flags"]).to_argv()))
            + "</code></dd>"
        )
        if result.get("probe"):
            body.append(f"<dt>probe</dt><dd>{_e(probe_text(ProbeResult.from_dict(result['probe'])))}</dd>")
        body += [f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in _serves_rows(record)]
        body.append("</dl>")
        cmd = " ".join(shlex.quote(str(a)) for a in result.get("command") or [])
        body.append(f"<p>vLLM command line:</p><pre>{_e(cmd)}</pre>")
    elif result:
        body.append(f"<p>{_e(result.get('reason'))}</p>")
        ways = result.get("suggestions") or []
        if ways:
            body.append("<p>ways out:</p><ul>" + "".join(f"<li>{_e(w)}</li>" for w in ways) + "</ul>")
    else:
        body.append("<p>the search is still running</p>")
    body.append("</section>")
    body += slo_html(result)

    events = (status or {}).get("recent_events") if status else None
    if isinstance(events, Sequence) and events:
        body.append('<section id="events"><h2>Recent events</h2><table class="events">')
        for ev in events:
            if isinstance(ev, Mapping):
                rest = ", ".join(f"{k}={event_value(v)}" for k, v in ev.items() if k not in ("ts", "event"))
                body.append(
                    f"<tr><td>{_e(ev.get('ts'))}</td><td>{_e(ev.get('event'))}</td><td>{_e(rest)}</td></tr>"
                )
        body.append("</table></section>")
    footer = f"r1sup {record.get('r1sup_version', '')}, run {record.get('id')}"
    if source:
        footer += f", from {source}"
    body.append(f'<footer class="muted"><p>{_e(footer)}</p></footer>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _outcome_rows(record: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """How the process ended, once it has: ``tune``'s exit code is its result's; a ``run`` records the
    state it ended in (its exit code is not in the record). Nothing while it still runs: a search's
    result is not the exit code of a daemon that goes on serving."""
    if not record.get("finished_at"):
        return []
    if record.get("command") == "run":
        return [("final state", record.get("final_state"))]
    return [("exit code", (record.get("result") or {}).get("exit_code"))]


def event_value(value: Any) -> str:
    """An event field as its JSON reads (``false``, ``null``, ``{"a": 1}``); text as it is."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(", ", ": "), default=str)
    except (TypeError, ValueError):
        return str(value)


def _attempt_html(a: Mapping[str, Any]) -> list[str]:
    ok = a.get("outcome") == "ok"
    n = a.get("launch", a.get("number"))
    what = "ok, probe passed" if ok else f"failed: {a.get('failure_class')} in {a.get('phase')}"
    out = [
        f'<section id="attempt-{_e(n)}" class="attempt {"ok" if ok else "failed"}">',
        f"<h3>Attempt {_e(n)}: {_e(what)}</h3><dl>",
        f"<dt>flags</dt><dd><code>{_e(short(a.get('flags') or {}))}</code></dd>",
        f"<dt>why</dt><dd>{_e(a.get('why') or 'as given')}</dd>",
    ]
    if not ok:
        out.append(f"<dt>root cause</dt><dd>{_e(a.get('evidence'))}</dd>")
        if a.get("where"):
            out.append(f"<dt>where</dt><dd>{_e(a.get('where'))}</dd>")
        if a.get("change"):
            out.append(f"<dt>next</dt><dd>{_e(a.get('change'))}</dd>")
    phases = phases_text(a.get("phase_seconds"))
    if phases:
        out.append(f"<dt>phases</dt><dd>{_e(phases)}</dd>")
    out.append(f"<dt>time</dt><dd>{_e(_secs(a.get('seconds')))}</dd></dl>")
    charts = charts_of(a)
    if charts:
        out.append('<div class="charts">')
        out += [M.render_svg(c) for c in charts]
        out.append("</div>")
    else:
        out.append('<p class="muted">no memory figures for this attempt</p>')
    out.append("</section>")
    return out


def reduced_text(record: Mapping[str, Any]) -> str:
    """How a working configuration serves less than asked, one line (the search's reduction, else
    the capacity's shortfalls); empty when it does not."""
    result = record.get("result") or {}
    if not result.get("ok"):
        return ""
    reduced = result.get("reduced")
    if isinstance(reduced, Mapping) and reduced.get("reason"):
        return str(reduced["reason"])
    verified = record_capacity(record)
    if verified is not None and verified.reduced:
        return "; ".join(verified.reduced_because) or "less than asked"
    return ""


def _serves_rows(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the text report says after the flags: the capacity the probe proved, how it is reduced,
    and what the flags cost; one row each (costs one row per cost)."""
    result = record.get("result") or {}
    if not result.get("ok"):
        return []
    rows: list[tuple[str, str]] = []
    verified = record_capacity(record)
    if verified is not None:
        rows.append(("capacity", verified.text()))
    reduced = reduced_text(record)
    if reduced:
        rows.append(("REDUCED", reduced))
    rows += [("costs", str(cost)) for cost in result.get("costs") or []]
    return rows


def _verdict_line(record: Mapping[str, Any]) -> str:
    result = record.get("result") or {}
    if not result:
        return "in progress"
    if result.get("ok"):
        flags = short(result.get("flags") or {})
        if reduced_text(record):  # how: the summary's REDUCED row
            return f"REDUCED working configuration after {result.get('launches')} launch(es): {flags}"
        return f"working configuration after {result.get('launches')} launch(es): {flags}"
    return f"exit {result.get('exit_code')}: {result.get('reason')}"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)
