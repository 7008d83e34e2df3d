"""Medusa and BPD heads: their offsets at initialisation, polydraft's format and vLLM's medusa format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from polydraft.models.heads import (
    VLLM_CONFIG_FILE,
    VLLM_LM_HEAD_FILE,
    WEIGHTS_FILE,
    Heads,
    add_vllm_medusa,
    attach_heads,
    heads_for_target,
    load_heads,
    load_vllm_medusa,
    read_heads_config,
    save_heads,
)
from polydraft.models.tiny import build_llama


@pytest.fixture(scope="module")
def target():
    return build_llama(96, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)


def trained_like(heads: Heads, seed: int) -> Heads:
    """Every tensor redrawn, as after training (the identity initialisation would hide mix-ups)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return heads


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_heads_start_as_the_targets_next_token_head(target, kind):
    heads = heads_for_target(target, kind, num_heads=3, num_layers=2)
    hidden = torch.randn(5, 32)
    head = target.get_output_embeddings()
    logits = heads(hidden, head if kind == "bpd" else None)
    assert logits.shape == (3, 5, 96)
    for i in range(3):
        torch.testing.assert_close(logits[i], head(hidden))
    if kind == "bpd":
        assert len(heads.lm_heads) == 0  # the target's head is shared, not copied
        with pytest.raises(ValueError, match="shared_head"):
            heads(hidden)


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_own_format_round_trip(tmp_path, target, kind):
    heads = trained_like(heads_for_target(target, kind, num_heads=2), seed=1)
    save_heads(
        heads, tmp_path / "heads", {"path": "some/target", "revision": None}, extra={"training": {"steps": 3}}
    )
    config = read_heads_config(tmp_path / "heads")
    assert config["kind"] == kind and config["num_heads"] == 2 and config["training"] == {"steps": 3}
    stored = load_file(str(tmp_path / "heads" / "heads.safetensors"))
    assert any(key.startswith("lm_heads") for key in stored) is (kind == "medusa")
    loaded = attach_heads(target, tmp_path / "heads")
    hidden = torch.randn(4, 32)
    shared = target.get_output_embeddings() if kind == "bpd" else None
    torch.testing.assert_close(loaded(hidden, shared), heads(hidden, shared))

    other = build_llama(80, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="vocabulary 96"):
        attach_heads(other, tmp_path / "heads")


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_one_folder_is_both_formats(tmp_path, target, kind):
    """polydraft's folder plus vLLM's medusa config (and, for BPD, the target's lm head) is what vLLM's
    medusa model reads: its parameter names, nothing stored twice, the same heads read back."""
    heads = trained_like(heads_for_target(target, kind, num_heads=3, num_layers=2), seed=2)
    target_head = target.get_output_embeddings()
    folder = save_heads(heads, tmp_path / "heads", {"path": "t", "revision": None})
    add_vllm_medusa(folder, target_head)
    config = json.loads((folder / VLLM_CONFIG_FILE).read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"]) == (3, 2, 32)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is (kind == "bpd")
    # vLLM's MedusaConfig renames every key holding "num" and "heads" (or "layers"): only these two may
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    # the parameter names of vLLM's Medusa module: ResidualBlock `layers`, per-head or one shared lm head
    blocks = {f"blocks.{i}.layers.{j}.{p}" for i in range(3) for j in range(2) for p in ("weight", "bias")}
    own = set(load_file(str(folder / WEIGHTS_FILE)))
    if kind == "bpd":
        assert own == blocks and set(load_file(str(folder / VLLM_LM_HEAD_FILE))) == {"lm_head.weight"}
    else:
        assert own == blocks | {f"lm_heads.{i}.weight" for i in range(3)}
        assert not (folder / VLLM_LM_HEAD_FILE).exists()

    loaded, shared = load_vllm_medusa(folder)
    hidden = torch.randn(4, 32)
    if kind == "bpd":
        torch.testing.assert_close(shared, target_head.weight.detach())
        torch.testing.assert_close(loaded(hidden, target_head), heads(hidden, target_head))
    else:
        assert shared is None
        torch.testing.assert_close(loaded(hidden), heads(hidden))
    # and polydraft still reads its own files from the same folder
    torch.testing.assert_close(
        attach_heads(target, folder)(hidden, target_head if kind == "bpd" else None),
        heads(hidden, target_head if kind == "bpd" else None),
    )
    if kind == "bpd":
        with pytest.raises(ValueError, match="lm head"):
            add_vllm_medusa(folder)
        (folder / VLLM_LM_HEAD_FILE).unlink()
        with pytest.raises(ValueError, match="would miss"):
            load_vllm_medusa(folder)


def test_load_heads_keeps_the_saved_dtype(tmp_path, target):
    heads = heads_for_target(target, "medusa", num_heads=1).to(torch.bfloat16)
    save_heads(heads, tmp_path / "h", {"path": "t", "revision": None})
    assert next(load_heads(tmp_path / "h").parameters()).dtype == torch.bfloat16
    assert read_heads_config(tmp_path / "h")["dtype"] == "bfloat16"
