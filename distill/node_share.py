"""A stage's processes spread over several nodes, watched through the shared run directory.

Node 0 (`pipelines/runtime/nodes.py`) starts its own processes, then announces the others (`remote_processes`
first removes what an earlier run left of theirs); each other node starts its share on its own GPUs and
runs `watch_share`: while they run it rewrites `node-R.alive` every second and writes each process's exit
status to `<name>.exit` as it ends. Node 0 sees each of them as a `RemoteProcess`, ended when its exit
file appears, lost when its node's heartbeat stands still for the node timeout, and `wait_all` waits for
its own and the others' processes alike. A node stops its processes as soon as node 0 no longer waits for
them (`gone()`). Every process leads a process group of its own (`start_new_session=True`), which
`stop_group` stops whole.

Distillation's vLLM engines (`distill/engines.py`, files in `<work_dir>/engines/`) and the measure stage's
processes (`pipelines/stages/measure.py`, files in its work folder) use it, each with the names of its own
files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader sees all of it or none."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def exit_file(folder: Path, name: str) -> Path:
    """Where another node writes the exit status of its process `name`."""
    return folder / f"{name}.exit"


def alive_file(folder: Path, node: int) -> Path:
    """The heartbeat node `node` rewrites while its processes run."""
    return folder / f"node-{node}.alive"


def stop_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop a process and every process of its group (what it spawned): SIGTERM, SIGKILL after `grace` s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


class RemoteProcess:
    """A process another node runs, seen from node 0: ended when its `<name>.exit` appears (`returncode`
    the status written there); lost (`poll()` -1, `lost` set) when its node's `node-R.alive` stands still
    for `timeout` seconds."""

    def __init__(self, folder: Path, name: str, node: int, timeout: float):
        self.exit = exit_file(folder, name)
        self.alive = alive_file(folder, node)
        self.node, self.timeout = node, timeout
        self.pid = f"node {node}"
        """Where it runs, for messages that name a local process by its pid."""
        self.returncode: int | None = None
        self.lost = False
        self.beat: str | None = None
        self.seen = time.monotonic()

    def poll(self) -> int | None:
        """The exit status once it ended (-1 once lost), else None."""
        if self.exit.exists():
            self.returncode = int(self.exit.read_text() or 1)
            return self.returncode
        beat = self.alive.read_text() if self.alive.exists() else None
        if beat != self.beat:
            self.beat, self.seen = beat, time.monotonic()
        self.lost = time.monotonic() - self.seen > self.timeout
        return -1 if self.lost else None

    def lost_why(self) -> str:
        """Why a lost process counts as lost, and what to check."""
        return (
            f"the node stopped answering (its heartbeat {self.alive} stood still for {self.timeout:.0f} s); "
            "is its `polydraft run` still running?"
        )


def clear_share(folder: Path, names: list[str], per_node: int) -> None:
    """Remove the exit files of `names[per_node:]`, the processes the other nodes run (`per_node` each),
    and those nodes' heartbeats: what an earlier run left before node 0 announces them, or what this run
    left once node 0 waited for them all."""
    for node in range(1, len(names) // per_node):
        alive_file(folder, node).unlink(missing_ok=True)
    for name in names[per_node:]:
        exit_file(folder, name).unlink(missing_ok=True)


def remote_processes(folder: Path, names: list[str], per_node: int, timeout: float) -> list[RemoteProcess]:
    """The processes `names[per_node:]`, which the other nodes run (`per_node` each, node 1's first), as
    node 0 sees them; what an earlier run left of them is removed first (`clear_share`), so call it before
    announcing them."""
    clear_share(folder, names, per_node)
    return [RemoteProcess(folder, names[i], i // per_node, timeout) for i in range(per_node, len(names))]


def wait_all(processes: list[subprocess.Popen | RemoteProcess], each_poll: Callable[[], None]) -> None:
    """Poll every process, this node's and the other nodes', every POLL_SECONDS until all have ended (or
    are lost), calling `each_poll()` after each look (the last one included). Between looks it waits on
    this node's first running process, so that its end is seen at once, not up to POLL_SECONDS later."""
    while True:
        running = [process.poll() is None for process in processes]
        each_poll()
        if not any(running):
            return
        local = [p for p, alive in zip(processes, running) if alive and isinstance(p, subprocess.Popen)]
        if not local:
            time.sleep(POLL_SECONDS)
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            local[0].wait(timeout=POLL_SECONDS)


@contextlib.contextmanager
def stopped_on_error(processes: list[subprocess.Popen | RemoteProcess]) -> Iterator[None]:
    """A block that starts, announces and waits for `processes` (a list it may still add to): whatever
    leaves it with an exception (Ctrl-C, an error) stops this node's processes first, their groups whole."""
    try:
        yield
    except BaseException:
        for process in processes:
            if isinstance(process, subprocess.Popen):
                stop_group(process)
        raise


def fail_share(folder: Path, names: list[str]) -> None:
    """A node that cannot start its share: exit status 1 for each of `names`, so node 0 stops waiting."""
    for name in names:
        write_atomic(exit_file(folder, name), "1")


def watch_share(
    folder: Path, rank: int, processes: list[tuple[str, subprocess.Popen]], gone: Callable[[], str | None]
) -> None:
    """Node `rank`'s side, once it started its share (`(name, process)` each): rewrite `node-R.alive`
    while they run and each one's exit status to `<name>.exit` as it ends; return when all have ended, or
    stop them and return as soon as `gone()` says why node 0 no longer waits for them. Whatever ends this
    call stops those still running."""
    alive, beat = alive_file(folder, rank), 0
    written = [False] * len(processes)
    try:
        while not all(written):
            beat += 1
            write_atomic(alive, str(beat))
            for k, (name, process) in enumerate(processes):
                if not written[k] and process.poll() is not None:
                    write_atomic(exit_file(folder, name), str(process.returncode))
                    written[k] = True
            if not all(written) and (why := gone()) is not None:
                log.warning("node %d stops %s: %s", rank, ", ".join(name for name, _ in processes), why)
                return
            time.sleep(POLL_SECONDS)
    finally:
        for _, process in processes:
            if process.poll() is None:
                stop_group(process)
