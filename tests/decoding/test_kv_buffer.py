"""`decoding.kv_buffer`: the shared-buffer cache gives the logits HF's `DynamicLayer` cache gives, bit for
bit, through forwards, tree keeps, crops and growth past its first capacity."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from polydraft.decoding.kv_buffer import FIRST_CAPACITY, BufferLayer
from polydraft.decoding.lm import CachedLM


def _pair():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    buffered, reference = CachedLM(model), CachedLM(model)
    # the reference runs on HF's own layers: its keep takes the per-layer path
    reference.cache = reference.kv.cache = DynamicCache(config=config)
    reference.kv.packed = True
    return buffered, reference


def _steps(lm: CachedLM, ids: torch.Tensor) -> list[torch.Tensor]:
    logits = []
    with torch.no_grad():
        logits.append(lm.forward(ids[:, :10])[0])
        logits.append(lm.forward(ids[:, 10:15], num_logits=5)[0])
        lm.keep(10, [1, 3])
        logits.append(lm.forward(ids[:, 15:17], num_logits=2)[0])
        lm.keep(12, [0, 1])
        logits.append(lm.forward(ids[:, 17:21], num_logits=4)[0])
        lm.keep(14, [0, 2, 3])
        lm.crop(12)
        logits.append(lm.forward(ids[:, 21:22])[0])
        # past the first capacity: the group grows and keeps what it held
        logits.append(lm.forward(ids[:, 22 : 22 + FIRST_CAPACITY + 40], num_logits=3)[0])
        logits.append(lm.forward(ids[:, -1:])[0])
    return logits


def test_buffered_cache_matches_dynamic_layers_bit_for_bit():
    buffered, reference = _pair()
    ids = torch.randint(0, 50, (1, FIRST_CAPACITY + 80))
    got, want = _steps(buffered, ids), _steps(reference, ids)
    assert all(type(layer) is BufferLayer for layer in buffered.cache.layers)
    assert buffered.kv.groups[0].buffers[0].shape[-2] > FIRST_CAPACITY
    assert buffered.length == reference.length == 12 + 1 + FIRST_CAPACITY + 40 + 1
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item()}"


def test_one_group_holds_every_full_attention_layer():
    buffered, _ = _pair()
    with torch.no_grad():
        buffered.forward(torch.tensor([[1, 2, 3]]))
    (group,) = buffered.kv.groups
    assert group.layers == buffered.cache.layers
    assert group.buffers[0].shape == (3, 1, 2, FIRST_CAPACITY, 8)
    assert torch.equal(buffered.cache.layers[1].keys, group.buffers[0][1, ..., :3, :])


def test_a_layer_refuses_a_second_forward_or_a_crop_before_it_is_packed():
    layer, states = BufferLayer(), torch.zeros(1, 2, 3, 8)
    layer.update(states, states)
    with pytest.raises(RuntimeError, match="one forward before"):
        layer.update(states, states)
    with pytest.raises(RuntimeError, match="cropped only after"):
        layer.crop(-1)
