"""The early-exit drafter: initialisation (eq. 1), partial loading, sharing with the target, save/attach."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from polydraft.models.early_exit import (
    CONFIG_FILE,
    attach_exit_head,
    build_early_exit,
    from_target,
    read_head_config,
    save_exit_head,
)
from polydraft.models.partial_load import TargetLayoutError, decoder_parts
from polydraft.models.tiny import build_llama

N = 2  # shared layers of the 4-layer tiny target


def ids(vocab: int, shape=(2, 12), seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A 4-layer Llama with a separate lm head, saved as 1 shard per tensor group (sharded checkpoint)."""
    model = build_llama(
        vocab_size=97,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        intermediate_size=64,
        tie_word_embeddings=False,
        seed=1,
    )
    folder = tmp_path_factory.mktemp("untied")
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


def test_initialisation_matches_target_last_layer_norm_and_head(tiny_target_dir, tiny_target):
    drafter = build_early_exit(str(tiny_target_dir), N)
    x = ids(tiny_target.config.vocab_size)
    with torch.no_grad():
        hidden = tiny_target(x, output_hidden_states=True).hidden_states
        state = drafter.forward_shared(x)
        assert torch.equal(state.hidden, hidden[N])  # the drafter really runs the target's first N layers
        position_ids, rope = drafter.positions(hidden[N])
        ours = drafter.exit_layers[0](
            hidden[N], attention_mask=None, position_embeddings=rope, position_ids=position_ids
        )
        last = tiny_target.model.layers[-1](
            hidden[N], attention_mask=None, position_embeddings=rope, position_ids=position_ids
        )
        assert torch.equal(ours, last)
    assert torch.equal(drafter.lm_head.weight, tiny_target.lm_head.weight)
    assert torch.equal(drafter.norm.weight, tiny_target.model.norm.weight)
    assert drafter.exit_init_layers == [3] and drafter.exit_cache_slots == [4]
    assert drafter.exit_layers[0].self_attn.layer_idx == 4
    # tied target: the head is its own parameter initialised from the embeddings, not the frozen embeddings
    assert drafter.lm_head.weight.data_ptr() != drafter.embed_tokens.weight.data_ptr()


def test_drafter_on_all_but_last_layer_is_the_target(tiny_target_dir, tiny_target):
    """With N = L-1 and one exit layer copied from layer L-1, the drafter computes the target exactly."""
    drafter = build_early_exit(str(tiny_target_dir), 3)
    x = ids(tiny_target.config.vocab_size, seed=1)
    with torch.no_grad():
        logits, hidden = drafter(x)
        assert torch.allclose(logits, tiny_target(x).logits, atol=1e-5)
        assert torch.allclose(hidden, tiny_target.model(x).last_hidden_state, atol=1e-5)


def test_partial_loading_never_materialises_unused_layers(untied_dir, monkeypatch):
    from safetensors import safe_open
    from transformers.models.llama import modeling_llama

    built_on = []
    original_init = modeling_llama.LlamaDecoderLayer.__init__

    def recording_init(self, config, layer_idx):
        original_init(self, config, layer_idx)
        built_on.append(next(self.parameters()).device.type)

    opened = []

    def recording_open(path, *args, **kwargs):
        opened.append(path.rsplit("/", 1)[-1])
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "__init__", recording_init)
    monkeypatch.setattr("safetensors.safe_open", recording_open)
    index = json.loads((untied_dir / "model.safetensors.index.json").read_text())["weight_map"]
    drafter = build_early_exit(str(untied_dir), N)

    assert built_on == ["meta"] * 4  # every layer of the target was only a meta shell
    assert all(p.device.type == "cpu" for p in drafter.parameters())
    needed = {
        k for k in index if not k.startswith(("model.layers.2.",))
    }  # layers 0, 1 and 3 + embed/norm/head
    assert set(drafter.loaded_keys) == needed
    needed_shards = {index[k] for k in needed}
    assert set(opened) == needed_shards  # the index is JSON; only shards holding needed tensors are opened
    assert set(index.values()) - needed_shards  # ... and some shards (layer 2 only) never are
    per_layer = sum(p.numel() for p in drafter.shared_layers[0].parameters())
    embed = drafter.embed_tokens.weight.numel()
    expected = embed + 3 * per_layer + drafter.norm.weight.numel() + drafter.lm_head.weight.numel()
    assert sum(p.numel() for p in drafter.parameters()) == expected


def test_bin_checkpoint_is_read_too(tmp_path, untied_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(untied_dir).eval()
    AutoConfig.from_pretrained(untied_dir).save_pretrained(tmp_path)
    torch.save(target.state_dict(), tmp_path / "pytorch_model.bin")
    drafter = build_early_exit(str(tmp_path), N)
    x = ids(97)
    with torch.no_grad():
        assert torch.equal(
            drafter.forward_shared(x).hidden, target(x, output_hidden_states=True).hidden_states[N]
        )
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight)


