"""Logits processing and the samplers every decoder shares, drafter and target alike.

One function turns logits into the distribution that is sampled (`probabilities`: temperature, top-k,
top-p), and the drafter and the target both go through it, so that rejection sampling compares the
two distributions that were really used. Temperature 0 means greedy decoding: no distribution is
built, tokens are argmaxes, and a draft token is accepted when it equals the target's argmax.

The samplers (seed 002 §2-3, App. B):
- `verify_chain`: speculative sampling of K chained draft tokens: accept each with min(1, q/p), on the
  first rejection sample from the residual norm((q - p)+), a bonus token from q when all are accepted.
- `recursive_rejection`: recursive rejection sampling (seed 002 Alg. 1 / eq. 2-4) of draft tokens that
  were sampled *without replacement* from p (Gumbel-top-k, stochastic beam search): after each
  rejection the target becomes the residual and the drafted token is removed from p.
- `gumbel_topk` (seed 002 Alg. 4) and `stochastic_beam_step` (Alg. 9 with the numerically stable
  truncated Gumbels of Kool et al. 2019, App. B.3).
All randomness comes from an explicit `torch.Generator`, so a seed reproduces a run; the rejection samplers
draw it only through `uniforms` and `sample`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn from logits; identical for drafter and target."""

    temperature: float = 0.0
    """0 is greedy (argmax); otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p (1 disables)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 disables)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """The distribution sampled from `logits` [..., V]: zero outside top-k/top-p, float32 (float64 logits
    stay float64, which the exact tests use)."""
    if sampling.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token while the mass before it is below top_p: the smallest set reaching top_p
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row of `probs` [..., V] -> [...] (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def uniforms(count: int, generator: torch.Generator, device: torch.device) -> list[float]:
    """`count` uniform draws in [0, 1) as Python floats: the only uniforms the rejection samplers use.

    `sample` and this function are the samplers' two sources of randomness, so a test can replace both
    and integrate over every outcome exactly (tests/exact_sampling.py).
    """
    return torch.rand(count, generator=generator, device=device).tolist()


def residual(q: Tensor, p: Tensor) -> Tensor:
    """norm((q - p)+). When q <= p everywhere (only possible when q == p up to rounding) the residual is
    never reached by an exact sampler; q is returned so that rounding cannot produce a division by zero."""
    diff = (q - p).clamp_(min=0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp(min=torch.finfo(diff.dtype).tiny), q)


def verify_chain(
    drafts: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator
) -> tuple[int, Tensor]:
    """Speculative sampling of K chained drafts (Leviathan et al. 2023; seed 002 §2).

    drafts [K], draft_probs [K, V] (p at each drafted position), target_probs [K+1, V] (q at each drafted
    position plus the one after the last draft). Returns (number accepted, next token [1]): the residual
    sample at the first rejection, or the bonus token from q[K] when all K are accepted.
    """
    k = drafts.shape[0]
    accepted = 0
    if k:
        index = drafts.view(k, 1)
        # one transfer for p(x) and q(x), one for the uniforms: as many host syncs as a nonzero() would take
        p_x, q_x = torch.cat([draft_probs.gather(1, index), target_probs[:k].gather(1, index)], 1).T.tolist()
        for u, p, q in zip(uniforms(k, generator, drafts.device), p_x, q_x):
            # accept when u < q/p, written without a division (p > 0 since x was drawn from p)
            if u * p >= q:
                break
            accepted += 1
    dist = residual(target_probs[accepted], draft_probs[accepted]) if accepted < k else target_probs[k]
    return accepted, sample(dist, generator).view(1)


def recursive_rejection(
    children: list[int], p: Tensor, q: Tensor, generator: torch.Generator
) -> tuple[int | None, int]:
    """Recursive rejection sampling (seed 002 Alg. 1 and Alg. 6, lines 9-25) at one tree node.

    `children` are draft tokens drawn in this order *without replacement* from p [V]; q [V] is the
    target distribution at the node. Returns (index of the accepted child, its token) or
    (None, token drawn from the last residual). Without children this is a plain draw from q.
    """
    if not children:
        return None, int(sample(q, generator))
    q_cur, p_cur = q, p.clone()
    draws = uniforms(len(children), generator, p.device)
    for i, x in enumerate(children):
        q_x, p_x = float(q_cur[x]), float(p_cur[x])
        if draws[i] * p_x < q_x:
            return i, x
        q_cur = residual(q_cur, p_cur)
        # the next child was drawn from p without the tokens drawn before it
        p_cur[x] = 0.0
        p_cur = p_cur / p_cur.sum()
    return None, int(sample(q_cur, generator))


def gumbel(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> Tensor:
    """I.i.d. standard Gumbel samples (float32)."""
    u = torch.rand(shape, generator=generator, device=device)
    # -log(-log u), with u kept away from 0 so that no sample is infinite
    return -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float32).tiny)))


def gumbel_topk(log_probs: Tensor, k: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Gumbel-top-k (seed 002 Alg. 4): k tokens per row of log_probs [N, V] without replacement.

    Returns tokens [N, k] in decreasing order of perturbed log-probability (so each row is in the order
    of a sequential draw without replacement) and a mask [N, k] of valid draws: False where the row has
    fewer than k tokens with non-zero probability (top-p/top-k filtering, Alg. 4 line 6).
    With `generator=None` no noise is added: the k most likely tokens (greedy decoding).
    """
    perturbed = log_probs
    if generator is not None:
        perturbed = log_probs + gumbel(tuple(log_probs.shape), generator, log_probs.device)
    values, tokens = torch.topk(perturbed, k, dim=-1)
    return tokens, values > float("-inf")


