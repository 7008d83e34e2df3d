"""The heads trainer: the labels each head learns, what trains and what stays frozen, and resume after kill -9."""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from polydraft.models.heads import load_heads, load_vllm_medusa, read_heads_config
from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.runtime.contract import PROJECT_ROOT, StageSpec, spec_for
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.stages.heads import train_heads
from polydraft.train.heads import HEADS_DIR, LOG_FILE, head_labels
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.runtime import make_accelerator
from tests.drafter_setup import context, stage_inputs, tiny_recipe, write_tiny_mix
from tests.resume_check import run_killed_at

X = IGNORE_INDEX


def test_head_i_learns_the_token_two_plus_i_ahead():
    labels = torch.tensor([[X, X, 10, 11, 12, 13]])
    out = head_labels(labels, 3)
    assert out[0, 0].tolist() == [10, 11, 12, 13, X, X]  # position t learns t + 2
    assert out[1, 0].tolist() == [11, 12, 13, X, X, X]
    assert out[2, 0].tolist() == [12, 13, X, X, X, X]


LOOP = {"per_device_batch_size": 4, "grad_accum_steps": 2, "max_length": 96, "log_every": 1, "eval_every": 0,
        "eval_batches": 2, "checkpoint_every": 2}  # fmt: skip


def job(tmp_path, target_dir, distill, name, kind="medusa", **loop) -> tuple[StageSpec, object]:
    """The spec and inputs the runner would hand the heads stage's training process."""
    heads = {"enabled": True, "kind": kind, "num_heads": 3, "optim": {"lr": 1e-2}, "loop": {**LOOP, **loop}}
    inputs = stage_inputs("heads", tiny_recipe(target_dir, heads=heads), target_dir)
    spec = spec_for(inputs, context(tmp_path / name, "heads", {"distill": distill}))
    return spec, inputs


def train(spec, inputs):
    accelerator = make_accelerator(inputs.heads.loop.grad_accum_steps, "no")
    return train_heads(spec, inputs, accelerator, Tracker(None, "heads"))


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_training_step_moves_the_heads_only(tmp_path, tiny_target_dir, tiny_target, kind):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    spec, inputs = job(tmp_path, tiny_target_dir, distill, "run", kind=kind, max_steps=3, eval_every=2)
    _, metrics = train(spec, inputs)
    work_dir = tmp_path / "run" / "heads.partial"

    saved = load_heads(work_dir / HEADS_DIR)
    config = read_heads_config(work_dir / HEADS_DIR)
    assert config["kind"] == kind and config["target"]["path"] == str(tiny_target_dir)
    assert config["training"]["steps"] == 3
    reference = tiny_target.get_output_embeddings()
    for block in saved.blocks:  # the identity initialisation moved
        assert block.layers[0].weight.abs().sum() > 0
    if kind == "medusa":
        assert not torch.equal(saved.lm_heads[0].weight, reference.weight)
    else:
        assert len(saved.lm_heads) == 0
    # the same folder is vLLM's medusa draft: its config, and for BPD heads the target's lm head
    read, shared = load_vllm_medusa(work_dir / HEADS_DIR)
    assert read.kind == kind and (shared is None) is (kind == "medusa")
    if kind == "bpd":
        assert torch.equal(shared, reference.weight.detach().to(shared.dtype))
    assert not (work_dir / "checkpoints").exists()
    assert len(metrics.final.heads) == len(metrics.initial.heads) == 3
    assert all(0.0 <= h.top1_target <= 1.0 and 0.0 <= h.top1 <= 1.0 for h in metrics.final.heads)
    # heads at initialisation predict the next token, not the one after: training must lower their loss
    assert metrics.final.heads[0].loss < metrics.initial.heads[0].loss
    log = [json.loads(line) for line in (work_dir / LOG_FILE).read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3]


