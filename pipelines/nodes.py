"""Several nodes: node 0 runs the pipeline, every other node follows it and joins its training launches.

When the recipe's accelerate config names `num_machines` > 1, `polydraft run` runs on every node with the
same recipe and run directory, and `--node-rank R` (default: the config's `machine_rank`). Node 0 runs
the pipeline as on one node: the stages that do not train (distill, measure, export, ...) run there
only, and each training launch is announced in `<run_dir>/nodes/leader.json`. Every other node starts
the same `accelerate launch` with its own machine rank, so the training processes of all nodes meet at
the config's `main_process_ip:main_process_port`, and waits for the next announcement.

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
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

NODES_DIR = "nodes"
LEADER_FILE = "leader.json"
POLL_SECONDS = 0.5


class NodeError(RuntimeError):
    """Nodes that cannot work together: not seen, not answering, or node 0 failed."""


def machines_of(config_file: Path) -> tuple[int, int]:
    """(num_machines, machine_rank) of an accelerate config file."""
    config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    return int(config.get("num_machines", 1)), int(config.get("machine_rank", 0))


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
    """Node 0's side: acknowledges the other nodes, keeps a heartbeat, announces training launches."""

    def __init__(self, run_dir: Path, nodes: int):
        self.dir = Path(run_dir) / NODES_DIR
        self.nodes = nodes
        self.state: dict[str, Any] = {
            "launch_id": uuid.uuid4().hex, "nodes": nodes, "host": socket.gethostname(), "pid": os.getpid(),
            "heartbeat": 0, "joined": {}, "events": [],
        }  # fmt: skip
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="polydraft-node-leader", daemon=True)

    def start(self, timeout: float) -> None:
        """Publish leader.json (old node files are removed: a live node writes its own again) and wait
        until every other node has joined."""
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
        """An event the other nodes act on: `launch` (join this accelerate launch), `finished`, `failed`."""
        with self._lock:
            self.state["events"].append(event)
        self._publish()

    def stop(self, error: str | None = None) -> None:
        """Tell the other nodes that the run finished (or failed with `error`), then stop the heartbeat."""
        self.announce({"kind": "failed", "error": error} if error else {"kind": "finished"})
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def follow(run_dir: Path, rank: int, timeout: float, launch: Callable[[dict[str, Any]], None]) -> int:
    """Another node's side: join node 0, then run `launch(event)` for each training launch it announces,
    in order, until it finishes. Returns the number of launches joined."""
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
            log.info("nodes: joining %s (launch %d)", event["stage"], launches + 1)
            launch(event)
            launches += 1
            beat_seen = time.monotonic()
        if time.monotonic() - beat_seen > timeout:
            raise NodeError(f"node 0 stopped answering: its heartbeat in {directory / LEADER_FILE} stood "
                            f"still for {timeout:.0f} s")  # fmt: skip
        time.sleep(POLL_SECONDS)
