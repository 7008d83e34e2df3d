"""`wait_all`: how node 0 waits for its own processes and the other nodes' (seen through the run folder)."""

from __future__ import annotations

import subprocess
import sys
import time

from polydraft.distill import node_share
from polydraft.distill.node_share import RemoteProcess, exit_file, wait_all


def test_a_local_process_is_waited_on_not_slept_past(monkeypatch):
    """While one of this node's processes runs, `wait_all` waits on it (`Popen.wait`, whose own sleeps are
    at most 50 ms), so that its end is seen at once, never sleeping a whole poll; every look calls
    `each_poll`, the last one included."""
    sleeps, real_sleep = [], time.sleep

    def sleep(seconds):
        sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(node_share.time, "sleep", sleep)  # time.sleep itself, which Popen.wait calls too
    processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"]) for _ in range(2)]
    looks = []
    wait_all(processes, lambda: looks.append([p.returncode for p in processes]))
    assert [p.returncode for p in processes] == [0, 0]
    assert looks[-1] == [0, 0] and len(looks) >= 2
    assert sleeps and max(sleeps) <= 0.05 < node_share.POLL_SECONDS


def test_another_nodes_process_is_polled_until_its_exit_file_appears(tmp_path, monkeypatch):
    """With only other nodes' processes left, `wait_all` sleeps POLL_SECONDS between looks, and ends once
    each one's exit file is there (written here on the second sleep, as the other node would)."""
    remote = RemoteProcess(tmp_path, "part1", node=1, timeout=60)
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            exit_file(tmp_path, "part1").write_text("3")

    monkeypatch.setattr(node_share.time, "sleep", sleep)
    looks = []
    wait_all([remote], lambda: looks.append(remote.returncode))
    assert sleeps == [node_share.POLL_SECONDS] * 2
    assert looks == [None, None, 3] and not remote.lost
