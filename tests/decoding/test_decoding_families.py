"""Every decoder on every decoder-only family a recipe may name, each built tiny from its transformers config.

Llama, Gemma, Gemma 2, Gemma 3 (text-only `Gemma3ForCausalLM`), Qwen2, Qwen3, Mistral and Phi-3: at
temperature 0 every decoder's output is `ar`'s, token for token (and `ar`'s is the model's own greedy
output, checked against one full forward without a cache):

- `sd` with FixedK, Beta-TS and Cali-TS (an untrained calibration model as the predictor);
- `rsd_c` and `rsd_s` trees;
- `eesd` with each control, its early-exit drafter built on the loaded target (`from_target`) and also read
  from the family's saved checkpoint (`build_early_exit`, partial loading), which decodes exactly as the first;
  what it verifies against is the target's own logits, not only their argmax (Gemma 2's soft-capping);
- `bpd`, `bpd+rescore`, `medusa` and `medusa+rescore`, with heads fitted a few steps to the target;
- `eagle3` with FixedK and Beta-TS, an EAGLE-3 head on the target's three layers fitted a few steps by the
  trainer's own loss (vLLM serves EAGLE-3 heads for Llama and Qwen3 targets; polydraft decodes them on all).

The drafters agree with the target only partly (a copy with its last layer perturbed, an exit after the
first layer, heads fitted on one of the two prompts): every decoder must have rounds that accepted drafts
and rounds that rejected some, so that both the accepted and the rejected paths of each cache are used.

Sliding-window attention (Mistral, Gemma 2, Gemma 3, Qwen2 / Qwen3 with `use_sliding_window`, Phi-3 with
`sliding_window`): with a window of 7 the chain decoders (`sd`, `eesd`, `bpd`) produce 20 tokens, far
past it, still `ar`'s output, and every sliding-window cache layer keeps no more than its window needs; the
decoders that grow draft trees (`rsd_c`, `rsd_s`, `medusa`, `medusa+rescore`, and `bpd+rescore`, whose
drafter runs a beam search under a tree mask) refuse to go past the window with a message that says so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from polydraft.decoding.blockwise import HeadsDraft, Rescoring, blockwise_chain, blockwise_tree
from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
from polydraft.decoding.eesd import SelfSpeculative, self_speculative
from polydraft.decoding.engine import Generation, autoregressive
from polydraft.decoding.lattice import CandidateTree
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from polydraft.models.calibration import CalibrationModel
from polydraft.models.early_exit import build_early_exit, from_target
from polydraft.models.partial_load import decoder_parts
from tests.decoding_helpers import single_thread_fixture, spread
from tests.eagle3_setup import fit_eagle3
from tests.heads_setup import fit_heads

single_thread = single_thread_fixture()
VOCAB = 96
HIDDEN = 32
GREEDY = Sampling()
WIDE = 64
"""A sliding window that no output of the main test reaches (trees stay within it)."""
NARROW = 7
"""A sliding window that the long outputs pass by far."""
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build(family: str, window: int | None) -> torch.nn.Module:
    """A tiny causal LM of `family`; `window` is its sliding window (None: full attention where the family
    allows it). Gemma 2 and 3 alternate sliding and full layers; Qwen2 / Qwen3 slide from layer 1 on."""
    gemma = {"head_dim": HIDDEN // 4, "query_pre_attn_scalar": HIDDEN // 4}
    qwen = {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 1}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif family == "gemma":  # tied lm head, as Gemma's
        model = GemmaForCausalLM(GemmaConfig(**COMMON, head_dim=HIDDEN // 4))
    elif family == "gemma2":  # final logit soft-capping 30, attention soft-capping 50 (the defaults)
        # untied: a tied head on Gemma 2's large scaled embeddings makes a random tiny model repeat one token
        model = Gemma2ForCausalLM(
            Gemma2Config(**COMMON, **gemma, sliding_window=window, tie_word_embeddings=False)
        )
    elif family == "gemma3":
        config = Gemma3TextConfig(
            **COMMON, **gemma, sliding_window=window, layer_types=SLIDING, tie_word_embeddings=False
        )
        model = Gemma3ForCausalLM(config)
    elif family == "qwen2":  # attention biases
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, **qwen))
    elif family == "qwen3":  # q/k norms
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, **qwen, head_dim=HIDDEN // 4))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=window))
    elif family == "phi3":  # fused qkv and gate-up projections
        model = Phi3ForCausalLM(
            Phi3Config(**COMMON, sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        )
    else:
        raise ValueError(family)
    return model.eval()


SEEDS = {"llama": 0, "gemma": 1, "gemma2": 2, "gemma3": 12, "qwen2": 4, "qwen3": 5, "mistral": 6, "phi3": 7}
FAMILIES = list(SEEDS)
MAIN_WINDOW = {"gemma2": WIDE, "gemma3": WIDE, "mistral": WIDE}
"""Families whose checkpoints have a sliding window (Gemma 2 and 3 always, Mistral 7B v0.1) keep a wide one here."""
SLIDING_FAMILIES = ["mistral", "gemma2", "gemma3", "qwen2", "qwen3", "phi3"]


def target_model(family: str, window: int | None) -> torch.nn.Module:
    """The family's tiny model with larger weights than the init's (varied greedy outputs)."""
    torch.manual_seed(SEEDS[family])
    return spread(build(family, window), 0.5, SEEDS[family])


def noisy_copy(model: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """A drafter that agrees with `model` part of the time: its last decoder layer perturbed."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in decoder_parts(drafter).layers[-1].parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return drafter


