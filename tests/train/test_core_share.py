"""A training process follows the runner's share of the CPU cores while it runs (`train.runtime.CoreShare`)."""

from __future__ import annotations

import pytest
import torch

from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.train.loop import LoopPlan, TrainingLoop
from polydraft.train.runtime import CORES_FILE_ENV, CoreShare, make_accelerator
from polydraft.train.step import StepLog, StepStats


@pytest.fixture
def threads():
    """torch's thread count, restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_threads_follow_the_file_divided_among_the_processes(tmp_path, threads):
    path = tmp_path / ".cores"
    share = CoreShare(path, processes=2)
    assert share.follow() is None, "no file yet: nothing changes"
    path.write_text("4")
    assert share.follow() == 2 and torch.get_num_threads() == 2, "4 cores for 2 processes"
    assert share.follow() is None, "the same file: nothing to do"
    (tmp_path / "tmp").write_text("2")
    (tmp_path / "tmp").replace(path)
    assert share.follow() == 1 and torch.get_num_threads() == 1
    (tmp_path / "tmp").write_text("3")
    (tmp_path / "tmp").replace(path)
    assert share.follow() is None and torch.get_num_threads() == 1, "3 cores for 2 processes: still 1 each"
    path.write_text("garbage")
    assert share.follow() is None and torch.get_num_threads() == 1
    assert CoreShare(None, 1).follow() is None


def test_the_loop_changes_its_threads_between_steps_when_the_runner_rewrites_the_file(
    tmp_path, threads, monkeypatch
):
    """The runner's rewrite (here by step 3 itself) is in force from the next step on."""
    path = tmp_path / ".cores"
    path.write_text("1")
    monkeypatch.setenv(CORES_FILE_ENV, str(path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    accelerator = make_accelerator(1, "no")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []

    def step(i: int) -> StepStats:
        seen.append(torch.get_num_threads())
        if i == 2:
            tmp = tmp_path / "tmp"
            tmp.write_text("2")
            tmp.replace(path)
        return StepStats(loss=1.0, lr=0.1, grad_norm=0.0, loss_tokens=1, input_tokens=1)

    plan = LoopPlan(total_steps=6, log_every=1, eval_every=0, checkpoint_every=100, keep_checkpoints=1)
    loop = TrainingLoop(
        accelerator, plan, label="t", checkpoints=tmp_path / "ckpt", log_path=tmp_path / "log.jsonl",
        scheduler=scheduler, quiet=True,
    )  # fmt: skip
    steplog = StepLog(
        Tracker(None, "t"), tmp_path / "log.jsonl", prefix="", log_every=1, flops_per_token=0.0,
        peak_flops=None, world=1, main_process=True,
    )  # fmt: skip
    loop.run(step, steplog)
    assert seen == [1, 1, 1, 2, 2, 2]
