"""Drafter architectures, the vocabulary check, the finetune defaults of seed 003 App. F.3."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from polydraft.models.drafters import (
    DrafterMismatch,
    build_drafter,
    check_drafter_compatible,
    drafter_shape,
    export_drafter,
)
from polydraft.pipelines.run.recipe import RecipeError, load_recipe
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.schema import Recipe
from tests.drafter_setup import context, run_stage, tiny_recipe

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def test_llama_68m_has_the_published_shape_and_size():
    model = build_drafter("llama-68m", 32000, **IDS)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 2, 12)
    assert config.intermediate_size == 3072 and config.model_type == "llama"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 68
    assert drafter_shape("vicuna-68m") == drafter_shape("llama-68m")


def test_gemma_250m_follows_seed_003_table_4():
    config = build_drafter("gemma-250m", 512, **IDS).config
    assert config.model_type == "gemma"
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert (config.hidden_size, config.intermediate_size) == (768, 6144)
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (16, 2, 2)
    assert config.rms_norm_eps == 1e-6
    # with Gemma's 256k vocabulary it is the ~250M model of the name
    per_vocab_token = 768
    body = sum(p.numel() for p in build_drafter("gemma-250m", 512, **IDS).parameters()) - 512 * 768
    assert 230e6 < body + 256000 * per_vocab_token < 260e6


def test_custom_needs_its_shape_and_overrides_apply_to_named_ones():
    with pytest.raises(ValueError, match="needs hidden_size"):
        drafter_shape("custom", num_layers=2)
    assert drafter_shape("llama-68m", num_layers=4)["num_layers"] == 4
    custom = drafter_shape("custom", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    assert custom["num_kv_heads"] == 2
    with pytest.raises(ValueError, match="divisible"):
        drafter_shape("custom", hidden_size=30, num_layers=1, num_heads=4, intermediate_size=64)


def test_same_seed_same_weights_and_the_global_rng_is_left_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    a = build_drafter("custom", 64, **IDS, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_drafter("custom", 64, **IDS, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_vocabulary_size_and_tokenizer_mismatches_are_errors(tiny_tokenizer):
    from polydraft.data.offline import offline_texts
    from polydraft.models.tiny import train_tokenizer

    with pytest.raises(DrafterMismatch, match="vocabulary of 32000 tokens but the target has 512"):
        check_drafter_compatible(32000, 512, tiny_tokenizer)
    other = train_tokenizer([row["text"] for row in offline_texts(["ru", "ja"], 200, seed=3)], vocab_size=512)
    assert len(other) == len(tiny_tokenizer)
    with pytest.raises(DrafterMismatch, match="tokenizer whose vocabulary differs"):
        check_drafter_compatible(512, 512, tiny_tokenizer, other)
    check_drafter_compatible(512, 512, tiny_tokenizer, tiny_tokenizer)


def _drafter_folder(path, tokenizer, vocab_size):
    model = build_drafter(
        "custom", vocab_size, **IDS, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32
    )
    return export_drafter(model, tokenizer, path)


def test_a_drafter_checkpoint_with_another_vocabulary_stops_before_training(tmp_path, tiny_target_dir):
    folder = _drafter_folder(tmp_path / "drafter", _drafter_tokenizer_stub(), 1000)
    recipe = tiny_recipe(
        tiny_target_dir, pretrain={"enabled": False}, finetune={"drafter": {"init": str(folder)}}
    )
    ctx = context(tmp_path / "run", "finetune", upstream={"distill": tmp_path / "distill"})
    with pytest.raises(StageFailed, match=r"vocabulary of 1000 tokens but target .* has 5\d\d"):
        run_stage("finetune", recipe, ctx, tiny_target_dir)
    assert list(ctx.work_dir.iterdir()) == []  # nothing launched, nothing written
    recipe = tiny_recipe(tiny_target_dir, pretrain={"drafter": {"init": str(folder)}})
    with pytest.raises(StageFailed, match="vocabulary of 1000 tokens"):
        run_stage("pretrain", recipe, context(tmp_path / "run", "pretrain"), tiny_target_dir)


def _drafter_tokenizer_stub():
    from polydraft.data.offline import offline_texts
    from polydraft.models.tiny import train_tokenizer

    return train_tokenizer([row["text"] for row in offline_texts(["zh"], 200, seed=1)], vocab_size=1000)


def test_exported_folder_reloads_with_the_targets_tokenizer(tmp_path, tiny_tokenizer):
    folder = _drafter_folder(tmp_path / "d", tiny_tokenizer, len(tiny_tokenizer))
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded.config.vocab_size == len(tiny_tokenizer)
    assert reloaded.generation_config.eos_token_id == tiny_tokenizer.eos_token_id


def _recipe(**blocks):
    return Recipe.model_validate({"target": {"path": "t"}, "data": {"pairs": ["de-en"]}, **blocks})


def test_finetune_defaults_follow_seed_003_and_are_filled_when_the_recipe_loads():
    pf = _recipe(pretrain={"drafter": {"arch": "vicuna-68m"}})
    assert pf.finetune.optim.lr == 2e-5 and pf.finetune.loop.epochs == 3.0
    assert (pf.finetune.loop.per_device_batch_size, pf.finetune.loop.max_length) == (2, 2048)
    assert pf.finetune.optim.warmup_ratio == 0.03 and pf.finetune.optim.schedule == "cosine"
    f_only = _recipe(pretrain={"enabled": False}, finetune={"drafter": {"arch": "vicuna-68m"}})
    assert f_only.finetune.optim.lr == 2e-5 and f_only.finetune.loop.epochs == 5.0
    llama = _recipe(pretrain={"enabled": False}, finetune={"drafter": {"arch": "llama-68m"}})
    assert llama.finetune.optim.lr == 3e-5
    explicit = _recipe(pretrain={"enabled": False}, finetune={"optim": {"lr": 1e-4}, "loop": {"epochs": 2.0}})
    assert explicit.finetune.optim.lr == 1e-4 and explicit.finetune.loop.epochs == 2.0
    # the resolved recipe reloads to itself (what `polydraft show` prints is what runs)
    assert Recipe.model_validate(pf.model_dump(mode="json")) == pf


def test_a_finetune_drafter_beside_pretraining_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("target: {path: t}\ndata: {pairs: [de-en]}\nfinetune: {drafter: {arch: vicuna-68m}}\n")
    with pytest.raises(RecipeError, match="finetune.drafter is only used without pretraining"):
        load_recipe(path)