def test_killed_run_resumes_with_the_same_losses(tmp_path, tiny_target_dir):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    steps = 10
    train(*job(tmp_path, tiny_target_dir, distill, "whole", max_steps=steps))
    whole = tmp_path / "whole" / "heads.partial"
    expected = [json.loads(line)["loss"] for line in (whole / LOG_FILE).read_text().splitlines()]
    assert len(expected) == steps

    spec, inputs = job(tmp_path, tiny_target_dir, distill, "killed", max_steps=steps)
    killed = Path(spec.work_dir)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "ACCELERATE_USE_CPU": "true"}
    command = [
        sys.executable,
        "-m",
        "polydraft.pipelines.stages.heads",
        str(spec.write(killed / "spec.json")),
    ]
    step = run_killed_at(command, env, 5, killed / "checkpoints", killed / LOG_FILE)
    assert step == 4  # checkpoints every 2 steps: step 5 is lost and redone
    assert not (killed / HEADS_DIR).exists(), "the run finished before it was killed"

    train(spec, inputs)
    got = [json.loads(line)["loss"] for line in (killed / LOG_FILE).read_text().splitlines()]
    # same data order, RNG and optimizer state: the same numbers (up to float summation order)
    assert got == pytest.approx(expected, rel=1e-5)
    assert (killed / HEADS_DIR / "heads.safetensors").is_file()


@pytest.mark.parametrize(
    "name, target", [("vicuna-7b", "lmsys/vicuna-7b-v1.3"), ("vicuna-13b", "lmsys/vicuna-13b-v1.3")]
)
def test_seed_recipes_train_medusa_1_heads_and_measure_the_four_decoders(name, target):
    recipe = load_recipe(PROJECT_ROOT / "recipes" / "blockwise" / f"{name}.yaml", [])
    heads = recipe.heads
    assert recipe.target.path == target and heads.enabled and heads.kind == "medusa"
    assert (heads.num_heads, heads.num_layers, heads.loss_decay, heads.optim.lr) == (5, 1, 0.8, 1e-3)
    assert (heads.optim.warmup_ratio, heads.loop.epochs, heads.loop.per_device_batch_size) == (0.1, 2.0, 8)
    assert set(recipe.measure.decoders) == {"ar", "bpd", "medusa", "bpd+rescore", "medusa+rescore"}
    assert recipe.measure.temperatures == [0.0, 0.7, 1.0]


def test_the_step_loss_is_the_decay_weighted_sum_of_each_heads_token_mean(
    tmp_path, tiny_target_dir, tiny_target
):
    """Step 1's logged loss, recomputed from the initial heads on that step's two micro-batches: head i's
    summed cross-entropy over both, divided by its own token count, weighted 0.8^i."""
    from polydraft.models.heads import heads_for_target
    from polydraft.models.loading import load_tokenizer
    from polydraft.train.data import MixBatches, pad_id_of
    from polydraft.train.heads import ce_sums, head_labels, heads_forward, last_hidden
    from polydraft.train.mix_cache import load_examples

    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    spec, inputs = job(tmp_path, tiny_target_dir, distill, "run", max_steps=1)
    train(spec, inputs)
    logged = json.loads((tmp_path / "run" / "heads.partial" / LOG_FILE).read_text().splitlines()[0])["loss"]

    tokenizer = load_tokenizer(str(tiny_target_dir), None, False)
    loop = inputs.heads.loop
    examples = load_examples(distill, tokenizer, "train", temperatures=inputs.heads.temperatures,
                             loss_on="response", max_length=loop.max_length, cache_dir=tmp_path / "cache",
                             main_process_first=nullcontext).examples  # fmt: skip
    batches = MixBatches(examples, loop.seed, loop.per_device_batch_size, 0, 1, loop.grad_accum_steps,
                         pad_id_of(tokenizer))  # fmt: skip
    heads = heads_for_target(tiny_target, "medusa", 3)
    sums, counts = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches.micro_batches(0):
            labels = head_labels(batch["labels"], 3)
            logits, selected = heads_forward(heads, None, last_hidden(tiny_target, batch), labels)
            sums += ce_sums(logits, selected).double()
            counts += (selected != IGNORE_INDEX).sum(1).double()
    expected = sum(0.8**i * float(sums[i] / counts[i]) for i in range(3))
    assert logged == pytest.approx(expected, rel=1e-5)
