"""``tune``'s report, ``r1sup report`` and its HTML page, the page checked in a real headless browser.

The run record comes from a real ``r1sup tune`` on the fake GPU engine: the first launch runs out of
memory loading the weights, the second (fp8 weights) passes the probe. The page is opened in Chromium
(the Debian package; ``.ci/run`` installs it): the DOM it builds is read back with ``--dump-dom`` and a
screenshot is checked for its parts by their colours and places.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import memchart
from r1sup_proc import ROOT, kill_engine_processes, write_config
from test_tune_fake import fake_body, fake_env, fake_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("report")
    body = fake_body(tmp, search={"allow_weight_quantization": True})
    config = write_config(tmp / "r1sup.toml", body)
    env = fake_env(fake_scenario(tmp))
    try:
        done = cli("tune", "--config", str(config), env=env)
    finally:
        kill_engine_processes(config)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"tmp": tmp, "config": config, "state": tmp / "state", "stdout": done.stdout, "env": env}


def test_tune_prints_what_report_prints_later(tuned: dict[str, Any]) -> None:
    out = tuned["stdout"]
    assert "attempt 1  FAILED  oom_weights in load_weights" in out
    # the step names the lever and the evidence behind it (the weights that did not load)
    step = next(line for line in out.splitlines() if line.startswith("  next    "))
    assert "quantization default -> fp8" in step and "GiB of weights per GPU do not load" in step, step
    assert "  why     attempt 1 failed (oom_weights): " in out
    assert "memory of attempt 2, GiB per device:" in out
    assert "predicted |W" in out and "measured  |W" in out
    assert "loading weights" in out and "load probe" in out  # the phases and how long each took
    # what the probe proved, and the same in the profile saved
    # (the concurrency wave's ordinary requests first when more of them were seen running together)
    assert re.search(
        r"^capacity: measured: \d+ request\(s\) at once of ~[\d,]+ (prompt )?tokens \([\d.]+ output tok/s, "
        r"TTFT p50 [\d.]+s p95 [\d.]+s\)(, 1 at once of ~[\d,]+ tokens)?; computed: context \d[\d,]* tokens, "
        r"[\d.]+ such requests fit vLLM's [\d,]+-token KV cache",
        out,
        re.M,
    )
    (saved,) = (tuned["state"] / "profiles").glob("*.json")
    capacity = json.loads(saved.read_text())["capacity"]
    assert capacity["context_requests"] == 1 and capacity["asked_requests"] == 1
    assert capacity["requests"] >= 1 and capacity["context_tokens"] >= 2048
    again = cli("report", "--config", str(tuned["config"]))
    assert again.returncode == 0, again.stderr
    assert again.stdout == out


def test_report_json_and_list(tuned: dict[str, Any]) -> None:
    listed = cli("report", "--state-dir", str(tuned["state"]), "--list")
    assert listed.returncode == 0 and " 2 attempt(s)  ok" in listed.stdout
    data = json.loads(cli("report", "--state-dir", str(tuned["state"]), "--json").stdout)["record"]
    assert [a["outcome"] for a in data["attempts"]] == ["failed", "ok"]
    second = data["attempts"][1]
    charts = second["memory"]
    assert len(charts) == 1 and charts[0]["predicted"]["weights_gib"] > 0
    assert charts[0]["measured"]["weights_gib"] == pytest.approx(
        charts[0]["predicted"]["weights_gib"], rel=0.2
    )
    assert set(second["phase_seconds"]) >= {"starting", "weights", "probe"}
    assert data["result"]["ok"] and data["result"]["profile_path"]
    probe = data["result"]["probe"]  # output_tokens per request, as the config's probe.output_tokens
    assert probe["output_tokens"] == 8 and probe["output_tokens_total"] == 8 * probe["succeeded"]


def test_report_errors_name_what_is_wrong(tuned: dict[str, Any], tmp_path: Path) -> None:
    none = cli("report", "--state-dir", str(tmp_path))
    assert none.returncode == 2 and none.stderr.count("\n") == 1 and "no run records" in none.stderr
    bad = cli("report", "--state-dir", str(tuned["state"]), "--run", "1999")
    assert bad.returncode == 2 and "--run: no run match '1999'" in bad.stderr
    unwritable = cli("report", "--state-dir", str(tuned["state"]), "--html", str(tmp_path / "no" / "x.html"))
    assert unwritable.returncode == 1 and "cannot write" in unwritable.stderr


class _Dom(HTMLParser):
    """What the browser built: ids, classes per tag, texts."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id"):
            self.ids.append(str(a["id"]))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(
            1 for t, a in self.tags if t == tag and (cls is None or cls in (a.get("class") or "").split())
        )


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def browse(binary: str, page: Path, *args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}",
            *args,
            page.as_uri(),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_html_report_in_a_real_browser(tuned: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = cli("report", "--state-dir", str(tuned["state"]), "--html", str(page))
    assert done.returncode == 0 and done.stdout.startswith(f"wrote {page}"), done.stderr
    text = page.read_text(encoding="utf-8")
    # self-contained: no scripts, no stylesheets, images or fonts from anywhere
    for needle in ("<script", "<link", "<img", "@import", "url(http", "src="):
        assert needle not in text, needle

    binary = chromium()
    if binary is None:
        if os.environ.get("R1SUP_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium is required here (R1SUP_REQUIRE_BROWSER=1) but not installed")
        pytest.skip("Chromium is not installed (apt-get install chromium); the page was checked as text only")

    dom_run = browse(binary, page, "--dump-dom", tmp=tmp_path)
    assert dom_run.returncode == 0, dom_run.stderr[-2000:]
    dom = _Dom()
    dom.feed(dom_run.stdout)
    assert {"verdict", "summary", "attempts", "attempt-1", "attempt-2", "result"} <= set(dom.ids)
    assert dom.count("tr", "attempt-row") == 2
    assert dom.count("section", "attempt") == 2 and dom.count("section", "ok") == 1
    assert dom.count("svg", "memchart") == 2  # one chart per attempt (one GPU)
    assert dom.count("rect", "seg-weights") == 3  # predicted for both attempts, measured for the second
    assert dom.count("rect", "over") == 1  # attempt 1's bf16 weights are drawn past the device's edge
    words = " ".join(dom.text)
    assert "quantization default -> fp8" in words and "probe passed" in words

    shot = tmp_path / "report.png"
    shot_run = browse(binary, page, f"--screenshot={shot}", "--window-size=1200,2400", tmp=tmp_path)
    assert shot_run.returncode == 0 and shot.is_file(), shot_run.stderr[-2000:]
    keep = os.environ.get("R1SUP_KEEP_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    width, height = image.size
    pixels = image.load()

    def where(hex_colour: str) -> list[tuple[int, int]]:
        rgb = tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
        return [(x, y) for y in range(0, height, 2) for x in range(0, width, 2) if pixels[x, y] == rgb]

    banner = where("#2e7d32")  # the green verdict banner (and the passed attempt's border)
    assert banner and min(y for _, y in banner) < 150, "no verdict banner at the top"
    weights, kv = where(memchart.COLORS["weights"]), where(memchart.COLORS["kv"])
    failed = where("#c62828")  # the failed attempt's border and its over-the-edge outline
    assert len(weights) > 2000 and len(kv) > 300, (len(weights), len(kv))
    assert failed, "no failed attempt drawn"
    # the charts sit below the attempts table, the failed attempt above the passed one
    assert min(y for _, y in weights) > min(y for _, y in banner) + 200
    assert min(y for _, y in failed) < max(y for _, y in kv)
