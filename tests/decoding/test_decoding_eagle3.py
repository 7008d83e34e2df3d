"""`eagle3` at temperature 0 is `ar`, token for token, whatever the draft length, its control, the prompt and
length limits, an EOS, and a draft vocabulary that leaves target tokens out; its rounds accept drafts.

(At temperature > 0 its exact output law is tested with the other decoders: tests/decoder_grid.py; on every
model family: tests/decoding/test_decoding_families.py; a planted cache bug: tests/decoding/test_decoding_mutations.py.)
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.control import BetaTS, FixedK
from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from tests.decoding.test_decoding_lossless import CASES, check_record
from tests.decoding_helpers import single_thread_fixture, tiny_pair
from tests.eagle3_setup import fit_eagle3

single_thread = single_thread_fixture()
VOCAB = 96
LAYERS = [1, 2, 3]
GREEDY = Sampling()
CONTROLS = {
    "k1": lambda seed: FixedK(1),
    "k3": lambda seed: FixedK(3),
    "k6": lambda seed: FixedK(6),
    "beta-ts": lambda seed: BetaTS(1.0, 1.0, 6, seed),
}


@pytest.fixture(scope="module")
def setup():
    """The tiny target with its features, and a head fitted to one of its outputs whose draft vocabulary
    leaves a third of the tokens out (drafts can never propose them)."""
    target_model, _ = tiny_pair(VOCAB)
    plain = CachedLM(target_model)
    prompt = torch.arange(3, 9)
    sequence = torch.cat(
        [prompt, torch.tensor(autoregressive(plain, prompt, 40, GREEDY, torch.Generator(), set()).tokens)]
    )
    draft_ids = torch.tensor([t for t in range(VOCAB) if t % 3 or t in sequence.tolist()])
    head = fit_eagle3(target_model, LAYERS, [sequence], steps=40, draft_ids=draft_ids)
    featured = CachedLM(target_model, aux_layers=LAYERS)
    return plain, featured, Eagle3Drafter(head, target_model.get_input_embeddings()), sequence


@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_output_is_ar_output(setup, control):
    plain, featured, drafter, sequence = setup
    accepted = 0
    for seed, (length, max_new) in enumerate(CASES):
        prompts = [
            sequence[:length],
            torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)),
        ]
        for prompt in prompts:
            expected = autoregressive(plain, prompt, max_new, GREEDY, torch.Generator(), set())
            got = eagle3_decode(
                featured, drafter, prompt, max_new, GREEDY, CONTROLS[control](seed), torch.Generator(), set()
            )
            assert got.tokens == expected.tokens, (control, length, max_new)
            check_record(got)
            accepted += sum(r.accepted for r in got.rounds)
            # an EOS taken from ar's own output ends both at the same token
            if len(expected.tokens) > 2:
                eos = {expected.tokens[len(expected.tokens) // 2]}
                stop = autoregressive(plain, prompt, max_new, GREEDY, torch.Generator(), eos)
                got = eagle3_decode(
                    featured,
                    drafter,
                    prompt,
                    max_new,
                    GREEDY,
                    CONTROLS[control](seed),
                    torch.Generator(),
                    eos,
                )
                assert got.tokens == stop.tokens and got.stop == stop.stop == "eos"
    assert accepted > 0, "no draft was ever accepted: the head's path was never exercised"


def test_target_and_head_must_read_the_same_layers(setup):
    plain, _, drafter, sequence = setup
    other = CachedLM(plain.model, aux_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="feature layers"):
        eagle3_decode(other, drafter, sequence[:4], 4, GREEDY, FixedK(2), torch.Generator(), set())
