"""Draft-length control for chain decoders (`sd`, `eesd`): fixed K, Beta-TS and Cali-TS (seed 001).

A controller is asked after each draft token whether to draft another one, and is told after each
verification how many of the drafted tokens the target accepted. The decoders also cap the number
of drafts per round by `max_length` and by the tokens left to generate.

Thompson sampling (seed 001 §3.3, App. A-B) treats "keep drafting" as a Bernoulli variable chi with
an unknown probability theta: after draft token i, sample theta from the posterior, then chi ~ B(theta),
and stop when chi = 0.

How a round is counted (seed 001 §3.3, after eq. 4): "r represents the number of successful experiments
in the observed samples, and n represents the total number of experiments. And in Algorithm 1, the value
of r is set to |Q_v| - 1, indicating that the draft model should continue to generate on this set of
tokens (i.e., chi = 1). And the value of n is set to min(|Q_v| + 1, |Q_d|), indicating the number of
tokens that have been validated by the target model. Because we stop verifying when we encounter an
inconsistent token, subsequent tokens are not considered." (Alg. 2 lines 18-19 repeat the two formulas.)

Reading. The prose is taken as the definition: a trial is a draft token the target validated, a success
one it accepted. With K drafted (|Q_d| = K) and A accepted, the target validates the A accepted tokens and,
when A < K, the first rejected one, after which "subsequent tokens are not considered":
    r = A,   n = min(A + 1, K),   so  alpha += A,  beta += 1 if A < K else 0.
One failure per rejection; a round whose drafts were all accepted (stopped by chi = 0, by the cap or by
the end of the output) adds no failure: the token after the last draft was never drafted, so the stop is
no observation. The two symbolic formulas cannot both hold with one meaning of |Q_v|: with Q_v the
accepted drafts (Alg. 1 line 15, "Q_v subset of Q_d") n = min(|Q_v| + 1, |Q_d|) is the validated count
above but r = |Q_v| - 1 is A - 1 (-1 when nothing is accepted); with Q_v what the round adds to the
output (A + 1 tokens, which t <- t + |Q_v| counts) r = A but n = min(A + 2, K) counts a token past the
first rejection, which the sentence above excludes. Either literal form charges two failures per
rejection, so theta settles below the acceptance rate (Beta-TS(1, 1), cap 10, each draft accepted with
probability 0.8: 3.22 drafts a round and a posterior mean of 0.70, against 4.38 and 0.80 counted as here;
bench/results/ts_sweep.md).

- Beta-TS (Alg. 2): alpha += r, beta += n - r, with the prior (alpha_0, beta_0) restored for each prompt.
  `BetaTS(literal=True)` runs the symbolic formulas instead, with Q_v what the round adds to the output
  (A + 1 tokens; the reading that keeps r >= 0): r = A, n = min(A + 2, K) (`chi_counts_literal`), so that
  the study can measure the seed's rule beside this reading.
- Cali-TS (Alg. 3): mu = (sigma_S^2 theta_M + n sigma_M^2 theta_hat) / (n sigma_M^2 + sigma_S^2),
  sigma^2 = sigma_M^2 sigma_S^2 / (sigma_S^2 + n sigma_M^2), theta ~ N(mu, sigma^2), with n the number
  of verifications so far (line 21) and theta_M the calibration model's prediction. theta_hat is "the
  observed sample mean of the random variable chi" (App. B before eq. 10): theta_hat = (theta_hat (m + 1)
  + r) / (m + n_round + 1), m += n_round, with (r, n_round) the round's successes and trials counted as
  above and theta_hat_0 weighing as one prior observation. Eq. 10 has this form with t (tokens generated)
  as the count and |Q_v| as the successes; taken literally every generated token is a success and
  theta_hat tends to 1 whatever is accepted, so the chi trials are counted instead.
- Cali-TS's ablations (seed 001 Table 4): `CaliTS(use="model")` ("w/o Sampling-Prediction") draws theta
  from N(theta_M, sigma_M^2), the observations left out; `CaliTS(use="sampling")` ("w/o
  Model-Prediction") from N(theta_hat, sigma_S^2 / max(n, 1)), the limit of eq. 9 as sigma_M grows, with
  no calibration model and so no deferred first round.
- Cali-TS's first round: theta_M needs H_t^(T), the target state that produced the context's newest
  token, which for the prompt only the round's own target call computes. The round therefore drafts up
  to the cap, the target call that verifies the drafts also returns the state at the prompt's
  second-to-last position, and the chi draws of eq. 5-9 are then made in order (`settle`), exactly as
  they would have been while drafting; only the drafts before the first chi = 0 are verified. No target
  call is added; the drafts past the stop are drafted and sent in vain (`Round.drafted` counts them).

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
from typing import Literal

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


def chi_counts_literal(drafted: int, accepted: int) -> tuple[int, int]:
    """(r, n) by Alg. 2 lines 18-19 as written, r = |Q_v| - 1 and n = min(|Q_v| + 1, |Q_d|), with Q_v the
    A + 1 tokens the round adds to the output: r = A, n = min(A + 2, K) (two failures per rejection but
    at the last draft)."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must lie in 0..drafted, got {accepted} of {drafted}")
    return accepted, min(accepted + 2, drafted)