def cali_ts(seed: int, max_length: int = 4) -> CaliTS:
    """Cali-TS with an untrained calibration model, which checks the hidden states it is handed."""
    torch.manual_seed(seed)
    calibration = CalibrationModel(HIDDEN, HIDDEN).eval()

    def predict(step: int, target_hidden: torch.Tensor, draft_hidden: torch.Tensor) -> float:
        assert target_hidden.shape == draft_hidden.shape == (HIDDEN,) and step >= 1
        return calibration.predict(step, target_hidden, draft_hidden)

    return CaliTS(0.2, 0.3, 0.5, predict, max_length, seed)


CONTROLS = {
    "fixed": lambda seed: FixedK(3),
    "beta_ts": lambda seed: BetaTS(1.0, 1.0, 4, seed),
    "cali_ts": cali_ts,
}
TREES = {"rsd_c": TreeShape.constant([2, 2, 1]), "rsd_s": TreeShape.beam(2, 3)}
MEDUSA_TREE = CandidateTree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
NUM_HEADS = 3
AUX_LAYERS = [0, 1, 2]
"""The EAGLE-3 head's feature layers on these 3-layer models (low, middle, high)."""


def greedy_reference(
    model: torch.nn.Module, target: CachedLM, prompt: torch.Tensor, max_new: int
) -> list[int]:
    """`ar`'s tokens, checked against the model's own argmaxes in one forward over prompt + output."""
    tokens = autoregressive(target, prompt, max_new, GREEDY, torch.Generator(), set()).tokens
    with torch.inference_mode():
        logits = model(torch.cat([prompt, torch.tensor(tokens)]).view(1, -1)).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
    assert len(set(tokens)) >= 5, tokens  # varied: a repeated token would make agreement trivial
    return tokens


def tally(counts: dict[str, list[int]], name: str, gen: Generation) -> None:
    """Rounds that accepted drafts, and rounds that rejected some (the last round, cut by the length
    limit, is not counted as a rejection)."""
    accepted, rejected = counts.setdefault(name, [0, 0])
    for index, r in enumerate(gen.rounds):
        accepted += r.accepted > 0
        rejected += r.draft_length > 0 and r.accepted < r.draft_length and index < len(gen.rounds) - 1
    counts[name] = [accepted, rejected]


def fitted_heads(model: torch.nn.Module, target: CachedLM, sequence: torch.Tensor) -> dict[str, object]:
    """Medusa and BPD heads, and an EAGLE-3 head, fitted to `sequence`."""
    heads: dict[str, object] = {
        kind: HeadsDraft(fit_heads(model, kind, NUM_HEADS, [sequence], steps=10), target)
        for kind in ("bpd", "medusa")
    }
    eagle3 = fit_eagle3(model, AUX_LAYERS, [sequence], steps=30)
    heads["eagle3"] = Eagle3Drafter(eagle3, model.get_input_embeddings())
    return heads


def chain_decoders(model, tmp_path, target, drafter, heads) -> tuple[dict, list]:
    """Name -> decode(prompt, max_new, seed) for the chain decoders (`sd`, `eesd`, `bpd`), and every object
    whose `cache` they decode on."""
    model.save_pretrained(tmp_path)
    built = SelfSpeculative(model, from_target(model, 1, 1))
    loaded = SelfSpeculative(model, build_early_exit(str(tmp_path), 1, 1))
    decoders = {}
    for name, make in CONTROLS.items():
        decoders[f"sd-{name}"] = lambda p, n, s, make=make: speculative(
            target, drafter, p, n, GREEDY, make(s), torch.Generator(), set()
        )
        for source, pair in (("from_target", built), ("build_early_exit", loaded)):
            decoders[f"eesd-{source}-{name}"] = lambda p, n, s, make=make, pair=pair: self_speculative(
                pair, p, n, GREEDY, make(s), torch.Generator(), set()
            )
    decoders["bpd"] = lambda p, n, s: blockwise_chain(
        target, heads["bpd"], p, n, GREEDY, torch.Generator(), set()
    )
    featured = CachedLM(model, aux_layers=AUX_LAYERS)  # the target, returning the head's features too
    for name in ("fixed", "beta_ts"):
        decoders[f"eagle3-{name}"] = lambda p, n, s, make=CONTROLS[name]: eagle3_decode(
            featured, heads["eagle3"], p, n, GREEDY, make(s), torch.Generator(), set()
        )
    return decoders, [target, drafter, built, loaded, featured]


