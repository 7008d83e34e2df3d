"""The EAGLE-3 head: its feature layers, draft vocabulary and saved format, and the one property that ties
training to decoding: the unrolled training-time test computes, step for step, what the decoder computes
when it drafts over the same tokens."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from polydraft.decoding.eagle3 import Eagle3Drafter
from polydraft.models.draft_vocab import always_kept, byte_token_ids, coverage, draft_vocabulary
from polydraft.models.eagle3 import (
    default_aux_layers,
    feature_capture,
    head_for_target,
    load_eagle3,
    save_eagle3,
)
from polydraft.train.eagle3 import Unroll, target_pass


def tiny(family: str, layers: int = 6):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_feature_layer_i_is_the_stream_entering_layer_i(family):
    """vLLM's aux id i is the state entering decoder layer i, `hidden_states[i]` of transformers."""
    model = tiny(family)
    ids = torch.randint(0, 64, (2, 9))
    layers = [0, 2, 5]
    with torch.no_grad(), feature_capture(model, layers) as states:
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(states) == 3
    for got, i in zip(states, layers, strict=True):
        assert torch.equal(got, out.hidden_states[i]), i


def test_default_feature_layers_are_low_middle_high():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(24) == [2, 12, 21]


def test_draft_vocabulary_keeps_specials_and_bytes_then_the_most_frequent(tiny_tokenizer):
    kept = always_kept(tiny_tokenizer)
    assert set(tiny_tokenizer.all_special_ids) <= set(kept)
    assert len(byte_token_ids(tiny_tokenizer)) == 256  # a byte-level BPE: every byte has its symbol
    vocab = len(tiny_tokenizer)
    frequent = [t for t in range(vocab) if t not in kept][:5]
    counts = Counter({frequent[0]: 50, frequent[1]: 40, frequent[2]: 40, kept[0]: 1000})
    ids = draft_vocabulary(counts, len(kept) + 2, kept, vocab)
    assert ids == sorted(set(kept) | {frequent[0], frequent[1]})  # ties: the lower id
    assert coverage(counts, ids) == pytest.approx((50 + 40 + 1000) / 1130)
    with pytest.raises(ValueError, match="cannot hold the"):
        draft_vocabulary(counts, len(kept) - 1, kept, vocab)
    assert draft_vocabulary(counts, vocab + 5, kept, vocab) == list(range(vocab))


def test_the_saved_head_maps_draft_ids_to_target_ids_and_loads_back(tmp_path):
    target = tiny("llama")
    draft_ids = torch.tensor([0, 1, 2, 7, 9, 30, 63])
    head = head_for_target(target, draft_ids, [1, 3, 4])
    save_eagle3(
        head,
        tmp_path,
        verifier="t",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
        info={},
    )
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model.safetensors")
    assert (torch.arange(7) + weights["d2t"]).tolist() == draft_ids.tolist()  # target id = draft id + d2t
    assert weights["t2d"].nonzero().view(-1).tolist() == draft_ids.tolist()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["target_hidden_size"] == 32 and config["draft_vocab_size"] == 7
    loaded = load_eagle3(tmp_path)
    assert loaded.draft_ids.tolist() == draft_ids.tolist()
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # the lm head starts as the target's rows of the draft vocabulary
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[draft_ids])
    # a draft vocabulary that is the whole vocabulary saves no map (vLLM then has none to load)
    whole = head_for_target(target, torch.arange(64), [1, 3, 4])
    save_eagle3(
        whole, tmp_path / "whole", verifier="t", verifier_architectures=[], speculative_tokens=3, info={}
    )
    assert "d2t" not in load_file(tmp_path / "whole" / "model.safetensors")
    assert load_eagle3(tmp_path / "whole").draft_ids.tolist() == list(range(64))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_training_unroll_computes_what_the_decoder_drafts(family):
    """Teacher-forced over one sequence, step j of the training-time test at position i gives the logits
    the decoder gives at its (j+1)-th draft of a round that starts after token i + 1: same features, same
    tokens, same positions, same attention. A trainer and a decoder that disagree train one head and
    draft with another."""
    target = tiny(family)
    layers = [1, 3, 4]
    torch.manual_seed(1)
    head = head_for_target(target, torch.arange(0, 64, 3), layers).eval()
    with torch.no_grad():  # a random head barely departs from its input: make the layer matter
        for parameter in head.layers.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    ids = torch.randint(0, 64, (1, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    features, _, embeds = target_pass(target, batch, layers)
    steps = 3
    length = ids.shape[1]
    rows = [torch.ones(1, length, dtype=torch.bool) for _ in range(steps)]
    with torch.no_grad():
        trained = Unroll(head, steps)(features, embeds, rows, project=True)
    drafter = Eagle3Drafter(head, target.get_input_embeddings(), profile=False)
    for i in (0, 4, 7):
        drafter.reset()
        with torch.no_grad():
            logits, _ = drafter.read(ids[0, 1 : i + 2], features[0, : i + 1])
            for j in range(steps):
                expected = trained[j][i]  # step j at position i
                got = logits[head.draft_ids]
                assert torch.allclose(got, expected, atol=1e-4), (i, j, (got - expected).abs().max())
                if j + 1 < steps:
                    logits, _ = drafter.step(ids[0, i + j + 2 : i + j + 3])
