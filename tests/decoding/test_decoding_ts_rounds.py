"""Cali-TS as seed 001 Alg. 3 runs it: no target call beyond the rounds (the first round's H_t^(T) comes
from the call that verifies its drafts), and a calibration model trained on every step it may take."""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.control import CaliTS, FixedK
from polydraft.decoding.eesd import SelfSpeculative, self_speculative
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.models.calibration import CalibrationModel, check_covers
from polydraft.models.early_exit import from_target
from polydraft.pipelines.run.recipe import RecipeError, load_recipe
from tests.decoding_helpers import single_thread_fixture, tiny_pair

single_thread = single_thread_fixture()
VOCAB = 96
GREEDY = Sampling()
K = 4


@pytest.fixture(scope="module")
def pair():
    target, drafters = tiny_pair(VOCAB)
    return target, drafters["noisy"]


def always_on(states: list[torch.Tensor]) -> CaliTS:
    """Cali-TS whose chi is always 1 (theta_M = 1, sigma_M ~0 so mu = theta_M), recording each round's target state."""

    def predict(step, target_hidden, draft_hidden):
        if step == 1:
            states.append(target_hidden.clone())
        return 1.0

    return CaliTS(1e-9, 1.0, 1.0, predict, K, 0)


def test_cali_ts_makes_no_target_call_beyond_fixed_k(pair):
    """A Cali-TS that always drafts on is FixedK(K): the same rounds and the same number of target calls
    (one per round), for `sd` and `eesd`; its first round reads the target state that produced the
    prompt's last token (position n-2), computed by that round's own verification."""
    target, drafter = pair
    target_lm, drafter_lm = CachedLM(target), CachedLM(drafter)
    self_spec = SelfSpeculative(target, from_target(target, 2, 1))
    prompts = torch.Generator().manual_seed(3)
    for length in (2, 5, 11):
        prompt = torch.randint(0, VOCAB, (length,), generator=prompts)
        reference = CachedLM(target)
        _, hidden = reference.forward(prompt.view(1, -1), num_logits=2)
        for name in ("sd", "eesd"):
            runs = {}
            states: list[torch.Tensor] = []
            for control in (FixedK(K), always_on(states)):
                if name == "sd":
                    gen = speculative(
                        target_lm, drafter_lm, prompt, 12, GREEDY, control, torch.Generator(), set()
                    )
                else:
                    gen = self_speculative(self_spec, prompt, 12, GREEDY, control, torch.Generator(), set())
                runs[type(control).__name__] = gen
                assert gen.target_calls == len(gen.rounds)
            fixed, cali = runs["FixedK"], runs["CaliTS"]
            assert cali.tokens == fixed.tokens and cali.rounds == fixed.rounds, (name, length)
            assert cali.target_calls == fixed.target_calls and cali.rounds[0].drafted == K
            assert torch.allclose(states[0], hidden[0], atol=1e-5), (name, length)


def test_first_round_verifies_only_the_drafts_before_the_stop(pair):
    """theta_M = 0 stops after the first draft: the first round drafts up to the cap but verifies one
    draft (`Round.drafted` counts the K sent); every later round drafts one token."""
    target, drafter = pair
    control = CaliTS(1e-9, 1.0, 0.0, lambda i, t, d: 0.0, K, 0)
    prompt = torch.arange(6) % VOCAB
    gen = speculative(
        CachedLM(target), CachedLM(drafter), prompt, 10, GREEDY, control, torch.Generator(), set()
    )
    assert gen.rounds[0].draft_length == 1 and gen.rounds[0].drafted == K
    assert all(r.draft_length == r.drafted <= 1 for r in gen.rounds[1:])
    assert gen.target_calls == len(gen.rounds)


def test_a_calibration_model_must_cover_every_draft_step(tmp_path):
    model = CalibrationModel(8, 8)
    model.save(tmp_path / "five", extra={"draft_length": 5})
    model.save(tmp_path / "ten", extra={"draft_length": 10})
    check_covers(tmp_path / "ten", 10)
    check_covers(tmp_path / "five", 5)
    with pytest.raises(ValueError, match=r"trained on draft steps 1..5, but Cali-TS may draft 10"):
        check_covers(tmp_path / "five", 10)


def test_recipe_ties_calibrate_draft_length_to_cali_ts_cap(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("target: {path: org/m}\ndata: {pairs: [de-en]}\ncalibrate: {draft_length: 6}\n")
    assert load_recipe(path, ["measure.controls=[fixed, cali_ts]", "measure.max_draft_length=6"])
    assert load_recipe(path, ["measure.max_draft_length=12"])  # no Cali-TS measured
    with pytest.raises(RecipeError, match=r"calibrate.draft_length.*every step"):
        load_recipe(path, ["measure.controls=[fixed, cali_ts]", "measure.max_draft_length=8"])
