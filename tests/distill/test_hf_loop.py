"""The hf backend's generation loop (`distill.hf_backend.generate_rows`): transformers `generate`'s answers,
finished rows dropped from the batch as it goes, and sampling from the temperature- and top-p-processed
distribution."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import GenerationConfig, StaticCache

from polydraft.data.prompts import encode_prompt
from polydraft.decoding.sampling import Sampling, probabilities
from polydraft.distill.hf_backend import generate_rows


def left_padded(tokenizer, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generated(model, ids, mask, eos: list[int], new: int) -> list[list[int]]:
    """transformers `generate`'s greedy answers, each cut after its first EOS (the padding after it dropped)."""
    config = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=eos)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


def test_greedy_answers_are_generates_with_rows_ending_at_different_steps(monkeypatch):
    """The demo target's translations of prompts of different lengths, left-padded, end at different steps:
    every answer equals `generate`'s, and finished rows left the batch on the way."""
    from transformers import AutoModelForCausalLM

    from polydraft.models.loading import load_tokenizer
    from tests.vllm_setup import demo_prompts, demo_target

    model = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(demo_target()), None, False)
    ids, mask = left_padded(tokenizer, demo_prompts(tokenizer))
    eos = [tokenizer.eos_token_id]
    expected = generated(model, ids, mask, eos, 48)
    assert len({len(a) for a in expected}) >= 3, "the rows should end at different steps"

    compactions = []
    select = StaticCache.reorder_cache
    monkeypatch.setattr(StaticCache, "reorder_cache", lambda self, i: (compactions.append(len(i)), select(self, i)))  # fmt: skip
    answers = generate_rows(
        model, ids, mask, temperature=0.0, top_p=1.0, max_new_tokens=48, eos=set(eos), generator=None
    )
    assert answers == expected
    assert compactions and all(n < len(answers) for n in compactions), "finished rows should leave the batch"


def test_a_stop_string_ends_each_row_where_generate_ends_it():
    """The demo's answers are several lines: a stop string of a newline ends each at its first line, at the
    token `generate` ends it with, the ids of the rows that ended kept up to it."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.stopping_criteria import StopStringCriteria

    from polydraft.models.loading import load_tokenizer
    from tests.vllm_setup import demo_prompts, demo_target

    model = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(demo_target()), None, False)
    ids, mask = left_padded(tokenizer, demo_prompts(tokenizer))
    eos = [tokenizer.eos_token_id]
    config = GenerationConfig(
        do_sample=False, max_new_tokens=48, pad_token_id=0, eos_token_id=eos, stop_strings=["\n"]
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer
        )
    whole = generated(model, ids, mask, eos, 48)
    answers = generate_rows(
        model, ids, mask, temperature=0.0, top_p=1.0, max_new_tokens=48, eos=set(eos), generator=None,
        stop_criterion=StopStringCriteria(tokenizer, ["\n"]),
    )  # fmt: skip
    for answer, row, free in zip(answers, out[:, ids.shape[1] :].tolist(), whole, strict=True):
        assert answer == row[: len(answer)] and "\n" in tokenizer.decode(answer)
        assert len(answer) < len(free), "the stop string ended the row before its EOS"


def test_a_left_padded_row_reads_its_own_positions_with_absolute_position_embeddings(tiny_tokenizer):
    """GPT-2 adds a position embedding per position (RoPE models only see relative ones): the padded rows'
    answers equal `generate`'s only when each row counts its positions from its own first token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(50.0)  # positions that move the argmax
    prompts = [
        encode_prompt(tiny_tokenizer, f"USER: {t} ASSISTANT:")
        for t in ("Ja", "Guten Morgen, wie geht es dir")
    ]
    ids, mask = left_padded(tiny_tokenizer, prompts)
    expected = generated(model, ids, mask, [tiny_tokenizer.eos_token_id], 12)
    answers = generate_rows(
        model, ids, mask, temperature=0.0, top_p=1.0, max_new_tokens=12, eos={tiny_tokenizer.eos_token_id},
        generator=None,
    )  # fmt: skip
    assert answers == expected


def test_a_sliding_window_model_answers_as_generate_past_its_window(tiny_tokenizer):
    """A Mistral whose sliding window (6) is shorter than its prompts and answers: the static cache's sliding
    layers drop what leaves the window as `generate`'s cache does, rows ending at different steps."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=6, max_position_embeddings=128,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    prompts = [
        encode_prompt(tiny_tokenizer, f"USER: {t} ASSISTANT:")
        for t in ("Ja bitte", "Guten Morgen, wie geht es dir heute", "Danke")
    ]
    ids, mask = left_padded(tiny_tokenizer, prompts)
    eos = [tiny_tokenizer.eos_token_id]
    expected = generated(model, ids, mask, eos, 16)
    answers = generate_rows(
        model, ids, mask, temperature=0.0, top_p=1.0, max_new_tokens=16, eos=set(eos), generator=None
    )
    assert answers == expected
    whole = MistralForCausalLM(copy.deepcopy(config)).eval()
    whole.config.sliding_window = None
    whole.load_state_dict(model.state_dict())
    assert generated(whole, ids, mask, eos, 16) != expected, "without its window the model answers otherwise"


@pytest.fixture(scope="module")
def peaked(tiny_target):
    """The tiny target with its output head scaled: a next-token distribution with a few likely tokens,
    whose top-p cut and temperature matter."""
    model = copy.deepcopy(tiny_target)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.5)
    return model


def test_samples_follow_the_temperature_and_top_p_distribution(peaked, tiny_tokenizer):
    """4000 first tokens of one prompt at T=0.7, top-p 0.8, against the distribution computed apart
    (`decoding.sampling.probabilities` on the prompt's own logits): none outside the nucleus, and a chi-square
    test at level 1e-3 passes (a correct sampler fails it one time in 1000; the seed is fixed). The same
    counts reject the distribution without the temperature and the one without the top-p cut (p < 1e-3), so
    the test can tell them apart."""
    ids, mask = left_padded(tiny_tokenizer, [encode_prompt(tiny_tokenizer, "USER: Guten Morgen ASSISTANT:")])
    with torch.inference_mode():
        logits = peaked(input_ids=ids).logits[0, -1].double()
    draws = 4000
    answers = generate_rows(
        peaked, ids.repeat(draws, 1), mask.repeat(draws, 1), temperature=0.7, top_p=0.8, max_new_tokens=1,
        eos=set(), generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    counts = Counter(a[0] for a in answers)

    def p_value(sampling: Sampling) -> float:
        """Chi-square of the counts against `sampling`'s distribution, the tokens expected fewer than 5 times
        in one bin; 0 when a token outside its support was drawn."""
        exact = probabilities(logits, sampling)
        support = exact.nonzero().flatten().tolist()
        if any(token not in support for token in counts):
            return 0.0
        big = [t for t in support if draws * float(exact[t]) >= 5]
        rest = [t for t in support if t not in big]
        observed = [counts.get(t, 0) for t in big] + ([sum(counts.get(t, 0) for t in rest)] if rest else [])
        expected = [draws * float(exact[t]) for t in big] + (
            [draws * float(exact[rest].sum())] if rest else []
        )
        return float(chisquare(observed, expected).pvalue)

    exact = probabilities(logits, Sampling(0.7, 0.8))
    assert 0.1 < float(exact.max()) < 0.9, "no token is certain"
    assert set(counts) <= set(exact.nonzero().flatten().tolist())
    assert p_value(Sampling(0.7, 0.8)) > 1e-3
    assert p_value(Sampling(1.0, 0.8)) < 1e-3
    assert p_value(Sampling(0.7, 1.0)) < 1e-3
