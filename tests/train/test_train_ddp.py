"""Two real gloo DDP ranks (accelerate launch, recipes/accelerate/ddp.yaml) train exactly like one rank
with the same global batch; in pretraining each reads its own half of the documents."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from polydraft.train.checkpoint import list_checkpoints, read_state
from polydraft.train.steplog import read_log
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix


def _finetune(tmp_path, target_dir, distill, name, **loop_and_launch):
    launch = loop_and_launch.pop("launch", {})
    recipe = tiny_recipe(
        target_dir,
        data={"pairs": ["de-en"]},
        pretrain={"enabled": False},
        finetune={"loop": {"max_steps": 4, "per_device_batch_size": 2, **loop_and_launch}},
        launch=launch,
    )
    ctx = context(tmp_path / name, "finetune", {"distill": distill})
    metrics = run_stage("finetune", recipe, ctx, target_dir).metrics
    return ctx.work_dir, metrics


def test_two_ddp_ranks_match_one_rank_with_the_same_global_batch(tmp_path, tiny_target_dir):
    # rows of different lengths and prompt sizes: each rank's micro-batch carries a different number of
    # loss tokens, so only a loss normalised over the whole step's tokens can match
    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=16, eval_rows=6)
    one_dir, one = _finetune(tmp_path, tiny_target_dir, distill, "one", grad_accum_steps=2)
    two_dir, two = _finetune(
        tmp_path,
        tiny_target_dir,
        distill,
        "two",
        launch={"accelerate_config": "recipes/accelerate/ddp.yaml", "num_processes": 2},
    )
    # every process saves its own RNG state: two files prove two real ranks
    last = two_dir / "de-en.checkpoints" / "step-00000004"
    assert sorted(p.name for p in last.glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert (one["distributed_type"], one["num_processes"]) == ("NO", 1)
    assert (two["distributed_type"], two["num_processes"]) == ("MULTI_CPU", 2)
    one_log = read_log(one_dir / "de-en.train_log.jsonl")
    two_log = read_log(two_dir / "de-en.train_log.jsonl")
    assert len(one_log) == len(two_log) == 4
    for a, b in zip(one_log, two_log, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["tokens"] == a["tokens"]
    eval_loss = [m["pairs"]["de-en"]["eval"]["de-en"]["eval_loss"] for m in (one, two)]
    assert eval_loss[1] == pytest.approx(eval_loss[0], rel=1e-5)
    one_weights = load_file(one_dir / "de-en" / "model.safetensors")
    two_weights = load_file(two_dir / "de-en" / "model.safetensors")
    for key, value in one_weights.items():
        torch.testing.assert_close(two_weights[key], value, rtol=1e-4, atol=1e-6)


def _eagle3(tmp_path, target_dir, distill, name, **loop_and_launch):
    launch = loop_and_launch.pop("launch", {})
    # eval_batches 0: the whole held-out split on either (a limit counts micro-batches per process)
    loop = {"max_steps": 3, "per_device_batch_size": 2, "max_length": 96, "eval_every": 0, "eval_batches": 0,
            "loss_chunk_tokens": 16, **loop_and_launch}  # fmt: skip
    recipe = tiny_recipe(
        target_dir,
        data={"pairs": ["de-en"]},
        eagle3={"enabled": True, "aux_layers": [1, 2, 3], "draft_vocab_size": 300, "loop": loop},
        launch=launch,
    )
    ctx = context(tmp_path / name, "eagle3", {"distill": distill})
    metrics = run_stage("eagle3", recipe, ctx, target_dir).metrics
    return ctx.work_dir, metrics


def test_eagle3_heads_train_alike_on_two_ddp_ranks_and_on_one(tmp_path, tiny_target_dir):
    """The EAGLE-3 trainer (each rank with its own frozen target computing features, the unrolled head
    wrapped by DDP, its lm head projected outside the forward) gives one rank's losses, gradient norms
    and weights with the same global batch."""
    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=16, eval_rows=6)
    one_dir, one = _eagle3(tmp_path, tiny_target_dir, distill, "one", grad_accum_steps=2)
    two_dir, two = _eagle3(
        tmp_path, tiny_target_dir, distill, "two",
        launch={"accelerate_config": "recipes/accelerate/ddp.yaml", "num_processes": 2},
    )  # fmt: skip
    assert (two["distributed_type"], two["num_processes"]) == ("MULTI_CPU", 2)
    one_log = read_log(one_dir / "de-en.train_log.jsonl")
    two_log = read_log(two_dir / "de-en.train_log.jsonl")
    assert len(one_log) == len(two_log) == 3
    for a, b in zip(one_log, two_log, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    heads = [m["heads"]["de-en"]["final"]["eval_loss"] for m in (one, two)]
    assert heads[1] == pytest.approx(heads[0], rel=1e-5)
    one_weights = load_file(one_dir / "de-en" / "model.safetensors")
    two_weights = load_file(two_dir / "de-en" / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    for key, value in one_weights.items():
        torch.testing.assert_close(two_weights[key], value, rtol=1e-4, atol=1e-6)


def _pretrain(tmp_path, target_dir, name, **loop_and_launch):
    launch = loop_and_launch.pop("launch", {})
    loop = {"max_steps": 4, "per_device_batch_size": 2, "checkpoint_every": 4, **loop_and_launch}
    recipe = tiny_recipe(target_dir, pretrain={"loop": loop}, launch=launch)
    ctx = context(tmp_path / name, "pretrain")
    run_stage("pretrain", recipe, ctx, target_dir)
    [checkpoint] = list_checkpoints(ctx.work_dir / "model.checkpoints")
    return read_state(checkpoint)["data"]


def test_two_ddp_ranks_each_read_and_tokenize_half_of_the_pretraining_documents(tmp_path, tiny_target_dir):
    """Each process reads its own share of the corpus: after the same 4 steps of the same global batch,
    each of the 2 ranks has read about half the documents one rank read (with the whole stream read on
    every rank and the sequences split, each would have read all of them), and the checkpoint keeps
    both positions, each rank resuming from its own."""
    [one] = _pretrain(tmp_path, tiny_target_dir, "one", grad_accum_steps=2)
    two = _pretrain(
        tmp_path, tiny_target_dir, "two",
        launch={"accelerate_config": "recipes/accelerate/ddp.yaml", "num_processes": 2},
    )  # fmt: skip
    assert len(two) == 2

    def read(state):
        return sum(reader["documents"] for reader in state["stream"]["readers"])

    assert read(one) > 8
    for rank in two:  # packing carries a document's tail over: a share is half give or take a document
        assert abs(read(rank) - read(one) / 2) <= 2, (read(rank), read(one))
    assert two[0] != two[1]
