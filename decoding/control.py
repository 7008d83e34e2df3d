"""Draft-length control for chain decoders (`sd`, `eesd`): fixed K, Beta-TS and Cali-TS (seed 001).

A controller is asked after each draft token whether to draft another one, and is told after each
verification how many of the drafted tokens the target accepted. The decoders also cap the number
of drafts per round by `max_length` and by the tokens left to generate.

Thompson sampling (seed 001 §3.3, App. A-B) treats "keep drafting" as a Bernoulli variable chi with
an unknown probability theta: after draft token i, sample theta from the posterior, then chi ~ B(theta),
and stop when chi = 0.

Reading of the seed's symbols used here. Q_d is the round's draft tokens, |Q_d| = K. Q_v is what the
round adds to the output, i.e. the accepted draft tokens plus the target's own token (the corrected or
bonus token), |Q_v| = A + 1: Alg. 1 advances t by |Q_v|, the output length. Then
- Beta-TS (Alg. 2, lines 18-21, exactly): r = |Q_v| - 1 = A, n = min(|Q_v| + 1, |Q_d|) = min(A + 2, K),
  alpha += r, beta += n - r. (Reading Q_v as the accepted drafts alone would give r = -1 when nothing
  is accepted, a negative pseudo-count.)
- Cali-TS (Alg. 3): mu = (sigma_S^2 theta_M + n sigma_M^2 theta_hat) / (n sigma_M^2 + sigma_S^2),
  sigma^2 = sigma_M^2 sigma_S^2 / (sigma_S^2 + n sigma_M^2), theta ~ N(mu, sigma^2), with n the number
  of verifications so far and theta_M the calibration model's prediction. theta_hat is "the observed
  sample mean of chi" (eq. 10): theta_hat = (theta_hat * (m + 1) + r) / (m + n_round + 1), m += n_round,
  where r and n_round are the successes and trials of chi observed in the round, counted as in
  Beta-TS, and theta_hat_0 weighs as one prior observation. Eq. 10 taken with t = tokens generated
  counts every token as a success, so theta_hat would tend to 1 whatever is accepted; counting chi
  trials keeps it the mean of chi it is defined to be.

The calibration model plugs in as `predict(step, target_hidden, draft_hidden) -> float` (seed 001 eq. 5):
- `step`: i, the 1-based index of the draft token just produced in this round;
- `target_hidden` [H_target]: the target's lm_head input (final-norm output) at the position whose
  logits gave the last committed token, i.e. the state the round starts from (H_t^(T));
- `draft_hidden` [H_draft]: the drafter's lm_head input at the position whose logits gave draft token i
  (H_{t+i}^(D));
- returns theta_M in [0, 1], the predicted probability that drafting should continue.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from torch import Tensor

Predictor = Callable[[int, Tensor, Tensor], float]


class FixedK:
    """Always K draft tokens (fewer only at the end of the output)."""

    needs_target_hidden = False

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"draft length K must be >= 1, got {k}")
        self.max_length = k

    def start(self) -> None:
        pass

    def begin_round(self, target_hidden: Tensor | None) -> None:
        pass

    def keep_drafting(self, step: int, draft_hidden: Tensor) -> bool:
        return True

    def update(self, drafted: int, accepted: int) -> None:
        pass


def chi_counts(drafted: int, accepted: int) -> tuple[int, int]:
    """(r, n) of seed 001 Alg. 2 lines 18-19: successes and trials of chi observed in one round."""
    q_v = accepted + 1
    return q_v - 1, min(q_v + 1, drafted)


class BetaTS:
    """Thompson sampling with a Beta posterior (seed 001 Alg. 2), reset to the prior for each prompt."""

    needs_target_hidden = False

    def __init__(self, alpha0: float, beta0: float, max_length: int, seed: int) -> None:
        if alpha0 <= 0 or beta0 <= 0:
            raise ValueError(f"Beta prior needs alpha0, beta0 > 0, got {alpha0}, {beta0}")
        self.alpha0, self.beta0, self.max_length = alpha0, beta0, max_length
        self.rng = random.Random(seed)
        self.alpha, self.beta = alpha0, beta0

    def start(self) -> None:
        self.alpha, self.beta = self.alpha0, self.beta0

    def begin_round(self, target_hidden: Tensor | None) -> None:
        pass

    def keep_drafting(self, step: int, draft_hidden: Tensor) -> bool:
        theta = self.rng.betavariate(self.alpha, self.beta)
        return self.rng.random() < theta

    def update(self, drafted: int, accepted: int) -> None:
        r, n = chi_counts(drafted, accepted)
        self.alpha += r
        self.beta += n - r


class CaliTS:
    """Thompson sampling calibrated by a model's prediction (seed 001 Alg. 3, eq. 5-10)."""

    needs_target_hidden = True

    def __init__(
        self,
        sigma_m: float,
        sigma_s: float,
        theta0: float,
        predict: Predictor,
        max_length: int,
        seed: int,
    ) -> None:
        if sigma_m <= 0 or sigma_s <= 0:
            raise ValueError(f"sigma_M and sigma_S must be > 0, got {sigma_m}, {sigma_s}")
        self.sigma_m2, self.sigma_s2 = sigma_m**2, sigma_s**2
        self.theta0, self.predict, self.max_length = theta0, predict, max_length
        self.rng = random.Random(seed)
        self.start()

    def start(self) -> None:
        self.verifications = 0
        self.theta_hat = self.theta0
        self.trials = 0
        self.target_hidden: Tensor | None = None

    def begin_round(self, target_hidden: Tensor | None) -> None:
        self.target_hidden = target_hidden

    def posterior(self, theta_m: float) -> tuple[float, float]:
        """(mu, sigma^2) of Alg. 3 lines 9-10."""
        weight = self.verifications * self.sigma_m2
        denominator = weight + self.sigma_s2
        mu = (self.sigma_s2 * theta_m + weight * self.theta_hat) / denominator
        return mu, self.sigma_m2 * self.sigma_s2 / denominator

    def keep_drafting(self, step: int, draft_hidden: Tensor) -> bool:
        if self.target_hidden is None:
            raise RuntimeError("Cali-TS needs the target's hidden state: call begin_round first")
        theta_m = float(self.predict(step, self.target_hidden, draft_hidden))
        mu, variance = self.posterior(theta_m)
        theta = self.rng.gauss(mu, variance**0.5)
        return self.rng.random() < theta

    def update(self, drafted: int, accepted: int) -> None:
        r, n = chi_counts(drafted, accepted)
        self.verifications += 1
        self.theta_hat = (self.theta_hat * (self.trials + 1) + r) / (self.trials + n + 1)
        self.trials += n
