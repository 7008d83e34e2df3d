"""The early-exit trainer, in process: what trains, what stays frozen, what it writes and reports."""

from __future__ import annotations

import json

import pytest
import torch

from polydraft.models.early_exit import attach_exit_head, build_early_exit, from_target, read_head_config
from polydraft.pipelines.runtime.contract import TRAINING_METRICS as METRICS_FILE
from polydraft.pipelines.runtime.contract import StageFailed, spec_for
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.stages.early_exit import train_early_exit
from polydraft.train.early_exit import HEAD_DIR, LOG_FILE, exit_loss, head_forward, teacher_logits
from polydraft.train.losses import ce_sum, topk_kl_sum
from polydraft.train.runtime import make_accelerator
from tests.drafter_setup import context, run_stage, stage_inputs, tiny_recipe, write_tiny_mix
from tests.eesd_setup import save_layered_target

LOOP = {"max_length": 96, "per_device_batch_size": 4, "grad_accum_steps": 1, "max_steps": 4, "log_every": 1,
        "eval_every": 2, "eval_batches": 2, "checkpoint_every": 2}  # fmt: skip


@pytest.fixture(scope="module")
def layered_dir(tmp_path_factory, tiny_tokenizer):
    return save_layered_target(tmp_path_factory.mktemp("layered"), tiny_tokenizer)


def train_in_process(tmp_path, target_dir, precision="no", **early_exit):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=12, eval_rows=4)
    recipe = tiny_recipe(target_dir, early_exit={"optim": {"lr": 1e-2}, "loop": LOOP, **early_exit})
    ctx = context(tmp_path / "run", "early_exit", {"distill": distill})
    inputs = stage_inputs("early_exit", recipe, target_dir)
    accelerator = make_accelerator(1, precision)
    drafter, metrics = train_early_exit(
        spec_for(inputs, ctx), inputs, accelerator, Tracker(None, "early_exit")
    )
    return ctx, drafter, metrics.model_dump()


