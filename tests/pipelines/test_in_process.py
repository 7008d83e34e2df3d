"""`polydraft run --in-process` (and `study --quick`): a one-process training launch runs inside the runner
(`pipelines.runtime.launch.run_in_process`), with the launch's environment meanwhile, its failure reason
left as a subprocess leaves it, accelerate's process state reset for the next stage; anything but one plain
process on one node is refused. The quick study (`tests/pipelines/test_study.py`) trains every stage so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polydraft.pipelines.runtime.contract import TRAINING_ERROR, StageFailed
from polydraft.pipelines.runtime.launch import refuse_in_process, run_in_process
from polydraft.pipelines.runtime.nodes import Machines

ACCELERATE = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"

STAGE_MODULE = """
import os
from pathlib import Path

from accelerate import Accelerator


def main(argv):
    spec = Path(argv[0])
    accelerator = Accelerator(gradient_accumulation_steps=int(os.environ["STEPS"]))
    seen = f"{os.environ['STEPS']} {accelerator.gradient_accumulation_steps} {os.environ['ACCELERATE_USE_CPU']}"
    (spec.parent / "seen.txt").write_text(seen)
    if os.environ.get("FAIL"):
        raise ValueError("the job failed before it wrote a reason")
"""


@pytest.fixture
def stage_module(tmp_path, monkeypatch) -> str:
    folder = tmp_path / "modules"
    folder.mkdir()
    (folder / "fake_stage.py").write_text(STAGE_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return "fake_stage"


def test_one_process_trains_in_this_process_with_the_launch_env_then_state_and_env_are_restored(
    tmp_path, stage_module
):
    from accelerate.state import AcceleratorState, PartialState

    spec = tmp_path / "work" / "spec.json"
    spec.parent.mkdir()
    spec.write_text("{}")
    before = dict(os.environ)
    for steps in ("2", "3"):  # a second stage's Accelerator takes its own settings
        env = {**before, "STEPS": steps, "ACCELERATE_USE_CPU": "true"}
        assert run_in_process(stage_module, spec, env) == 0
        assert (spec.parent / "seen.txt").read_text() == f"{steps} {steps} true"
        assert dict(os.environ) == before
        assert not AcceleratorState._shared_state and not PartialState._shared_state
    assert not (spec.parent / TRAINING_ERROR).exists()


def test_a_failure_leaves_its_reason_like_a_subprocess_and_restores_the_environment(tmp_path, stage_module):
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    before = dict(os.environ)
    env = {**before, "STEPS": "1", "ACCELERATE_USE_CPU": "true", "FAIL": "1"}
    assert run_in_process(stage_module, spec, env) == 1
    reason = (tmp_path / TRAINING_ERROR).read_text()
    assert reason == "ValueError: the job failed before it wrote a reason\n"
    assert dict(os.environ) == before


def test_only_one_plain_process_on_one_node_trains_in_process():
    refuse_in_process(ACCELERATE / "single.yaml", None, None)  # the default launch: no error
    refuse_in_process(ACCELERATE / "ddp.yaml", 1, None)  # a DDP config at one process is one plain process
    two_nodes = Machines(nodes=2, rank=0, main_ip="10.0.0.1", main_port=29500)
    for config, processes, machines, says in [
        ("ddp.yaml", None, None, "4 process(es) a node on 1 node(s)"),
        ("single.yaml", 2, None, "2 process(es) a node"),
        ("single.yaml", 1, two_nodes, "on 2 node(s)"),
        ("deepspeed_zero2.yaml", 1, None, "distributed_type DEEPSPEED"),
        ("fsdp.yaml", 1, None, "distributed_type FSDP"),
    ]:
        with pytest.raises(StageFailed, match="run without --in-process") as err:
            refuse_in_process(ACCELERATE / config, processes, machines)
        assert says in str(err.value), (config, str(err.value))