def test_head_only_ablation_has_no_exit_layer(tiny_target_dir, tiny_target):
    drafter = build_early_exit(str(tiny_target_dir), N, num_exit_layers=0)
    assert len(drafter.exit_layers) == 0 and drafter.exit_cache_slots == []
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == {"exit.norm.weight", "exit.lm_head.weight"}
    x = ids(tiny_target.config.vocab_size)
    with torch.no_grad():
        logits, _ = drafter(x)
        hidden_n = tiny_target(x, output_hidden_states=True).hidden_states[N]
        assert torch.allclose(logits, tiny_target.lm_head(tiny_target.model.norm(hidden_n)), atol=1e-6)


def test_attach_shares_the_target_modules_and_restores_the_head(tiny_target_dir, tiny_target, tmp_path):
    trained = build_early_exit(str(tiny_target_dir), N)
    with torch.no_grad():
        for p in trained.exit.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a head that differs from its initialisation
    save_exit_head(trained, tmp_path / "head", extra={"note": "test"})
    config = read_head_config(tmp_path / "head")
    assert config["target"]["path"] == str(tiny_target_dir) and config["num_shared_layers"] == N
    assert config["note"] == "test" and config["exit_cache_slots"] == [4]

    attached = attach_exit_head(tiny_target, tmp_path / "head")
    for ours, theirs in zip(attached.shared_layers, tiny_target.model.layers[:N], strict=True):
        assert ours is theirs
    assert attached.embed_tokens is tiny_target.model.embed_tokens
    assert attached.rotary_emb is tiny_target.model.rotary_emb
    shared = {p.data_ptr() for p in tiny_target.parameters()}
    assert not any(p.data_ptr() in shared for p in attached.exit.parameters())
    x = ids(tiny_target.config.vocab_size)
    with torch.no_grad():
        assert torch.allclose(attached(x)[0], trained(x)[0], atol=1e-6)
        assert not torch.allclose(attached(x)[0], from_target(tiny_target, N)(x)[0])


def test_attach_refuses_a_head_of_another_target(tiny_target_dir, untied_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    save_exit_head(build_early_exit(str(untied_dir), N), tmp_path / "head")
    other = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with pytest.raises(ValueError, match="hidden_size 32 .head. vs 64 .target."):
        attach_exit_head(other, tmp_path / "head")
    (tmp_path / "head" / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="early_exit.json"):
        attach_exit_head(other, tmp_path / "head")


def test_incremental_decoding_with_its_own_cache_slots(tiny_target_dir, tiny_target):
    drafter = from_target(tiny_target, N)
    x = ids(tiny_target.config.vocab_size, shape=(1, 10))
    cache = drafter.new_cache()
    with torch.no_grad():
        full, _ = drafter(x)
        drafter(x[:, :6], cache=cache)
        steps = [drafter(x[:, k : k + 1], cache=cache)[0] for k in range(6, 10)]
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 6:], atol=1e-5)
    assert cache.get_seq_length(4) == 10  # the exit layer's own slot
    assert cache.get_seq_length(N) == 0  # the target's later layers were never run
    assert all(cache.get_seq_length(i) == 10 for i in range(N))


def test_other_architecture_with_bias_and_layer_types(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    target.save_pretrained(tmp_path)
    drafter = build_early_exit(str(tmp_path), 2)
    x = ids(101)
    with torch.no_grad():
        assert torch.allclose(drafter(x)[0], target(x).logits, atol=1e-5)


class _NoLayerList(nn.Module):
    """A causal LM-like model whose decoder keeps its blocks in a plain Python list."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2)
        self.embed = nn.Embedding(10, 8)
        self.blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]
        self.head = nn.Linear(8, 10)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def get_decoder(self):
        return self


def test_targets_without_the_layout_fail_clearly(tmp_path):
    with pytest.raises(TargetLayoutError, match="list of decoder layers .*final norm.*rotary_emb"):
        decoder_parts(_NoLayerList())
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    )
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(
        TargetLayoutError, match=r"GPT2LMHeadModel .* lacks a shared rotary position embedding"
    ):
        build_early_exit(str(tmp_path), 1)


def test_bad_sizes_and_missing_checkpoint(tiny_target_dir, tmp_path):
    with pytest.raises(ValueError, match=r"num_shared_layers must be in \[1, 3\]"):
        build_early_exit(str(tiny_target_dir), 4)
    with pytest.raises(ValueError, match=r"num_exit_layers must be in \[0, 4\]"):
        build_early_exit(str(tiny_target_dir), 2, num_exit_layers=5)
    (tmp_path / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no checkpoint in this folder"):
        build_early_exit(str(tmp_path), 2)


def test_streamed_target_tokens_equal_the_full_forward(tiny_target_dir, tiny_target, untied_dir):
    from transformers import AutoModelForCausalLM

    from polydraft.models.target_stream import streamed_greedy_tokens

    for folder, target in ((tiny_target_dir, tiny_target), (untied_dir, None)):
        target = target or AutoModelForCausalLM.from_pretrained(folder).eval()
        batches = [
            ids(target.config.vocab_size, (2, 9), seed=3),
            ids(target.config.vocab_size, (3, 5), seed=4),
        ]
        got = streamed_greedy_tokens(str(folder), batches)
        with torch.no_grad():
            expected = [target(b).logits.argmax(-1) for b in batches]
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