def test_training_moves_the_head_and_never_the_frozen_layers(tmp_path, layered_dir):
    from transformers import AutoModelForCausalLM

    tiny_target = AutoModelForCausalLM.from_pretrained(layered_dir).eval()
    ctx, drafter, metrics = train_in_process(tmp_path, layered_dir, num_shared_layers=3)
    target = tiny_target.state_dict()
    for i, layer in enumerate(drafter.shared_layers):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, target[f"model.layers.{i}.{name}"]), name
    assert torch.equal(drafter.embed_tokens.weight, target["model.embed_tokens.weight"])
    for name, tensor in drafter.exit_layers[0].state_dict().items():
        assert not torch.equal(tensor, target[f"model.layers.3.{name}"]), name
    assert not torch.equal(drafter.norm.weight, target["model.norm.weight"])
    assert not torch.equal(drafter.lm_head.weight, target["lm_head.weight"])

    # N = L-1 and the exit layer copied from layer L-1: before training the drafter IS the target
    assert metrics["initial"]["top1_target"] == 1.0
    assert metrics["steps"] == 4 and 0.0 <= metrics["final"]["top1_target"] <= 1.0
    log = [json.loads(line) for line in (ctx.work_dir / LOG_FILE).read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4]

    head = ctx.work_dir / HEAD_DIR
    config = read_head_config(head)
    assert config["num_shared_layers"] == 3 and config["target"]["path"] == str(layered_dir)
    assert config["training"]["steps"] == 4
    assert not (ctx.work_dir / "checkpoints").exists()  # removed once the head is written
    attached = attach_exit_head(tiny_target, head)
    x = torch.randint(0, tiny_target.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.allclose(attached(x)[0], drafter(x)[0], atol=1e-5)


def test_head_only_ablation_trains_norm_and_head(tmp_path, layered_dir):
    _, drafter, metrics = train_in_process(tmp_path, layered_dir, num_shared_layers=2, num_exit_layers=0)
    fresh = build_early_exit(str(layered_dir), 2, num_exit_layers=0)
    assert len(drafter.exit_layers) == 0
    assert not torch.equal(drafter.lm_head.weight, fresh.lm_head.weight)
    assert metrics["initial"]["top1_target"] < 1.0  # layer 2 of 4 is not the target


def test_kl_loss_trains_and_its_teacher_is_the_full_target(tmp_path, layered_dir):
    from transformers import AutoModelForCausalLM

    ctx, _, metrics = train_in_process(
        tmp_path, layered_dir, num_shared_layers=2, loss="ce+kl", loss_on="all"
    )
    assert metrics["steps"] == 4 and (ctx.work_dir / HEAD_DIR / "early_exit.safetensors").is_file()
    target = AutoModelForCausalLM.from_pretrained(layered_dir).eval()
    drafter = from_target(target, 2)
    x = torch.randint(0, target.config.vocab_size, (2, 7))
    with torch.no_grad():  # the teacher continues the shared layer-N states through layers N..L-1
        assert torch.allclose(
            teacher_logits(target, drafter, drafter.forward_shared(x)), target(x).logits, atol=1e-5
        )


def test_the_exit_loss_windowed_to_the_responses_is_the_loss_of_all_logits(layered_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from polydraft.train.data import collate, encode_texts

    target = AutoModelForCausalLM.from_pretrained(layered_dir).eval()
    drafter = from_target(target, 2)
    pairs = [
        ("USER: Hallo Welt, wie geht es dir heute? ASSISTANT:", " Hello world"),
        ("USER: Ja ASSISTANT:", " Yes"),
    ]
    batch = collate(encode_texts(tiny_tokenizer, pairs, 64), tiny_tokenizer.pad_token_id)
    head, labels = drafter.exit, batch["labels"]
    for teacher in (None, target):
        windowed = exit_loss(drafter, head, batch, teacher, 0.5, 8)
        logits, state = head_forward(drafter, head, batch["input_ids"])
        full = ce_sum(logits, labels)[0]
        if teacher is not None:
            full = full + 0.5 * topk_kl_sum(logits, teacher_logits(target, drafter, state), labels, 8)
        for a, b in zip(torch.autograd.grad(windowed, [*head.parameters()]),
                        torch.autograd.grad(full, [*head.parameters()]), strict=True):  # fmt: skip
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(windowed.detach(), full.detach())


def test_missing_distill_and_too_little_data_fail_clearly(tmp_path, tiny_target_dir):
    recipe = tiny_recipe(tiny_target_dir, early_exit={"loop": LOOP})
    with pytest.raises(StageFailed, match="enable the distill stage"):
        run_stage("early_exit", recipe, context(tmp_path / "run", "early_exit"), tiny_target_dir)
    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=3, eval_rows=1)
    ctx = context(tmp_path / "run2", "early_exit", {"distill": distill})
    inputs = stage_inputs("early_exit", recipe, tiny_target_dir)
    with pytest.raises(StageFailed, match="training examples are fewer than one global batch of 4"):
        train_early_exit(
            spec_for(inputs, ctx), inputs, make_accelerator(1, "no"), Tracker(None, "early_exit")
        )
    assert not (ctx.work_dir / METRICS_FILE).exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_autocast_training_on_a_gpu(tmp_path, layered_dir):
    from transformers import AutoModelForCausalLM

    _, drafter, metrics = train_in_process(tmp_path, layered_dir, precision="bf16", num_shared_layers=2)
    target = AutoModelForCausalLM.from_pretrained(layered_dir).eval()
    assert next(drafter.exit.parameters()).device.type == "cuda"
    assert next(drafter.exit.parameters()).dtype == torch.float32  # fp32 master weights under bf16 autocast
    for i, layer in enumerate(drafter.shared_layers):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor.cpu(), target.state_dict()[f"model.layers.{i}.{name}"]), name
    assert metrics["steps"] == 4 and metrics["peak_memory_gib"] > 0


def test_the_kl_teacher_is_the_targets_own_distribution_on_a_soft_capped_target():
    """`ce+kl` continues the shared states through the target's later layers: its logits are the target's
    own, Gemma 2's final soft-capping included."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from polydraft.models.early_exit import from_target
    from polydraft.train.early_exit import teacher_logits

    config = Gemma2Config(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=64, final_logit_softcapping=0.5)  # fmt: skip
    torch.manual_seed(0)
    teacher = Gemma2ForCausalLM(config).eval()
    drafter = from_target(teacher, 1, 1)
    ids = torch.arange(3, 15).view(1, -1)
    with torch.no_grad():
        expected = teacher(ids).logits
        got = teacher_logits(teacher, drafter, drafter.forward_shared(ids))
    assert expected.abs().max() <= 0.5 and torch.allclose(got, expected, atol=1e-5)
