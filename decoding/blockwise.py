"""`bpd`, `medusa` and their `+rescore` variants: blockwise drafts from proposal heads (seed 000).

The heads read the target's final hidden state at the last accepted position, which the verification
forward already computes: after a round, the hidden state of the accepted node gives both the target's
next token (the correction or bonus token, committed) and, through the heads, the distributions of the
m positions after it, from which the next round drafts. So a round costs one target forward plus the
heads on one row (and, with rescoring, the drafter's forwards); the first round is a plain target step
on the prompt, which yields the first hidden state.

- `bpd` (chain): the heads' argmaxes at temperature 0; when sampling, one token per head drawn from h_j
  (independent of the tokens before it, so h_j is its exact conditional), verified by speculative
  sampling (`decoding.chain.accept_sampled`, i.e. `verify_chain`) against q = h_j.
- `bpd+rescore`: the best path of the drafter-rescored lattice (`decoding.lattice`): beam search of
  width W at temperature 0; when sampling, one path drawn from r (stochastic beam search of width 1,
  an exact draw), verified by speculative sampling against the rows r_j(. | y_<j) it was drawn from.
- `medusa` (tree): a candidate tree from the heads' top tokens (`CandidateTree`), children drawn without
  replacement when sampling, verified in one target forward with the tree mask and recursive rejection
  sampling (`decoding.tree.verify_tree`), in the round `rsd_c` / `rsd_s` trees run (`decoding.tree.tree_decode`).
- `medusa+rescore`: the tree of every beam of a width-W beam search over the rescored lattice (all W
  nodes of each level, as `rsd_s` keeps them), stochastic beam search when sampling.
At temperature 0 every variant's output is `ar`'s, token for token: greedy verification keeps exactly
the target's argmaxes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from polydraft.decoding.chain import chain_decode, target_call
from polydraft.decoding.engine import Generation, Output, finish
from polydraft.decoding.lattice import CandidateTree, best_path, candidate_tree, head_log_probs, rescorer
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling, sample
from polydraft.decoding.tree import Tree, TreeShape, check_window, draft_tree, tree_decode


class HeadsDraft:
    """Proposal heads on the target's hidden states, timed like a model (`seconds`, `calls`)."""

    def __init__(self, heads: torch.nn.Module, target: CachedLM, profile: bool = True) -> None:
        self.heads = heads
        self.shared_head = target.head if heads.kind == "bpd" else None
        self.num_heads = heads.num_heads
        self.sync = profile and target.device.type == "cuda"
        self.device = target.device
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def log_probs(self, hidden: Tensor, sampling: Sampling) -> Tensor:
        """Log-distributions [m, V] of the m positions after the token that `hidden` [H] predicts."""
        start = time.perf_counter()
        weight = next(self.heads.parameters())  # on the target's head's device (`attach_heads`)
        logp = head_log_probs(self.heads(hidden.to(weight.device, weight.dtype), self.shared_head), sampling)
        logp = logp.to(self.device)
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logp


@dataclass(frozen=True)
class Rescoring:
    """Local rescoring of the heads' top-k lattice by a drafter LM (`decoding.lattice`)."""

    drafter: CachedLM
    weight: float
    """lambda: 0 is the heads alone, 1 the drafter alone (over the lattice's candidates)."""
    top_k: int
    """Candidates per lattice position."""
    beam_width: int
    """Beams kept per level (the tree of `medusa+rescore` has up to beam_width x depth nodes)."""

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.beam_width < 1:
            raise ValueError(f"top_k and beam_width must be >= 1, got {self.top_k}, {self.beam_width}")


def _finish(
    out: Output, start: float, target: CachedLM, heads: HeadsDraft, rescoring: Rescoring | None, rounds
) -> Generation:
    drafter = rescoring.drafter if rescoring is not None else None
    gen = finish(out, start, target, drafter, rounds)
    gen.draft_calls += heads.calls
    gen.draft_seconds += heads.seconds
    gen.rescore_seconds = drafter.seconds if drafter is not None else 0.0
    return gen


def _start(target: CachedLM, heads: HeadsDraft, rescoring: Rescoring | None) -> float:
    target.reset()
    heads.reset()
    if rescoring is not None:
        rescoring.drafter.reset()
    return time.perf_counter()


