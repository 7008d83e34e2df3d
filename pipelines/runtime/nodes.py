"""Several nodes: node 0 runs the pipeline, every other node follows it and joins the work it spreads.

When the recipe's accelerate config names `num_machines` > 1, or a SLURM job holds several nodes
(`slurm_machines`: their count, this node's rank and node 0's address come from SLURM's variables),
`polydraft run` runs on every node with the same recipe and run directory, and `--node-rank R` (default: the
config's `machine_rank`, or `SLURM_NODEID`). Every node starts `launch.num_processes` training processes (a
count per node: accelerate's own `--num_processes` is the total, which polydraft passes as nodes x that). Node 0 runs
the pipeline as on one node. Besides the training stages, distillation's vLLM engines
(`distill/engines.py`) and the measure stage's processes (`pipelines/stages/measure.py`) use every node:
as many on each node as on node 0, which watches the other nodes' ones through the run directory
(`distill/node_share.py`); the rest (the export, distillation's other backends, ...) runs on node 0 only.
Each training launch, engine start and measure start is announced in `<run_dir>/nodes/leader.json`. For a
training launch every other node starts the same `accelerate launch` with its own machine rank, so the
training processes of all nodes meet at the config's `main_process_ip:main_process_port`; for engines or
measure it starts its share of the processes; then it waits for the next announcement.

The run directory must be one folder every node sees (a shared filesystem: NFS, Lustre, ...): the
training processes of every node read the specs, data and checkpoints node 0 writes there, and the nodes
find each other through it. At start each other node writes `nodes/node-R.json` and waits until node 0
acknowledges it in leader.json; node 0 waits until every node has joined. Either side stops with an error
that says so when the other is not seen within `--node-timeout` seconds: the run directory is then not
shared, or the other node's `polydraft run` is not running. A node that follows also stops when node 0's
heartbeat (rewritten every second) stands still for that long.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polydraft.pipelines.schema.common import AccelerateFile

if TYPE_CHECKING:
    from polydraft.pipelines.schema import Recipe

log = logging.getLogger(__name__)

NODES_DIR = "nodes"
LEADER_FILE = "leader.json"
POLL_SECONDS = 0.5


class NodeError(RuntimeError):
    """Nodes that cannot work together: not seen, not answering, or node 0 failed."""


def machines_of(config_file: Path) -> tuple[int, int]:
    """(num_machines, machine_rank) of an accelerate config file."""
    config = AccelerateFile.read(config_file)
    return config.num_machines, config.machine_rank


@dataclass(frozen=True)
class Machines:
    """Where this node stands among the run's nodes, and where node 0 listens."""

    nodes: int
    rank: int
    main_ip: str | None = None
    """Node 0's address; None: the accelerate config's `main_process_ip`."""
    main_port: int | None = None
    """None: the accelerate config's `main_process_port`."""


