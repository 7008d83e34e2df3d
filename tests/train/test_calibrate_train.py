"""Calibration labels, position sampling and the calibrate stage run in process on tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from polydraft.models.calibration import CalibrationModel
from polydraft.models.early_exit import build_early_exit, save_exit_head
from polydraft.pipelines.runtime.contract import StageFailed, spec_for
from polydraft.pipelines.runtime.process import loop_settings, optim_settings
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.stages.calibrate import calibrate
from polydraft.train.calibrate import (
    REPORT_FILE,
    build_labels,
    fit,
    flatten,
    hf_forward,
    label_position,
    sample_positions,
    total_steps,
)
from polydraft.train.loop import TrainJob
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.runtime import make_accelerator
from tests.drafter_setup import context, run_stage, stage_inputs, tiny_recipe, write_tiny_mix
from tests.eesd_setup import save_layered_target

VOCAB = 10


def fake_model(next_token, offset: float, width: int):
    """Logits one-hot on next_token(x) at each position; hidden state = the input token's value + offset."""

    def forward(ids, cache):
        tokens = ids[0].tolist()
        if cache is not None:
            cache.extend(tokens)
        logits = torch.zeros(1, len(tokens), VOCAB)
        for t, x in enumerate(tokens):
            logits[0, t, next_token(x)] = 1.0
        hidden = torch.tensor([[[x + offset] * width for x in tokens]])
        return logits, hidden

    return forward


def test_labels_on_a_constructed_agreement_pattern():
    target = fake_model(lambda x: (x + 1) % VOCAB, 0.0, 3)
    drafter = fake_model(lambda x: 0 if x == 5 else (x + 1) % VOCAB, 100.0, 2)  # wrong after a 5
    got = label_position(target, drafter, list, [1, 2, 3], 5, "cpu")
    assert got["drafts"].tolist() == [4, 5, 0, 1, 2]
    assert got["target_tokens"].tolist() == [4, 5, 6, 1, 2]  # the target's token after prefix + drafts[:i]
    assert got["labels"].tolist() == [1, 1, 0, 0, 0]  # agreement after the first miss still counts 0
    assert got["target_hidden"].tolist() == [2.0, 2.0, 2.0]  # the state that produced the newest token, 3
    assert got["draft_hidden"][:, 0].tolist() == [103.0, 104.0, 105.0, 100.0, 101.0]  # produced draft i
    with pytest.raises(ValueError, match="at least 2 tokens"):
        label_position(target, drafter, list, [1], 2, "cpu")


def test_positions_fall_inside_responses():
    examples = [
        {"input_ids": list(range(10)), "labels": [IGNORE_INDEX] * 6 + [6, 7, 8, 9]},
        {"input_ids": list(range(5)), "labels": [IGNORE_INDEX] * 5},  # no response: never drawn
    ]
    prefixes = sample_positions(examples, 200, seed=3)
    assert {len(p) for p in prefixes} == {6, 7, 8, 9}  # from the prompt's end to the token before the last
    assert prefixes == sample_positions(examples, 200, seed=3)
    with pytest.raises(ValueError, match="no mix row has a response"):
        sample_positions(examples[1:], 1, seed=0)


def test_fit_learns_a_separable_rule(tmp_path):
    torch.manual_seed(0)
    positions, k, d = 64, 4, 8
    draft = torch.randn(positions, k, d)
    labels = {
        "target_hidden": torch.randn(positions, d),
        "draft_hidden": draft,
        "labels": (draft[..., 0] > 0).long(),
    }
    rows = flatten(labels)
    recipe = tiny_recipe(
        tmp_path, calibrate={"optim": {"lr": 0.1}, "loop": {"per_device_batch_size": 64, "epochs": 10.0}}
    )
    loop, accelerator = recipe.calibrate.loop, make_accelerator(1, "no")
    steps = total_steps(
        len(rows["labels"]), loop.per_device_batch_size, accelerator, loop.epochs, loop.max_steps
    )
    assert steps == 40  # 64 positions x 4 draft steps = 256 rows: 4 batches of 64 an epoch, 10 epochs
    job = TrainJob("calibrate t", tmp_path / "m" / "checkpoints", tmp_path / "m" / "train_log.jsonl", Tracker(None, "c"), False)  # fmt: skip
    settings = loop_settings(loop, steps)
    model = fit(accelerator, CalibrationModel(d, d), rows, optim_settings(recipe.calibrate.optim), settings, loop.seed, job)  # fmt: skip
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        total_steps(63, loop.per_device_batch_size, accelerator, loop.epochs, None)
    with torch.no_grad():
        probs = model(rows["steps"], rows["target_hidden"][rows["position"]], rows["draft_hidden"]).softmax(
            -1
        )[:, 1]
    assert ((probs > 0.5).long() == rows["labels"]).float().mean() > 0.95


@pytest.fixture(scope="module")
def layered_dir(tmp_path_factory, tiny_tokenizer):
    return save_layered_target(tmp_path_factory.mktemp("layered"), tiny_tokenizer)


