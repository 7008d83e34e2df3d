"""Does a sampling decoder's output follow the target's joint law? A Pearson test with stated power.

Decoder-agnostic: `assert_follows` takes a `decode()` callable returning the generated tokens of one
output (any decoder, any model double) and the exact joint law of those tokens under the target
(`target_joint`, by enumeration). It draws `sample_size(...)` outputs and

- fails at once when an output of probability zero appears (zero cells are never pooled);
- pools the cells expected fewer than 5 times (and, if the pool itself is expected fewer than 5
  times, the smallest other cells) so that the chi-square approximation holds;
- rejects when Pearson's statistic exceeds the chi-square quantile at false-alarm rate ALPHA.

Power. Against an alternative law p1 at total variation TV from the target p0, the statistic is
approximately non-central chi-square with noncentrality lambda = N sum (p1 - p0)^2 / p0 over the cells,
and Cauchy-Schwarz gives sum (p1 - p0)^2 / p0 >= (sum |p1 - p0|)^2 = 4 TV^2: lambda >= 4 N TV^2 whatever
the alternative. Pooling can hide at most the pooled mass P_pool of the deviation, and an alternative
that puts mass m >= 4.61 / N on zero-probability outputs shows one of them with probability
1 - (1 - m)^N >= 0.99; otherwise it moves the nonzero cells by at most m. So the power is at least
ncx2.sf(threshold, df, 4 N (TV - P_pool - 4.61 / N)^2) (`power`), and `sample_size` is the smallest N
(on a 2% grid) at which that reaches POWER.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from scipy.stats import chi2, ncx2
from torch import Tensor

ALPHA = 1e-3
"""False-alarm rate: a correct decoder fails with this probability (the seeds are fixed: no retries)."""
POWER = 0.99
ZERO_MASS = -math.log(1 - POWER)
"""N * m above which an output of probability zero is seen with probability >= POWER (4.61)."""

Outcome = tuple[int, ...]


def target_joint(next_probs: Callable[[Outcome], Tensor], length: int) -> dict[Outcome, float]:
    """The exact law of the first `length` tokens: next_probs(tokens so far) is the target's distribution."""
    law = {(): 1.0}
    for _ in range(length):
        longer: dict[Outcome, float] = {}
        for tokens, mass in law.items():
            for token, prob in enumerate(next_probs(tokens).tolist()):
                if prob > 0:
                    longer[tokens + (token,)] = mass * prob
        law = longer
    return law


def cells(law: dict[Outcome, float], samples: int) -> tuple[list[list[Outcome]], float]:
    """The outputs grouped into test cells at this sample size, and the probability of the pooled ones."""
    ordered = sorted(law, key=law.get)
    pool = [o for o in ordered if law[o] * samples < 5]
    rest = [o for o in ordered if law[o] * samples >= 5]
    while pool and sum(law[o] for o in pool) * samples < 5 and rest:
        pool.append(rest.pop(0))
    groups = [[o] for o in rest] + ([pool] if pool else [])
    return groups, sum(law[o] for o in pool)


def threshold(groups: list[list[Outcome]]) -> float:
    return float(chi2.isf(ALPHA, len(groups) - 1))


def power(law: dict[Outcome, float], samples: int, tv: float) -> float:
    """A lower bound on the probability of rejecting any law at total variation >= tv (module docstring)."""
    groups, pooled = cells(law, samples)
    shift = tv - pooled - ZERO_MASS / samples
    if len(groups) < 2 or shift <= 0:
        return 0.0
    return float(ncx2.sf(threshold(groups), len(groups) - 1, 4 * samples * shift**2))


def sample_size(law: dict[Outcome, float], tv: float) -> int:
    """The smallest N (on a 2% grid) with power(law, N, tv) >= POWER."""
    samples = 100
    while power(law, samples, tv) < POWER:
        samples = math.ceil(samples * 1.02)
    return samples


def assert_follows(decode: Callable[[], Sequence[int]], law: dict[Outcome, float], samples: int) -> None:
    """Draw `samples` outputs with decode() and test them against the exact `law` (module docstring)."""
    length = len(next(iter(law)))
    counts: Counter[Outcome] = Counter()
    for _ in range(samples):
        tokens = tuple(decode())
        assert len(tokens) == length, f"an output of {len(tokens)} tokens, {length} expected"
        if law.get(tokens, 0.0) == 0.0:
            raise AssertionError(f"output {tokens} has probability zero under the target")
        counts[tokens] += 1
    groups, _ = cells(law, samples)
    statistic = 0.0
    for group in groups:
        expected = samples * sum(law[o] for o in group)
        statistic += (sum(counts[o] for o in group) - expected) ** 2 / expected
    limit = threshold(groups)
    assert statistic <= limit, (
        f"Pearson statistic {statistic:.1f} > {limit:.1f} ({len(groups)} cells, N={samples})"
    )