class HeadsProposer:
    """Drafts from the heads' distributions at the newest accepted position, directly (`bpd`) or through
    the drafter-rescored lattice (`bpd+rescore`) (`decoding.chain.Proposer`)."""

    def __init__(
        self,
        target: CachedLM,
        heads: HeadsDraft,
        sampling: Sampling,
        generator: torch.Generator,
        rescoring: Rescoring | None,
    ) -> None:
        self.target, self.heads, self.sampling, self.generator = target, heads, sampling, generator
        self.rescoring = rescoring
        self.head_logp: Tensor | None = None  # none before the first target call
        self.path: list[int] = []  # the rescored lattice's drafted nodes, and how many the drafter read
        self.fed = 0

    def max_drafts(self) -> int:
        return self.heads.num_heads if self.head_logp is not None else 0

    def draft(self, out: Output, budget: int) -> tuple[Tensor, Tensor | None]:
        head_logp, k, sampling, generator = self.head_logp, budget, self.sampling, self.generator
        assert head_logp is not None
        if self.rescoring is None:
            if sampling.greedy:
                return head_logp[:k].argmax(-1), None
            draft_probs = head_logp[:k].exp()
            return sample(draft_probs, generator), draft_probs
        drafter = self.rescoring.drafter
        width = self.rescoring.beam_width if sampling.greedy else 1  # sampling: one exact draw from r
        # the drafter's beam search is a tree under a tree mask: within its sliding window only
        check_window([drafter], out.length, width * k)
        tree, dists = draft_tree(
            drafter, out.pending(drafter.length), TreeShape.beam(width, k), k, sampling, generator,
            rescorer(head_logp, self.rescoring.top_k, self.rescoring.weight, sampling),
        )  # fmt: skip
        path = best_path(tree)
        self.path, self.fed = path, tree.fed
        drafts = torch.tensor([tree.tokens[node] for node in path], device=self.target.device)
        draft_probs = None
        if dists is not None:  # the rows each drafted token was drawn from: root, then its ancestors
            draft_probs = dists[torch.tensor([0] + [node + 1 for node in path[:-1]], device=dists.device)]
        return drafts, draft_probs

    def verify(self, out: Output, drafts: Tensor) -> tuple[Tensor, Tensor]:
        return target_call(self.target, out, drafts)

    def keep(self, n: int, accepted: int, drafts: int, hidden: Tensor) -> None:
        self.target.crop(n + accepted)
        if self.rescoring is not None and drafts > 0:
            self.rescoring.drafter.keep(n, [node for node in self.path[:accepted] if node < self.fed])
        self.head_logp = self.heads.log_probs(hidden[accepted], self.sampling)


@torch.inference_mode()
def blockwise_chain(
    target: CachedLM,
    heads: HeadsDraft,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    eos_ids: set[int],
    rescoring: Rescoring | None = None,
) -> Generation:
    """Decode one prompt with `bpd` (`rescoring` None) or `bpd+rescore`."""
    start = _start(target, heads, rescoring)
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=heads.num_heads + 1)
    proposer = HeadsProposer(target, heads, sampling, generator, rescoring)
    rounds = chain_decode(proposer, out, sampling, generator)
    return _finish(out, start, target, heads, rescoring, rounds)


class HeadsTree:
    """`medusa` (a candidate tree of `shape` from the heads' top tokens) or `medusa+rescore` (the beams of
    the drafter-rescored lattice), for `tree_decode`: the heads read the target's hidden state at the
    newest token, so the first round, with no hidden state yet, is a plain target step."""

    def __init__(
        self, target: CachedLM, heads: HeadsDraft, shape: CandidateTree | None, rescoring: Rescoring | None,
        sampling: Sampling, generator: torch.Generator,
    ) -> None:  # fmt: skip
        if (shape is None) == (rescoring is None):
            raise ValueError("blockwise_tree takes a candidate tree shape (medusa) or a rescoring, not both")
        self.heads, self.shape, self.rescoring = heads, shape, rescoring
        self.sampling, self.generator = sampling, generator
        self.depth_limit = min(shape.depth, heads.num_heads) if shape is not None else heads.num_heads
        self.max_nodes = len(shape.paths) if shape is not None else rescoring.beam_width * self.depth_limit
        self.models = [target] if rescoring is None else [target, rescoring.drafter]
        self.head_logp: Tensor | None = None

    def max_depth(self) -> int:
        return self.depth_limit if self.head_logp is not None else 0

    def draft(self, out: Output, depth: int) -> tuple[Tree, Tensor | None]:
        assert self.head_logp is not None
        if self.rescoring is None:
            return candidate_tree(self.head_logp, self.shape, depth, self.sampling, self.generator)
        r = self.rescoring
        return draft_tree(
            r.drafter, out.pending(r.drafter.length), TreeShape.beam(r.beam_width, depth), depth,
            self.sampling, self.generator, rescorer(self.head_logp, r.top_k, r.weight, self.sampling),
        )  # fmt: skip

    def keep(self, n: int, tree: Tree | None, path: list[int], hidden: Tensor) -> None:
        if tree is not None and self.rescoring is not None:
            self.rescoring.drafter.keep(n, [node for node in path if node < tree.fed])
        # the heads read the state after the newest accepted token (after a plain step: its token's)
        self.head_logp = self.heads.log_probs(hidden, self.sampling)


@torch.inference_mode()
def blockwise_tree(
    target: CachedLM,
    heads: HeadsDraft,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    eos_ids: set[int],
    shape: CandidateTree | None = None,
    rescoring: Rescoring | None = None,
) -> Generation:
    """Decode one prompt with `medusa` (a candidate tree of `shape`) or `medusa+rescore` (`rescoring`)."""
    proposer = HeadsTree(target, heads, shape, rescoring, sampling, generator)
    start = _start(target, heads, rescoring)
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=proposer.depth_limit + 1)
    rounds = tree_decode(proposer, target, out, sampling, generator)
    return _finish(out, start, target, heads, rescoring, rounds)