def log1mexp(a: Tensor) -> Tensor:
    """log(1 - exp(a)) for a <= 0, accurate near 0 and for very negative a (Mächler 2012)."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def truncated_gumbel(perturbed: Tensor, bound: Tensor) -> Tensor:
    """Kool et al. 2019 App. B.3: T(u, phi) = -log(exp(-u) - exp(-max phi) + exp(-phi)), computed stably.

    perturbed [N, V] Gumbel-perturbed log-probabilities of the children of N parents, bound [N] the
    parents' own truncated values u. The children's maximum is mapped exactly onto u.
    """
    top = perturbed.amax(dim=-1, keepdim=True)
    u = bound.view(-1, 1)
    v = u - perturbed + log1mexp(perturbed - top)
    return u - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))


def stochastic_beam_step(
    log_probs: Tensor, sum_log_probs: Tensor, gamma: Tensor, width: int, generator: torch.Generator | None
) -> tuple[list[int], list[int], Tensor, Tensor]:
    """One level of stochastic beam search (seed 002 Alg. 9; Kool et al. 2019).

    log_probs [N, V] next-token log-probabilities of the N beam sequences, sum_log_probs [N] their
    sequence log-probabilities, gamma [N] their truncated Gumbels (0 at the root). Selects the top-`width`
    (parent, token) pairs by truncated perturbed sequence log-probability, which samples `width`
    sequences without replacement. Returns parents and tokens (lists: the tree is built in Python), new
    sum_log_probs and gamma [W'], all in decreasing order of the truncated Gumbel, W' <= width (pairs of
    probability zero are dropped).
    With `generator=None` no noise is added: a deterministic beam search (used for greedy decoding).
    """
    scores = log_probs + sum_log_probs.view(-1, 1)
    if generator is None:
        keys = scores
    else:
        keys = truncated_gumbel(scores + gumbel(tuple(scores.shape), generator, scores.device), gamma)
    vocab = scores.shape[-1]
    values, flat = torch.topk(keys.reshape(-1), min(width, keys.numel()))
    # sorted: the pairs of probability zero (key -inf) come last
    picked = [
        index for index, value in zip(flat.tolist(), values.tolist(), strict=True) if value > float("-inf")
    ]
    if len(picked) < len(values):
        flat, values = flat[: len(picked)], values[: len(picked)]
    parents, tokens = [index // vocab for index in picked], [index % vocab for index in picked]
    # without noise the keys are the scores
    return parents, tokens, values if generator is None else scores.reshape(-1)[flat], values
