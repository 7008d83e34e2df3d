"""Several nodes on one machine: two `polydraft run` processes, node ranks 0 and 1 of a SLURM job (its
variables set as `srun` sets them, node 0 on the loopback), whose training launches meet through
accelerate's multi-machine launch (gloo, `launch.num_processes: 1` per node: two ranks in all), train
exactly like one node with two processes; a node that does not see the other stops with an error that
says why; the nodes and ranks come from an accelerate config as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from polydraft.pipelines.cli.main import main
from polydraft.train.steplog import read_log
from tests.distill_setup import free_port
from tests.pipelines.test_pipeline_e2e import RECIPE
from tests.vllm_setup import PROJECT_ROOT

MULTINODE = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 2
num_processes: 2
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {port}
gpu_ids: all
mixed_precision: "no"
rdzv_backend: static
same_network: true
"""


def _recipe(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE.format(cache=tmp_path / "cache"))
    return recipe


def _node(recipe, run_dir, config, rank: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "polydraft.pipelines.cli.main", "run", str(recipe), "--only", "pretrain",
               f"launch.accelerate_config={config}", "--run-dir", str(run_dir), "--node-rank", str(rank),
               "--quiet", *extra]  # fmt: skip
    return subprocess.Popen(
        command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _slurm_node(recipe, run_dir, rank: int, port: int) -> subprocess.Popen:
    """`srun --ntasks-per-node=1 polydraft run ...` on node `rank` of a two-node job: no --node-rank, no
    multi-node config, one training process per node."""
    command = [sys.executable, "-m", "polydraft.pipelines.cli.main", "run", str(recipe), "--only", "pretrain",
               "launch.accelerate_config=recipes/accelerate/ddp.yaml", "launch.num_processes=1",
               "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(rank),
             "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    return subprocess.Popen(
        command, cwd=PROJECT_ROOT, env={**os.environ, **slurm}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_two_slurm_nodes_train_like_one_node_with_two_processes(tmp_path):
    recipe = _recipe(tmp_path)
    # the target is bootstrapped once, before the nodes start (each node would otherwise wait on it)
    assert main(["bootstrap", str(recipe), "--quiet"]) == 0
    nodes_dir, port = tmp_path / "nodes-run", free_port()
    follower = _slurm_node(recipe, nodes_dir, 1, port)  # the other node may start first
    leader = _slurm_node(recipe, nodes_dir, 0, port)
    leader_out, _ = leader.communicate(timeout=540)
    follower_out, _ = follower.communicate(timeout=60)
    assert leader.returncode == 0, leader_out
    assert follower.returncode == 0, follower_out
    assert "node 1 of 2: joined 1 launch(es)" in follower_out
    assert (nodes_dir / "nodes" / "node-1-pretrain.log").stat().st_size > 0  # node 1's own process ran
    # two ranks in all (world size 2), one per node: node 0's process is rank 0, node 1's rank 1
    ranks = sorted(p.name for p in (nodes_dir / "pretrain").rglob("random_states_*.pkl"))
    assert ranks == ["random_states_0.pkl", "random_states_1.pkl"], ranks

    one_dir = tmp_path / "one-node"
    overrides = ["launch.accelerate_config=recipes/accelerate/ddp.yaml", "launch.num_processes=2"]
    assert (
        main(["run", str(recipe), *overrides, "--only", "pretrain", "--run-dir", str(one_dir), "--quiet"])
        == 0
    )

    two = json.loads((nodes_dir / "pretrain" / "manifest.json").read_text())["metrics"]
    one = json.loads((one_dir / "pretrain" / "manifest.json").read_text())["metrics"]
    assert (two["distributed_type"], two["num_processes"]) == (one["distributed_type"], 2) == ("MULTI_CPU", 2)
    one_log = read_log(one_dir / "pretrain" / "model.train_log.jsonl")
    two_log = read_log(nodes_dir / "pretrain" / "model.train_log.jsonl")
    assert len(one_log) == len(two_log) == 2
    for a, b in zip(one_log, two_log, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["tokens"] == a["tokens"]
    one_weights = load_file(one_dir / "pretrain" / "model" / "model.safetensors")
    two_weights = load_file(nodes_dir / "pretrain" / "model" / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    for key, value in one_weights.items():
        torch.testing.assert_close(two_weights[key], value, rtol=1e-6, atol=1e-7)


def test_a_node_that_does_not_see_node_0_says_the_run_directory_must_be_shared(tmp_path):
    recipe = _recipe(tmp_path)
    config = tmp_path / "multinode.yaml"
    config.write_text(MULTINODE.format(port=free_port()))
    follower = _node(recipe, tmp_path / "run", config, 1, "--node-timeout", "1")
    out, _ = follower.communicate(timeout=120)
    assert follower.returncode != 0
    assert "node 0 did not acknowledge this node within 1 s" in out
    assert "filesystem they all share" in out


def test_node_0_alone_says_which_node_did_not_join(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    config = tmp_path / "multinode.yaml"
    config.write_text(MULTINODE.format(port=free_port()))
    code = main(["run", str(recipe), f"launch.accelerate_config={config}", "--run-dir", str(tmp_path / "run"),
                 "--node-rank", "0", "--node-timeout", "1", "--quiet"])  # fmt: skip
    assert code == 2
    assert "node(s) [1] did not join within 1 s" in capsys.readouterr().err


def test_a_node_rank_needs_a_multi_machine_config(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert main(["run", str(recipe), "--node-rank", "1", "--run-dir", str(tmp_path / "run"), "--quiet"]) == 2
    assert "has num_machines 1" in capsys.readouterr().err
