"""The study's variants of seed 001's controls (issue 39): Beta-TS counted by Alg. 2's formulas as written,
Cali-TS without sampling or without model prediction (Table 4's ablations), and the first round's drafts
each prompt result records."""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.control import BetaTS, CaliTS, chi_counts, chi_counts_literal
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.results import prompt_results
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.pipelines.schema.measure import MeasureConfig
from tests.decoding_helpers import single_thread_fixture, tiny_pair

single_thread = single_thread_fixture()
VOCAB = 96
K = 4


def test_the_literal_counts_charge_two_failures_per_rejection_but_at_the_last_draft():
    # r = |Q_v| - 1, n = min(|Q_v| + 1, K) with Q_v the A + 1 tokens a round adds
    assert chi_counts_literal(4, 4) == (4, 4)  # all accepted: no failure, as in the reading
    assert chi_counts_literal(4, 3) == (3, 4)  # rejected at the last draft: one failure
    assert chi_counts_literal(4, 1) == (1, 3) and chi_counts(4, 1) == (1, 2)  # two against one
    assert chi_counts_literal(3, 0) == (0, 2) and chi_counts_literal(1, 0) == (0, 1)
    control = BetaTS(1.0, 2.0, 10, 0, literal=True)
    control.start()
    for drafted, accepted in [(4, 4), (4, 1), (3, 0)]:
        control.update(drafted, accepted)
    assert (control.alpha, control.beta) == (1 + 4 + 1 + 0, 2 + 0 + 2 + 2)
    with pytest.raises(ValueError, match="0..drafted"):
        chi_counts_literal(2, 3)


def test_cali_ts_ablations_draw_from_one_source_each():
    seen = []

    def predict(step, target_hidden, draft_hidden):
        seen.append(step)
        return 0.9

    model = CaliTS(0.1, 0.5, 0.5, predict, 10, 0, use="model")
    model.theta_hat, model.verifications = 0.1, 50  # observations are left out
    assert model.posterior(0.9) == (0.9, pytest.approx(0.01))
    sampling = CaliTS(0.1, 0.5, 0.5, None, 10, 0, use="sampling")
    assert not sampling.needs_target_hidden and model.needs_target_hidden
    sampling.update(4, 1)  # theta_hat = (0.5 * 1 + 1) / (2 + 1); one verification
    assert sampling.posterior(0.9) == (pytest.approx(0.5), pytest.approx(0.25))
    sampling.update(4, 4)
    assert sampling.posterior(0.0)[1] == pytest.approx(0.25 / 2)
    sampling.begin_round(None)  # no target state needed: it decides at once, in the first round too
    assert isinstance(sampling.keep_drafting(1, torch.zeros(4)), bool) and not sampling.deferred
    with pytest.raises(ValueError, match="needs a calibration model"):
        CaliTS(0.1, 0.5, 0.5, None, 10, 0, use="model")


def test_the_first_rounds_drafts_are_recorded_per_prompt():
    """Cali-TS drafts to its cap in the first round (theta_M = 0 then stops after one draft each later
    round); without model prediction it decides as it drafts."""
    target, drafters = tiny_pair(VOCAB)
    prompt = torch.arange(6) % VOCAB
    runs = {}
    for name, control in {
        "cali": CaliTS(1e-9, 1.0, 0.0, lambda i, t, d: 0.0, K, 0),
        "sampling": CaliTS(1e-9, 1e-9, 0.0, None, K, 0, use="sampling"),
    }.items():
        gen = speculative(
            CachedLM(target),
            CachedLM(drafters["noisy"]),
            prompt,
            10,
            Sampling(),
            control,
            torch.Generator(),
            set(),
        )
        runs[name] = prompt_results([gen])[0]
    assert runs["cali"].first_round_drafted == K
    assert runs["sampling"].first_round_drafted <= 1  # theta_hat 0, sigma ~0: stops at once


def test_cali_ts_ablations_need_cali_ts_beside_them():
    MeasureConfig(controls=["fixed", "cali_ts", "cali_ts_model", "cali_ts_sampling", "beta_ts_literal"])
    for ablation in ("cali_ts_model", "cali_ts_sampling"):
        with pytest.raises(ValueError, match="list cali_ts too"):
            MeasureConfig(controls=["fixed", ablation])