DEFAULT_PORT = 29500
"""accelerate's and torchrun's default rendezvous port."""


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list (`gpu[001-003,007],login-1`) as host names, in order."""
    hosts, part, depth = [], "", 0
    for char in text + ",":
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            if part:
                hosts.extend(_expand_one(part))
            part = ""
        else:
            part += char
    return hosts


def _expand_one(part: str) -> list[str]:
    if "[" not in part:
        return [part]
    prefix, rest = part.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    out = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        width = len(low)  # zero padding, as SLURM writes it (gpu[001-003])
        for number in range(int(low), int(high or low) + 1):
            out.extend(f"{prefix}{number:0{width}d}{tail}" for tail in _expand_one(suffix) or [""])
    return out


def slurm_machines(env: dict[str, str]) -> Machines | None:
    """This node within a SLURM allocation of several nodes (`SLURM_NNODES`, `SLURM_NODEID`, node 0 the
    first host of `SLURM_JOB_NODELIST`, the port `MASTER_PORT` if set), or None outside one."""
    nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    if "SLURM_JOB_ID" not in env or nodes < 2:
        return None
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if not hosts or "SLURM_NODEID" not in env:
        raise NodeError(
            "a SLURM job of several nodes without SLURM_NODEID or SLURM_JOB_NODELIST: start one "
            "`polydraft run` per node with `srun --ntasks-per-node=1`"
        )
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    return Machines(nodes, int(env["SLURM_NODEID"]), hosts[0], port)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what a SLURM allocation or a container's
    cpuset leaves it), not the machine's count that `os.cpu_count()` gives."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def processes_per_node(config_file: Path, recipe_count: int | None) -> int:
    """Training processes on each node: `launch.num_processes`, else the accelerate config's
    `num_processes` (accelerate's total over its `num_machines`) divided by its `num_machines`."""
    if recipe_count is not None:
        return recipe_count
    config = AccelerateFile.read(config_file)
    return max(1, config.num_processes // max(1, config.num_machines))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _not_shared(run_dir: Path, waited: float, what: str) -> str:
    return (
        f"{what} within {waited:.0f} s in {run_dir / NODES_DIR}. Several nodes need the run directory on a "
        "filesystem they all share (NFS, Lustre, ...), the same --run-dir on every node, and "
        "`polydraft run RECIPE --node-rank R` running on each node (R = 0 on the main one)"
    )


class NodeLeader:
    """Node 0's side: acknowledges the other nodes, keeps a heartbeat, announces the work they join."""

    def __init__(self, run_dir: Path, machines: Machines):
        self.dir = Path(run_dir) / NODES_DIR
        self.machines = machines
        nodes = self.nodes = machines.nodes
        self.state: dict[str, Any] = {
            "launch_id": uuid.uuid4().hex, "nodes": nodes, "host": socket.gethostname(), "pid": os.getpid(),
            "heartbeat": 0, "joined": {}, "events": [],
        }  # fmt: skip
        self.timeout = 600.0
        """Seconds without a sign of a node before it counts as lost (`--node-timeout`)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="polydraft-node-leader", daemon=True)

    def start(self, timeout: float) -> None:
        """Publish leader.json (old node files are removed: a live node writes its own again) and wait
        until every other node has joined."""
        self.timeout = timeout
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("node-*.json"):
            old.unlink(missing_ok=True)
        self._publish()
        self._thread.start()
        started = time.monotonic()
        while len(self.state["joined"]) < self.nodes - 1:
            if time.monotonic() - started > timeout:
                absent = [r for r in range(1, self.nodes) if str(r) not in self.state["joined"]]
                error = _not_shared(self.dir.parent, timeout, f"node(s) {absent} did not join")
                self.stop(error)
                raise NodeError(error)
            time.sleep(POLL_SECONDS)
        log.info("nodes: %d nodes joined (%s)", self.nodes, self.state["joined"])

    def _publish(self) -> None:
        with self._lock:
            _write_json(self.dir / LEADER_FILE, self.state)

    def _beat(self) -> None:
        while not self._stop.wait(1.0 if self.state["events"] else POLL_SECONDS):
            cards = [card for path in self.dir.glob("node-*.json") if (card := _read_json(path)) is not None]
            with self._lock:  # the main thread publishes the same state when it announces
                self.state["joined"].update({str(card["rank"]): card["nonce"] for card in cards})
                self.state["heartbeat"] += 1
            self._publish()

    def announce(self, event: dict[str, Any]) -> None:
        """An event the other nodes act on: `launch` (join this accelerate launch), `engines` (start your
        share of the distillation engines, `distill/engines.py`), `measure` (start your share of the measure
        processes, `pipelines/stages/measure.py`), `finished`, `failed`."""
        with self._lock:
            self.state["events"].append(event)
        self._publish()

    def stop(self, error: str | None = None) -> None:
        """Tell the other nodes that the run finished (or failed with `error`), then stop the heartbeat."""
        self.announce({"kind": "failed", "error": error} if error else {"kind": "finished"})
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _gone(directory: Path, seen: int, launch_id: str, timeout: float) -> Callable[[], str | None]:
    """Why node 0 no longer waits for the work of its `seen`-th event (None while it does): a later event
    (it finished or failed), another run, or a heartbeat standing still for `timeout` seconds."""
    beat: list[Any] = [None, time.monotonic()]

    def gone() -> str | None:
        leader = _read_json(directory / LEADER_FILE)
        if leader is None:
            return None
        if leader["launch_id"] != launch_id or len(leader["events"]) > seen:
            return "node 0 moved on (it finished, failed or started another run)"
        if leader["heartbeat"] != beat[0]:
            beat[:] = [leader["heartbeat"], time.monotonic()]
        if time.monotonic() - beat[1] > timeout:
            return f"node 0's heartbeat stood still for {timeout:.0f} s"
        return None

    return gone


def follow(
    run_dir: Path,
    rank: int,
    timeout: float,
    launch: Callable[[dict[str, Any], Callable[[], str | None]], None],
) -> int:
    """Another node's side: join node 0, then run `launch(event, gone)` for each launch it announces (a
    training launch, distillation engines or measure processes), in order, until it finishes; `gone()`
    says why node 0 no longer waits for that launch (None while it does). Returns the number of launches
    joined."""
    directory = Path(run_dir) / NODES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    mine = directory / f"node-{rank}.json"
    nonce = uuid.uuid4().hex
    card = {"rank": rank, "nonce": nonce, "host": socket.gethostname(), "pid": os.getpid()}
    started = time.monotonic()
    while True:  # join: rewrite our card until node 0 acknowledges it
        if not mine.exists():
            _write_json(mine, card)
        leader = _read_json(directory / LEADER_FILE)
        if leader is not None and leader["joined"].get(str(rank)) == nonce:
            break
        if time.monotonic() - started > timeout:
            raise NodeError(_not_shared(Path(run_dir), timeout, "node 0 did not acknowledge this node"))
        time.sleep(POLL_SECONDS)
    log.info("nodes: node %d joined node 0 (%s, pid %s)", rank, leader["host"], leader["pid"])
    launch_id, seen, launches = leader["launch_id"], 0, 0
    beat, beat_seen = leader["heartbeat"], time.monotonic()
    while True:
        leader = _read_json(directory / LEADER_FILE) or leader
        if leader["launch_id"] != launch_id:
            raise NodeError("node 0 started another run in this run directory; start this node again")
        if leader["heartbeat"] != beat:
            beat, beat_seen = leader["heartbeat"], time.monotonic()
        for event in leader["events"][seen:]:
            seen += 1
            if event["kind"] == "finished":
                return launches
            if event["kind"] == "failed":
                raise NodeError(f"node 0 failed: {event['error']}")
            log.info("nodes: joining %s (launch %d)", event.get("stage", event["kind"]), launches + 1)
            launch(event, _gone(directory, seen, launch_id, timeout))
            launches += 1
            beat_seen = time.monotonic()
        if time.monotonic() - beat_seen > timeout:
            raise NodeError(f"node 0 stopped answering: its heartbeat in {directory / LEADER_FILE} stood "
                            f"still for {timeout:.0f} s")  # fmt: skip
        time.sleep(POLL_SECONDS)


def this_node(recipe: Recipe, flag: int | None) -> Machines:
    """This node among the run's nodes: a SLURM job's (`nodes.slurm_machines`), else the accelerate
    config's num_machines; the rank --node-rank (`flag`), else SLURM_NODEID or the config's machine_rank.
    NodeError for a rank or a config that does not make sense."""
    from polydraft.pipelines.runtime.launch import resolve_accelerate_config

    slurm = slurm_machines(dict(os.environ))
    if slurm is not None:
        nodes, rank, where = slurm.nodes, slurm.rank, f"SLURM_NNODES {slurm.nodes}"
    else:
        nodes, rank = machines_of(resolve_accelerate_config(recipe.launch.accelerate_config))
        where = f"num_machines {nodes} in the accelerate config"
        if flag is not None and nodes == 1:
            raise NodeError(
                f"--node-rank {flag}: launch.accelerate_config {recipe.launch.accelerate_config} has num_machines "
                "1; several nodes need a config with num_machines > 1 (see recipes/accelerate/multinode.yaml) "
                "or a SLURM job of several nodes"
            )
    rank = rank if flag is None else flag
    if not 0 <= rank < nodes:
        raise NodeError(f"node rank {rank} is not in 0..{nodes - 1} ({where})")
    if slurm is not None:
        return Machines(nodes, rank, slurm.main_ip, slurm.main_port)
    return Machines(nodes, rank)
