"""The engine beyond Llama: sliding-window attention (Mistral), logit soft-capping (Gemma 2), GPT-2."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
)

from polydraft.decoding.control import FixedK
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from tests.decoding_helpers import single_thread_fixture, spread

single_thread = single_thread_fixture()
VOCAB = 96
GREEDY = Sampling()


def noisy_copy(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """A drafter that agrees with `model` part of the time."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in list(drafter.parameters())[-8:]:
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return drafter


def mistral(window: int) -> torch.nn.Module:
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, sliding_window=window,
                           tie_word_embeddings=False)  # fmt: skip
    return spread(MistralForCausalLM(config).eval(), 0.2, 0)


def gemma2() -> torch.nn.Module:
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=512,
                          final_logit_softcapping=0.5, tie_word_embeddings=False)  # fmt: skip
    return spread(Gemma2ForCausalLM(config).eval(), 0.2, 0)


def gpt2() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
    )
    return spread(GPT2LMHeadModel(config).eval(), 0.2, 0)


@pytest.mark.parametrize("build", [lambda: mistral(512), gemma2, gpt2], ids=["mistral", "gemma2", "gpt2"])
def test_greedy_lossless_on_other_architectures(build):
    target = build()
    target_lm, drafter_lm = CachedLM(target), CachedLM(noisy_copy(target))
    calls = 0
    for seed in range(3):
        prompt = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(seed))
        reference = autoregressive(target_lm, prompt, 16, GREEDY, torch.Generator(), set())
        chain = speculative(target_lm, drafter_lm, prompt, 16, GREEDY, FixedK(3), torch.Generator(), set())
        tree = recursive_speculative(
            target_lm, drafter_lm, prompt, 16, GREEDY, TreeShape.beam(3, 3), torch.Generator(), set()
        )
        assert chain.tokens == reference.tokens and tree.tokens == reference.tokens
        calls += chain.target_calls
    assert calls < 3 * 16  # drafts were accepted


def test_soft_capped_logits_are_the_models_own():
    target = gemma2()
    prompt = torch.arange(3, 9)
    with torch.inference_mode():
        expected = target(prompt.view(1, -1)).logits[0, -1]
        logits, _ = CachedLM(target).forward(prompt.view(1, -1))
    assert expected.abs().max() <= 0.5 and torch.allclose(logits[0], expected, atol=1e-6)


def test_sliding_window_speculation_past_the_window():
    """Rejected drafts are cropped from sliding-window layers even after the window filled up; trees,
    which need every position under their mask, refuse to go past the window with a clear message."""
    target = mistral(window=6)
    target_lm, drafter_lm = CachedLM(target), CachedLM(noisy_copy(target))
    rejected = 0
    for seed in range(3):
        prompt = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(seed))
        reference = autoregressive(target_lm, prompt, 20, GREEDY, torch.Generator(), set())
        chain = speculative(target_lm, drafter_lm, prompt, 20, GREEDY, FixedK(3), torch.Generator(), set())
        assert chain.tokens == reference.tokens
        rejected += sum(r.drafted - r.accepted for r in chain.rounds)
    assert rejected > 0
    with pytest.raises(NotImplementedError, match="sliding window"):
        recursive_speculative(
            target_lm, drafter_lm, prompt, 20, GREEDY, TreeShape.beam(2, 2), torch.Generator(), set()
        )
