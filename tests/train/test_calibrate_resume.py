"""The calibrate stage killed with SIGKILL while it trains and rerun resumes: the same later losses and the
same calibration model, bit for bit, as a run never interrupted, and the steps before the checkpoint are
not trained again (tests/resume_check.py)."""

from __future__ import annotations

from polydraft.models.calibration import WEIGHTS_FILE
from polydraft.models.early_exit import build_early_exit, save_exit_head
from polydraft.train.calibrate import REPORT_FILE
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix
from tests.eesd_setup import save_layered_target
from tests.resume_check import assert_resumed, assert_same_weights, killed_then_resumed

STEPS = 12  # the kill comes right after step 7, two steps past the checkpoint of step 5


def test_killed_calibration_resumes_like_an_uninterrupted_run(tmp_path, tiny_tokenizer):
    target = save_layered_target(tmp_path / "target", tiny_tokenizer)
    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=12, eval_rows=6)
    save_exit_head(build_early_exit(str(target), 2), tmp_path / "early_exit" / "head")
    recipe = tiny_recipe(
        target,
        calibrate={"draft_length": 3, "num_positions": 8, "heldout_fraction": 0.5,
                   "loop": {"per_device_batch_size": 6, "max_steps": STEPS, "max_length": 100, "checkpoint_every": 5}},
    )  # fmt: skip
    upstream = {"distill": distill, "early_exit": tmp_path / "early_exit"}
    whole = context(tmp_path / "whole", "calibrate", upstream)
    run_stage("calibrate", recipe, whole, target)
    ctx = context(tmp_path / "killed", "calibrate", upstream)
    folder = ctx.work_dir / "early_exit"
    step, checkpoint = killed_then_resumed(
        "calibrate",
        recipe,
        ctx,
        target,
        7,
        folder / "checkpoints",
        folder / "train_log.jsonl",
        folder / REPORT_FILE,
    )
    assert 0 < step < STEPS
    reference = whole.work_dir / "early_exit"
    log = ctx.work_dir / "calibrate.log"
    assert_resumed(folder / "train_log.jsonl", log, checkpoint, step, reference / "train_log.jsonl")
    assert_same_weights(folder / WEIGHTS_FILE, reference / WEIGHTS_FILE)
