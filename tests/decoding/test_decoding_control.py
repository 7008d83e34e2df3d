"""Beta-TS and Cali-TS parameter updates against values computed by hand for a given acceptance sequence."""

from __future__ import annotations

import math

import pytest
import torch

from polydraft.decoding.control import BetaTS, CaliTS, FixedK, chi_counts

# (drafted K, accepted A) per round
ROUNDS = [(4, 4), (4, 1), (3, 0), (1, 0), (5, 4), (2, 2)]


def test_chi_counts_one_failure_per_rejection():
    # seed 001 §3.3 read as: r = accepted drafts, n = validated drafts (the accepted ones and the first
    # rejected one; "subsequent tokens are not considered")
    assert chi_counts(4, 4) == (4, 4)  # all accepted: no failure observed
    assert chi_counts(4, 3) == (3, 4)  # one failure
    assert chi_counts(4, 1) == (1, 2)
    assert chi_counts(3, 0) == (0, 1)
    assert chi_counts(1, 0) == (0, 1)
    assert chi_counts(1, 1) == (1, 1)
    for drafted in range(1, 11):
        for accepted in range(drafted + 1):
            r, n = chi_counts(drafted, accepted)
            assert (r, n - r) == (accepted, int(accepted < drafted))
    with pytest.raises(ValueError, match="0..drafted"):
        chi_counts(2, 3)


def test_beta_ts_updates_by_hand():
    control = BetaTS(alpha0=1.0, beta0=2.0, max_length=10, seed=0)
    control.start()
    # alpha += A, beta += 1 when A < K:
    # (4,4) -> (5, 2); (4,1) -> (6, 3); (3,0) -> (6, 4); (1,0) -> (6, 5); (5,4) -> (10, 6); (2,2) -> (12, 6)
    expected = [(5, 2), (6, 3), (6, 4), (6, 5), (10, 6), (12, 6)]
    for (drafted, accepted), (alpha, beta) in zip(ROUNDS, expected, strict=True):
        control.update(drafted, accepted)
        assert (control.alpha, control.beta) == (alpha, beta)
    control.start()
    assert (control.alpha, control.beta) == (1.0, 2.0)


def test_beta_ts_draws_follow_the_posterior():
    """keep_drafting is Bernoulli(theta), theta ~ Beta(alpha, beta): its rate is alpha / (alpha + beta)."""
    control = BetaTS(alpha0=1.0, beta0=1.0, max_length=10, seed=0)
    control.alpha, control.beta = 9.0, 1.0
    rate = sum(control.keep_drafting(1, torch.zeros(1)) for _ in range(4000)) / 4000
    assert abs(rate - 0.9) < 0.03
    control.alpha, control.beta = 1.0, 9.0
    rate = sum(control.keep_drafting(1, torch.zeros(1)) for _ in range(4000)) / 4000
    assert abs(rate - 0.1) < 0.03


def test_cali_ts_updates_and_posterior_by_hand():
    seen = []

    def predict(step, target_hidden, draft_hidden):
        seen.append((step, target_hidden.tolist(), draft_hidden.tolist()))
        return 0.8

    sigma_m, sigma_s, theta0 = 0.2, 0.5, 0.6
    control = CaliTS(sigma_m, sigma_s, theta0, predict, max_length=8, seed=0)
    # before any verification n = 0: mu = theta_M, sigma^2 = sigma_M^2
    mu, variance = control.posterior(0.8)
    assert math.isclose(mu, 0.8) and math.isclose(variance, 0.04)
    # theta_hat = (theta_hat (m + 1) + r) / (m + n + 1), m += n, with (r, n) from chi_counts
    theta_hat, m = theta0, 0
    for count, (drafted, accepted) in enumerate(ROUNDS, start=1):
        control.update(drafted, accepted)
        r, n = chi_counts(drafted, accepted)
        theta_hat, m = (theta_hat * (m + 1) + r) / (m + n + 1), m + n
        assert math.isclose(control.theta_hat, theta_hat) and control.trials == m
        assert control.verifications == count
    # by hand for the first rounds: (4,4): (0.6*1 + 4)/5 = 0.92; (4,1): (0.92*5 + 1)/7 = 0.8
    first = CaliTS(sigma_m, sigma_s, theta0, predict, 8, 0)
    first.update(4, 4)
    assert math.isclose(first.theta_hat, 0.92)
    first.update(4, 1)
    assert math.isclose(first.theta_hat, 0.8) and first.trials == 6
    # after n = 6 verifications: mu = (s_S^2 theta_M + n s_M^2 theta_hat) / (n s_M^2 + s_S^2)
    mu, variance = control.posterior(0.8)
    assert math.isclose(mu, (0.25 * 0.8 + 6 * 0.04 * theta_hat) / (6 * 0.04 + 0.25))
    assert math.isclose(variance, 0.04 * 0.25 / (0.25 + 6 * 0.04))
    # the predictor gets the step and both hidden states
    control.begin_round(torch.tensor([1.0, 2.0]))
    control.keep_drafting(3, torch.tensor([3.0]))
    assert seen == [(3, [1.0, 2.0], [3.0])]
    control.start()
    assert (control.theta_hat, control.trials, control.verifications) == (theta0, 0, 0)


def test_cali_ts_first_round_draws_wait_for_the_target_state():
    """Without a target state the draws are deferred; `settle` then makes them in order, as a round with
    the state would have made them while drafting (same seed, same stop)."""
    seen = []

    def predict(step, target_hidden, draft_hidden):
        seen.append((step, target_hidden.tolist()))
        return float(draft_hidden[0])

    hiddens = [torch.tensor([p]) for p in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)]
    state = torch.tensor([2.0])
    for seed in range(20):
        deferred = CaliTS(0.2, 0.3, 0.5, predict, 8, seed)
        deferred.begin_round(None)
        assert all(deferred.keep_drafting(i, h) for i, h in enumerate(hiddens, start=1))  # drafts on
        assert seen == []
        stop = deferred.settle(state, len(hiddens) + 1)
        assert {tuple(s) for _, s in seen} == {(2.0,)} and [i for i, _ in seen] == list(
            range(1, len(seen) + 1)
        )
        seen.clear()
        live = CaliTS(0.2, 0.3, 0.5, predict, 8, seed)
        live.begin_round(state)
        expected = next(
            (i for i, h in enumerate(hiddens, start=1) if not live.keep_drafting(i, h)), len(hiddens) + 1
        )
        seen.clear()
        assert stop == expected
    with pytest.raises(RuntimeError, match="deferred draws"):
        deferred.settle(state, 3)


def test_bad_hyperparameters_are_errors():
    with pytest.raises(ValueError, match="K must be >= 1"):
        FixedK(0)
    with pytest.raises(ValueError, match="alpha0"):
        BetaTS(0.0, 1.0, 5, 0)
    with pytest.raises(ValueError, match="sigma_M"):
        CaliTS(0.0, 1.0, 0.5, lambda i, t, d: 0.5, 5, 0)
