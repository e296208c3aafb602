"""One vLLM instance over several nodes: the flags each node's vLLM gets, and what a worker node does
when the leader's launch changes. Pure: plain data in, plain data out.

Two backends (``multinode.backend``):

- ``mp``: vLLM's own multi-node mode (``--nnodes N --node-rank R --master-addr A --master-port P``;
  the nodes other than rank 0 run ``--headless``: no API server, only their share of the workers,
  which meet rank 0's over torch.distributed at ``A:P``). Each headless node builds its engine config
  from its own command line, so it must get the very flags the leader launched with and start again
  whenever the leader launches again: ``r1sup worker`` does that from the leader's ``/status``.
- ``ray``: vLLM's Ray executor; the worker nodes are Ray nodes and the leader's engine places its
  workers on them, with the leader's flags. r1sup passes ``--distributed-executor-backend ray`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r1sup.core.errors import ConfigError

BACKENDS = ("mp", "ray")

# vLLM's arguments that say which node this is and how the nodes meet: r1sup sets them from
# [multinode] when multinode.nnodes > 1 (aliases included: -n and -r are vLLM's short forms).
ROLE_FLAGS = (
    "--nnodes",
    "-n",
    "--node-rank",
    "-r",
    "--master-addr",
    "--master-port",
    "--headless",
    "--distributed-executor-backend",
)

# The leader's states (status.json) in which its vLLM has been started for the launch it names.
LEADER_RUNNING = frozenset({"launching", "probing", "serving", "draining"})


def node_args(section: Any, node_rank: int) -> list[str]:
    """The flags that place one node's vLLM in the group (``section``: a [multinode] section)."""
    if section.nnodes <= 1:
        return []
    if section.backend == "ray":
        return ["--distributed-executor-backend", "ray"]
    argv = [
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        str(section.nnodes),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        section.master_addr,
        "--master-port",
        str(section.master_port),
    ]
    if node_rank > 0:
        argv.append("--headless")
    return argv


def check_leader(section: Any, command: str) -> None:
    """``r1sup run`` and ``tune`` launch the API server: node 0's job."""
    if section.node_rank > 0:
        raise ConfigError(
            "multinode.node_rank",
            f"is {section.node_rank}: `r1sup {command}` is the leader's command (node 0); "
            "the other nodes of the group run `r1sup worker`",
        )


def role_flags_in(args: Sequence[str]) -> list[str]:
    """The node-placement flags among ``args`` (``--nnodes=2`` counts as ``--nnodes``)."""
    return [name for name in (a.split("=", 1)[0] for a in args) if name in ROLE_FLAGS]


@dataclass(frozen=True)
class LeaderLaunch:
    """The leader's current vLLM, as its ``/status`` says: which launch (r1sup's count of the vLLM
    processes it started) and the flags it runs with."""

    run: str  # the leader's r1sup process (its started_at): a restarted leader counts from 1 again
    launches: int
    flags: dict[str, Any]

    @property
    def key(self) -> tuple[str, int]:
        return (self.run, self.launches)


def leader_launch(status: Mapping[str, Any]) -> LeaderLaunch | None:
    """The launch a worker must join, from the leader's ``/status`` document (untrusted: anything
    malformed reads as "nothing to join"); None while the leader runs no vLLM."""
    if status.get("state") not in LEADER_RUNNING or status.get("child_pid") is None:
        return None
    launches, flags = status.get("launches"), status.get("flags")
    if not isinstance(launches, int) or isinstance(launches, bool) or launches < 1:
        return None
    if not isinstance(flags, dict):
        return None
    return LeaderLaunch(str(status.get("started_at") or ""), launches, dict(flags))


@dataclass(frozen=True)
class WorkerAction:
    """What ``r1sup worker`` does after reading the leader: ``stop`` its headless vLLM, then ``start``
    one for ``join`` (either, both or neither)."""

    stop: bool = False
    join: LeaderLaunch | None = None

    @property
    def start(self) -> bool:
        return self.join is not None


def decide(
    leader: LeaderLaunch | None, running: tuple[str, int] | None, joined: tuple[str, int] | None
) -> WorkerAction:
    """``leader``: the leader's launch now (None: none, or unreachable); ``running``: the key of the
    launch this worker's headless vLLM was started for, if it still runs; ``joined``: the key of the
    last launch this worker started one for (running or not).

    A headless vLLM belongs to one launch of the leader: it is stopped when the leader's vLLM is gone
    or is another launch, and a new one starts for each new launch. One that exited on its own is not
    started again for the same launch: a node cannot rejoin a group that is already formed, so the
    leader's vLLM fails too and its next launch is the one to join.
    """
    if leader is None:
        return WorkerAction(stop=running is not None)
    if running is not None and running == leader.key:
        return WorkerAction()
    if joined == leader.key:
        return WorkerAction(stop=running is not None)
    return WorkerAction(stop=running is not None, join=leader)