def test_real_drafter_labels_match_uncached_greedy_decoding(layered_dir):
    from transformers import AutoModelForCausalLM

    from polydraft.models.early_exit import from_target

    target = AutoModelForCausalLM.from_pretrained(layered_dir).eval()
    drafter = from_target(target, 2)
    prefix = [1, 40, 41, 42, 43, 44]
    got = label_position(
        hf_forward(target), lambda ids, cache: drafter(ids, cache=cache), drafter.new_cache, prefix, 4, "cpu"
    )
    ids, expected_hidden = list(prefix), []
    with torch.no_grad():
        for _ in range(4):  # no cache: every draft recomputed from scratch
            logits, hidden = drafter(torch.tensor([ids]))
            expected_hidden.append(hidden[0, -1])
            ids.append(int(logits[0, -1].argmax()))
        full = target(torch.tensor([ids])).logits[0].argmax(-1)
    assert got["drafts"].tolist() == ids[len(prefix) :]
    assert torch.allclose(got["draft_hidden"], torch.stack(expected_hidden), atol=1e-5)
    assert got["target_tokens"].tolist() == full[len(prefix) - 1 : -1].tolist()


def test_calibrate_stage_for_the_head_and_a_finetuned_drafter(tmp_path, layered_dir, tiny_tokenizer):
    from polydraft.models.tiny import build_llama

    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=12, eval_rows=6)
    head_stage = tmp_path / "early_exit"
    save_exit_head(build_early_exit(str(layered_dir), 2), head_stage / "head")
    finetune = tmp_path / "finetune"
    narrow = build_llama(
        vocab_size=len(tiny_tokenizer), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    narrow.save_pretrained(finetune / "de-en")
    recipe = tiny_recipe(
        layered_dir,
        calibrate={"drafters": "all", "draft_length": 3, "num_positions": 8, "heldout_fraction": 0.5,
                   "loop": {"per_device_batch_size": 6, "max_steps": 3, "max_length": 100, "checkpoint_every": 2}},
    )  # fmt: skip
    recipe = recipe.model_copy(update={"launch": recipe.launch.model_copy(update={"num_processes": 2})})
    upstream = {"distill": distill, "early_exit": head_stage, "finetune": finetune}
    ctx = context(tmp_path / "run", "calibrate", upstream)
    metrics = run_stage("calibrate", recipe, ctx, layered_dir).metrics  # one process whatever launch says
    assert (metrics["distributed_type"], metrics["num_processes"]) == ("NO", 1)

    for name, width in (("early_exit", 64), ("de-en", 32)):
        report = json.loads((ctx.work_dir / name / REPORT_FILE).read_text())
        assert report["positions"] == {"train": 8, "heldout": 4}
        heldout = report["heldout"]
        assert heldout["count"] == 12 and 0.0 <= heldout["brier"] <= 1.0
        assert metrics["heldout"][name]["base_rate"] == heldout["base_rate"]
        model = CalibrationModel.load(ctx.work_dir / name)
        assert model.step_proj.shape == (10, width, 64)  # W^i maps the target's 64 to the drafter's width
        assert not (ctx.work_dir / name / "labels").exists()
        assert not (ctx.work_dir / name / "checkpoints").exists()
    # a rerun finds every report and does no work
    inputs = stage_inputs("calibrate", recipe, layered_dir)
    again = calibrate(spec_for(inputs, ctx), inputs, make_accelerator(1, "no"), Tracker(None, "calibrate"))
    assert again == {"heldout": metrics["heldout"]}


def test_calibrate_needs_its_upstream_stages(tmp_path, tiny_target_dir):
    recipe = tiny_recipe(tiny_target_dir, calibrate={"drafters": "all"})
    with pytest.raises(StageFailed, match="enable the early_exit stage"):
        run_stage(
            "calibrate", recipe, context(tmp_path / "r", "calibrate", {"distill": tmp_path}), tiny_target_dir
        )
    with pytest.raises(StageFailed, match="needs the finetune stage"):
        ctx = context(tmp_path / "r", "calibrate", {"distill": tmp_path, "early_exit": tmp_path})
        run_stage("calibrate", recipe, ctx, tiny_target_dir)


def test_label_chunks_are_reused_by_a_rerun(tmp_path):
    calls = []

    def label(prefix):
        calls.append(prefix)
        return {"labels": torch.tensor([len(prefix)]), "target_hidden": torch.zeros(2)}

    prefixes = [[1] * n for n in range(2, 2 + 120)]  # 3 chunks of 50, 50, 20
    accelerator = make_accelerator(1, "no")
    first = build_labels(tmp_path, "train", prefixes, label, accelerator)
    assert len(calls) == 120 and sorted(p.name for p in tmp_path.iterdir()) == [
        f"train-0000{i}.pt" for i in range(3)
    ]
    (tmp_path / "train-00001.pt").unlink()  # as if killed while labelling the second chunk
    again = build_labels(tmp_path, "train", prefixes, label, accelerator)
    assert len(calls) == 170  # only the missing chunk was labelled again
    assert torch.equal(first["labels"], again["labels"]) and first["labels"].flatten().tolist() == list(
        range(2, 122)
    )