def chi_counts(drafted: int, accepted: int) -> tuple[int, int]:
    """(r, n): successes and trials of chi observed in a round of `drafted` drafts, `accepted` of them
    accepted (seed 001 §3.3 as read in the module docstring: the validated tokens, one failure at most)."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must lie in 0..drafted, got {accepted} of {drafted}")
    return accepted, min(accepted + 1, drafted)


class BetaTS:
    """Thompson sampling with a Beta posterior (seed 001 Alg. 2), reset to the prior for each prompt."""

    needs_target_hidden = False

    def __init__(
        self, alpha0: float, beta0: float, max_length: int, seed: int, literal: bool = False
    ) -> None:
        if alpha0 <= 0 or beta0 <= 0:
            raise ValueError(f"Beta prior needs alpha0, beta0 > 0, got {alpha0}, {beta0}")
        self.alpha0, self.beta0, self.max_length = alpha0, beta0, max_length
        self.counts = chi_counts_literal if literal else chi_counts
        """How a round's (r, n) are counted: this module's reading, or the seed's formulas as written."""
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
        r, n = self.counts(drafted, accepted)
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
        predict: Predictor | None,
        max_length: int,
        seed: int,
        use: Literal["both", "model", "sampling"] = "both",
    ) -> None:
        if sigma_m <= 0 or sigma_s <= 0:
            raise ValueError(f"sigma_M and sigma_S must be > 0, got {sigma_m}, {sigma_s}")
        if predict is None and use != "sampling":
            raise ValueError(f"Cali-TS with use={use!r} needs a calibration model")
        self.use = use
        """`both` (Alg. 3), `model` (w/o sampling prediction) or `sampling` (w/o model prediction)."""
        self.needs_target_hidden = use != "sampling"
        self.sigma_m2, self.sigma_s2 = sigma_m**2, sigma_s**2
        self.theta0, self.predict, self.max_length = theta0, predict, max_length
        self.rng = random.Random(seed)
        self.start()

    def start(self) -> None:
        self.verifications = 0
        self.theta_hat = self.theta0
        self.trials = 0
        self.target_hidden: Tensor | None = None
        self.deferred: list[tuple[int, Tensor]] = []

    def begin_round(self, target_hidden: Tensor | None) -> None:
        """`target_hidden` None: the prompt's first round, whose chi draws wait for `settle`."""
        self.target_hidden = target_hidden
        self.deferred = []

    def posterior(self, theta_m: float) -> tuple[float, float]:
        """(mu, sigma^2) of Alg. 3 lines 9-10 (or of an ablation, `use`)."""
        if self.use == "model":
            return theta_m, self.sigma_m2
        if self.use == "sampling":
            return self.theta_hat, self.sigma_s2 / max(self.verifications, 1)
        weight = self.verifications * self.sigma_m2
        denominator = weight + self.sigma_s2
        mu = (self.sigma_s2 * theta_m + weight * self.theta_hat) / denominator
        return mu, self.sigma_m2 * self.sigma_s2 / denominator

    def keep_drafting(self, step: int, draft_hidden: Tensor) -> bool:
        if self.use == "sampling":  # no calibration model: nothing waits for the target state
            mu, variance = self.posterior(0.0)
            return self.rng.random() < self.rng.gauss(mu, variance**0.5)
        if self.target_hidden is None:  # first round: draft on, decide in `settle`
            self.deferred.append((step, draft_hidden))
            return True
        assert self.predict is not None
        theta_m = float(self.predict(step, self.target_hidden, draft_hidden))
        mu, variance = self.posterior(theta_m)
        theta = self.rng.gauss(mu, variance**0.5)
        return self.rng.random() < theta

    def settle(self, target_hidden: Tensor, drafted: int) -> int:
        """The first round's drafts to verify: the chi draws after each of the `drafted` drafts but the
        last, made in order now that the target state `target_hidden` is known, up to the first chi = 0."""
        if len(self.deferred) != drafted - 1:
            raise RuntimeError(f"settle: {len(self.deferred)} deferred draws for {drafted} drafts")
        self.target_hidden = target_hidden
        for step, draft_hidden in self.deferred:
            if not self.keep_drafting(step, draft_hidden):
                return step
        return drafted

    def update(self, drafted: int, accepted: int) -> None:
        r, n = chi_counts(drafted, accepted)
        self.verifications += 1
        self.theta_hat = (self.theta_hat * (self.trials + 1) + r) / (self.trials + n + 1)
        self.trials += n