def tree_decoders(target, drafter, heads) -> dict:
    """Name -> decode(prompt, max_new, seed) for the decoders that grow draft trees: `rsd_c`, `rsd_s`, `medusa`,
    `medusa+rescore`, and `bpd+rescore`, a chain drafted by a beam search over the drafter-rescored lattice."""
    decoders = {
        name: lambda p, n, s, shape=shape: recursive_speculative(
            target, drafter, p, n, GREEDY, shape, torch.Generator(), set()
        )
        for name, shape in TREES.items()
    }
    decoders["medusa"] = lambda p, n, s: blockwise_tree(
        target, heads["medusa"], p, n, GREEDY, torch.Generator(), set(), MEDUSA_TREE
    )
    rescoring = Rescoring(drafter, 0.5, 3, 2)
    decoders["medusa+rescore"] = lambda p, n, s: blockwise_tree(
        target, heads["medusa"], p, n, GREEDY, torch.Generator(), set(), rescoring=rescoring
    )
    decoders["bpd+rescore"] = lambda p, n, s: blockwise_chain(
        target, heads["bpd"], p, n, GREEDY, torch.Generator(), set(), rescoring
    )
    return decoders


def decode_all(
    family: str, decoders: dict, prompts: list, references: list, max_new: int, check=None
) -> None:
    """Every decoder's output is `ar`'s on every prompt; each decoder accepted drafts in some rounds and
    rejected some in others; the early-exit drafter read from the checkpoint decodes as the one built on
    the target (same rounds). `check()` runs after each decode."""
    counts: dict[str, list[int]] = {}
    for seed, (prompt, expected) in enumerate(zip(prompts, references, strict=True)):
        generations = {}
        for name, decode in decoders.items():
            gen = decode(prompt, max_new, seed)
            assert gen.tokens == expected, (family, name, seed)
            assert gen.target_calls == len(gen.rounds), (family, name)
            tally(counts, name, gen)
            generations[name] = gen
            if check is not None:
                check()
        for name, gen in generations.items():
            if name.startswith("eesd-build_early_exit"):
                assert gen.rounds == generations[name.replace("build_early_exit", "from_target")].rounds, name
    assert all(accepted > 0 and rejected > 0 for accepted, rejected in counts.values()), (family, counts)


def prompts_and_references(model, target, lengths: list[int], max_new: int):
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(i))
        for i, n in enumerate(lengths)
    ]
    return prompts, [greedy_reference(model, target, p, max_new) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decoder_is_ar_on_every_family(family, tmp_path):
    model = target_model(family, MAIN_WINDOW.get(family))
    target, drafter = CachedLM(model), CachedLM(noisy_copy(model))
    prompts, references = prompts_and_references(model, target, [4, 7], 16)
    # heads fitted to the first output only: the second prompt's drafts are partly rejected
    heads = fitted_heads(model, target, torch.cat([prompts[0], torch.tensor(references[0])]))
    decoders, _ = chain_decoders(model, tmp_path, target, drafter, heads)
    decode_all(family, decoders | tree_decoders(target, drafter, heads), prompts, references, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_eesd_verifies_with_the_targets_own_logits(family, tmp_path):
    """What `eesd` verifies against is the target's distribution, not only its argmax (sampling relies on
    it): its logits equal the model's own (Gemma 2's final soft-capping included), with the shared layers
    of a drafter built on the target and of one read from the checkpoint."""
    model = target_model(family, MAIN_WINDOW.get(family))
    model.save_pretrained(tmp_path)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected, _ = CachedLM(model).forward(prompt, 9)
        for drafter in (from_target(model, 1, 1), build_early_exit(str(tmp_path), 1, 1)):
            pair = SelfSpeculative(model, drafter)
            logits, _ = pair.verify(prompt, 9)
            assert torch.allclose(logits, expected, atol=1e-5), (
                family,
                float((logits - expected).abs().max()),
            )


def held_states(cache) -> int:
    """The most positions any sliding-window layer of `cache` holds."""
    return max(
        (layer.keys.shape[-2] for layer in cache.layers if layer.is_sliding and layer.is_initialized),
        default=0,
    )


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_chains_run_far_past_the_sliding_window(family, tmp_path):
    model = target_model(family, NARROW)
    target, drafter = CachedLM(model), CachedLM(noisy_copy(model))
    assert target.window == NARROW
    max_new = 20  # the sequences end at 25 positions, more than three windows
    prompts, references = prompts_and_references(model, target, [5, 5], max_new)
    heads = fitted_heads(model, target, torch.cat([prompts[0], torch.tensor(references[0])]))
    decoders, holders = chain_decoders(model, tmp_path, target, drafter, heads)

    def bounded() -> None:  # after decoding, sliding-window layers hold only what their window needs
        assert all(held_states(holder.cache) <= NARROW - 1 for holder in holders)

    decode_all(family, decoders, prompts, references, max_new, bounded)
    for name, decode in tree_decoders(target, drafter, heads).items():
        with pytest.raises(NotImplementedError, match=f"within the models' sliding window \\({NARROW}\\)"):
            decode(prompts[0], max_new, 0)
            pytest.fail(f"{family}: {name} decoded past the sliding window")
