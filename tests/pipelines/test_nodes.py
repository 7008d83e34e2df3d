"""Where a node stands among several: SLURM's variables (its compressed host list), the process count per
node, and the accelerate launch each node runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from polydraft.pipelines.runtime.launch import accelerate_command
from polydraft.pipelines.runtime.nodes import (
    Machines,
    NodeError,
    expand_hostlist,
    processes_per_node,
    slurm_machines,
)


def test_slurm_host_lists_expand_as_slurm_writes_them():
    assert expand_hostlist("gpu[001-003,007],login-1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login-1"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a[1-2]b[8-9]") == ["a1b8", "a1b9", "a2b8", "a2b9"]
    assert expand_hostlist("10.0.0.1,10.0.0.2") == ["10.0.0.1", "10.0.0.2"]


def test_a_slurm_job_of_several_nodes_gives_this_node_and_node_0():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[04-05]"}
    assert slurm_machines(env) == Machines(2, 1, "gpu04", None)
    assert slurm_machines({**env, "MASTER_PORT": "29877"}) == Machines(2, 1, "gpu04", 29877)
    assert slurm_machines({**env, "SLURM_NNODES": "1"}) is None  # one node: nothing to coordinate
    assert slurm_machines({k: v for k, v in env.items() if k != "SLURM_JOB_ID"}) is None
    with pytest.raises(NodeError, match="srun --ntasks-per-node=1"):
        slurm_machines({k: v for k, v in env.items() if k != "SLURM_NODEID"})


def test_each_node_starts_its_share_and_accelerate_gets_the_total(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text("num_machines: 2\nnum_processes: 16\n")
    assert processes_per_node(config, None) == 8  # accelerate's 16 over 2 machines
    assert processes_per_node(config, 4) == 4  # launch.num_processes is per node
    ddp = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / "ddp.yaml"
    assert processes_per_node(ddp, None) == 4
    command = accelerate_command(config, 2 * 8, "m", ["spec"], Machines(2, 1, "gpu04", 29877))
    text = " ".join(command)
    assert "--num_processes 16 --num_machines 2 --machine_rank 1" in text
    assert "--main_process_ip gpu04 --main_process_port 29877" in text
    assert "--main_process_ip" not in " ".join(accelerate_command(config, 16, "m", [], Machines(2, 0)))


def test_each_training_process_gets_its_share_of_the_cores(tmp_path, monkeypatch):
    """accelerate launch would set OMP_NUM_THREADS=1: a process gets the node's cores over its processes
    (at least 1), the cores this job may use (its CPU affinity), not the machine's, and a launched process
    indeed runs that many threads; an OMP_NUM_THREADS the user set is left alone."""
    import os
    import subprocess

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # this job's: SLURM's cpuset
    config = tmp_path / "two.yaml"
    config.write_text("num_machines: 2\nnum_processes: 16\n")
    text = " ".join(accelerate_command(config, 16, "m", [], Machines(2, 1)))
    assert "--num_cpu_threads_per_process 2" in text  # 16 cores, 8 processes on this node
    single = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / "single.yaml"
    assert "--num_cpu_threads_per_process 16" in " ".join(accelerate_command(single, None, "m", []))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "--num_cpu_threads_per_process" not in " ".join(accelerate_command(single, None, "m", []))
    monkeypatch.undo()  # this machine's cores again
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint('threads', torch.get_num_threads())\n")
    command = accelerate_command(single, None, "m", [])
    command = [*command[: command.index("-m", 3)], str(script)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert f"threads {len(os.sched_getaffinity(0))}" in done.stdout, done.stdout


def test_nodes_come_from_slurm_or_from_the_accelerate_config(tmp_path, monkeypatch):
    from polydraft.pipelines.runtime.nodes import this_node
    from polydraft.pipelines.schema import Recipe

    config = tmp_path / "two.yaml"
    config.write_text("num_machines: 2\nmachine_rank: 1\nnum_processes: 16\n")
    recipe = Recipe.model_validate({"target": {"path": "org/m"}, "data": {"pairs": ["de-en"]},
                                    "launch": {"accelerate_config": str(config)}})  # fmt: skip
    for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert this_node(recipe, None) == Machines(2, 1)  # the config's machine_rank, its address
    assert this_node(recipe, 0) == Machines(2, 0)  # --node-rank wins
    with pytest.raises(NodeError, match="node rank 2 is not in 0..1"):
        this_node(recipe, 2)
    slurm = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[1-4]"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert this_node(recipe, None) == Machines(4, 3, "n1", None)  # SLURM's nodes win over the config's


def test_the_collective_timeout_outlasts_what_rank_0_does_alone(tmp_path):
    from polydraft.pipelines.runtime.cluster import COLLECTIVE_TIMEOUT_S, TOKENIZE_BYTES_PER_S
    from polydraft.pipelines.runtime.launch import collective_timeout
    from polydraft.pipelines.schema import LaunchConfig

    mix = tmp_path / "distill" / "mix" / "de-en"
    mix.mkdir(parents=True)
    (mix / "train.jsonl").write_text("{}\n" * 10)
    small, why = collective_timeout(LaunchConfig(), {"distill": tmp_path / "distill"})
    assert small == COLLECTIVE_TIMEOUT_S and why.startswith("at least 30 minutes")
    with open(mix / "train.jsonl", "r+b") as handle:  # a 4 GB mix (sparse: no byte written)
        handle.truncate(4 * 10**9)
    big, why = collective_timeout(LaunchConfig(), {"distill": tmp_path / "distill"})
    assert big == pytest.approx(3 * 4 * 10**9 / TOKENIZE_BYTES_PER_S) and big > COLLECTIVE_TIMEOUT_S
    assert "4000.0 MB mix" in why and why.startswith("3 times the longest step")
    assert collective_timeout(LaunchConfig(collective_timeout_s=7200), {}) == (
        7200.0,
        "launch.collective_timeout_s",
    )
    assert collective_timeout(LaunchConfig(), {})[0] == COLLECTIVE_TIMEOUT_S  # no mix read: pretraining


def test_a_launched_process_s_output_lands_in_its_log_and_its_pipe_is_closed(tmp_path, monkeypatch):
    import gc
    import os
    import sys
    import warnings

    from polydraft.pipelines.runtime.launch import run_logged

    log_path = tmp_path / "stage.log"
    unraisable = []  # a pipe left open warns from its __del__, where an exception can only be reported
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    command = [sys.executable, "-c", "print('line one'); raise SystemExit(3)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        code = run_logged(command, dict(os.environ), log_path, True)
        gc.collect()
    assert code == 3 and log_path.read_text() == "line one\n"
    assert [str(u.exc_value) for u in unraisable] == []
