"""Exact output distributions of the rejection samplers, by integrating over their randomness.

The samplers draw randomness only through `decoding.sampling.uniforms` and `decoding.sampling.sample`.
`Explorer` replaces both and runs a program once per branch of its random choices (a depth-first walk
over the choices, replaying the ones made so far):

- `sample(probs)` becomes a choice of each token with probability probs / probs.sum() (what
  `torch.multinomial` draws);
- each uniform becomes a `SymbolicUniform`: an interval, at first [0, 1), that every comparison with a
  number splits in two branches whose probabilities are the lengths of the parts. Whatever thresholds
  the code under test computes, the branches partition [0, 1) exactly; using the uniform in any other
  way (float(), a tensor) raises.

Every branch ends with an outcome; summing the products of the choice probabilities per outcome gives
the exact law of the outcome (up to float64 rounding). The checks below compare it with the target:
an outcome (accepted tokens, then the next token) is completed with the target's own distribution to a
fixed length, and the completed law must equal the target's joint law, token for token, to 1e-6.
The draft tokens themselves are drawn inside the program too (`Explorer.draw_without_replacement`), so
their law is integrated as well.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Hashable

import pytest
import torch
from torch import Tensor

import polydraft.decoding.sampling as sampling_module
from polydraft.decoding.sampling import Sampling, probabilities, recursive_rejection, verify_chain
from polydraft.decoding.tree import Tree, verify_tree

TOLERANCE = 1e-6


class SymbolicUniform:
    """A uniform draw on [lo, hi) that is decided only as far as comparisons need."""

    def __init__(self, explorer: Explorer, scale: float = 1.0, shared: SymbolicUniform | None = None):
        self.explorer, self.scale = explorer, scale
        self.state = shared.state if shared is not None else [0.0, 1.0]

    def __mul__(self, factor: float) -> SymbolicUniform:
        if not isinstance(factor, float | int):
            raise TypeError(f"a symbolic uniform times {type(factor).__name__}")
        return SymbolicUniform(self.explorer, self.scale * float(factor), self)

    __rmul__ = __mul__

    def below(self, bound: float) -> bool:
        """Whether scale * u < bound, splitting the interval of u at bound / scale."""
        if not isinstance(bound, float | int):
            raise TypeError(f"a symbolic uniform compared with {type(bound).__name__}")
        lo, hi = self.state
        if self.scale <= 0:
            return bound > 0.0  # scale * u is 0 for every u (scale is a probability, never negative)
        cut = bound / self.scale
        if cut <= lo:
            return False
        if cut >= hi:
            return True
        part = (cut - lo) / (hi - lo)
        if self.explorer.choose([part, 1.0 - part]) == 0:
            self.state[1] = cut
            return True
        self.state[0] = cut
        return False

    # ties have probability zero: < and <= (> and >=) are the same event
    def __lt__(self, bound: float) -> bool:
        return self.below(bound)

    __le__ = __lt__

    def __ge__(self, bound: float) -> bool:
        return not self.below(bound)

    __gt__ = __ge__

    def __float__(self) -> float:
        raise TypeError("a symbolic uniform has no value; compare it instead")


class Explorer:
    """Runs a program on every branch of its random choices and sums the branch probabilities per outcome."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(sampling_module, "uniforms", self.uniforms)
        monkeypatch.setattr(sampling_module, "sample", self.sample)
        self.script: tuple[int, ...] = ()
        self.trace: list[tuple[int, list[float]]] = []
        self.probability = 1.0

    def choose(self, weights: list[float]) -> int:
        """Index of the branch taken; weights are probabilities (zero ones are never taken)."""
        depth = len(self.trace)
        if depth < len(self.script):
            index = self.script[depth]
        else:
            index = next(i for i, w in enumerate(weights) if w > 0)
        self.trace.append((index, weights))
        self.probability *= weights[index]
        return index

    def uniforms(self, count: int, generator, device) -> list[SymbolicUniform]:
        return [SymbolicUniform(self) for _ in range(count)]

    def sample(self, probs: Tensor, generator) -> Tensor:
        if probs.dim() != 1:
            raise TypeError(f"the samplers draw one token at a time, got probs of shape {tuple(probs.shape)}")
        weights = probs.double().tolist()
        total = sum(weights)
        token = self.choose([w / total for w in weights])
        return torch.tensor(token)

    def draw_without_replacement(self, probs: Tensor, count: int) -> list[int]:
        """`count` tokens (at most the support) drawn in order without replacement from probs."""
        weights = probs.double().tolist()
        drawn: list[int] = []
        for _ in range(min(count, sum(w > 0 for w in weights))):
            left = sum(weights)
            token = self.choose([w / left for w in weights])
            drawn.append(token)
            weights[token] = 0.0
        return drawn

    def law(self, program: Callable[[Explorer], Hashable]) -> dict[Hashable, float]:
        """Outcome -> exact probability, over every branch of `program`'s choices."""
        result: dict[Hashable, float] = defaultdict(float)
        scripts: list[tuple[int, ...]] = [()]
        while scripts:
            self.script, self.trace, self.probability = scripts.pop(), [], 1.0
            outcome = program(self)
            result[outcome] += self.probability
            taken = tuple(index for index, _ in self.trace)
            for depth in range(len(self.script), len(self.trace)):
                index, weights = self.trace[depth]
                for other in range(index + 1, len(weights)):
                    if weights[other] > 0:
                        scripts.append(taken[:depth] + (other,))
        total = sum(result.values())
        assert abs(total - 1.0) < 1e-9, f"the branches' probabilities sum to {total}"
        return dict(result)


class Rows:
    """Random next-token distributions per context (a tuple of tokens): an exact stand-in for a model.

    The logits are a part shared by every `Rows` of the same `family` plus a part of its own, so that a
    drafter and its target agree in part (drafts are often accepted) and differ in part.
    """

    def __init__(self, vocab: int, seed: int, sampling: Sampling, family: int = 0) -> None:
        self.vocab, self.seed, self.sampling, self.family = vocab, seed, sampling, family
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def normal(self, seed: int, context: tuple[int, ...]) -> Tensor:
        generator = torch.Generator().manual_seed(hash((seed, context)) % 2**62)
        return torch.randn(self.vocab, generator=generator, dtype=torch.float64)

    def __call__(self, context: tuple[int, ...]) -> Tensor:
        found = self.memo.get(context)
        if found is None:
            logits = self.normal(-1 - self.family, context) + self.normal(self.seed, context)
            found = self.memo[context] = probabilities(logits, self.sampling)
        return found


def completed_law(outcomes: dict[Hashable, float], q: Rows, length: int) -> dict[tuple[int, ...], float]:
    """Each outcome (a token tuple) continued by the target q to `length` tokens: the law of the result."""
    result: dict[tuple[int, ...], float] = defaultdict(float)
    frontier = list(outcomes.items())
    while frontier:
        tokens, mass = frontier.pop()
        assert isinstance(tokens, tuple) and len(tokens) <= length, tokens
        if len(tokens) == length:
            result[tokens] += mass
            continue
        for token, prob in enumerate(q(tokens).tolist()):
            if prob > 0:
                frontier.append((tokens + (token,), mass * prob))
    return dict(result)


def assert_target_law(outcomes: dict[Hashable, float], q: Rows, length: int) -> None:
    """The completed outcomes follow q's joint law over `length` tokens, every sequence to TOLERANCE.

    Outcomes of every length 1..`length` must be possible (drafts rejected at each position and all
    accepted), or the check would not exercise every branch of the sampler.
    """
    lengths = {len(tokens) for tokens in outcomes}
    assert lengths == set(range(1, length + 1)), f"outcome lengths {sorted(lengths)}: a branch is never taken"
    got = completed_law(outcomes, q, length)
    for tokens in itertools.product(range(q.vocab), repeat=length):
        expected = 1.0
        for i, token in enumerate(tokens):
            expected *= float(q(tokens[:i])[token])
        assert abs(got.get(tokens, 0.0) - expected) < TOLERANCE, (tokens, got.get(tokens, 0.0), expected)


def chain_law(explorer: Explorer, p: Rows, q: Rows, k: int) -> dict[Hashable, float]:
    """Drafts x_1..x_k drawn from p(.|x_<i), then `verify_chain`: the law of (accepted drafts, next token)."""

    def program(ex: Explorer) -> tuple[int, ...]:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(ex.choose(p(tuple(drafts)).tolist()))
        draft_rows = torch.stack([p(tuple(drafts[:i])) for i in range(k)])
        target_rows = torch.stack([q(tuple(drafts[:i])) for i in range(k + 1)])
        accepted, token = verify_chain(torch.tensor(drafts), draft_rows, target_rows, None)
        return tuple(drafts[:accepted]) + (int(token),)

    return explorer.law(program)


def rejection_law(
    explorer: Explorer, p: Tensor, q: Tensor, count: Callable[[list[int]], bool]
) -> dict[Hashable, float]:
    """Children drawn without replacement from p while `count(drawn so far)` says go on, then
    `recursive_rejection`: the law of the token returned (as a 1-tuple)."""

    def program(ex: Explorer) -> tuple[int, ...]:
        children = draw_children(ex, p, count)
        index, token = recursive_rejection(children, p, q, None)
        assert index is None or children[index] == token
        return (token,)

    return explorer.law(program)


def draw_children(ex: Explorer, p: Tensor, more: Callable[[list[int]], bool]) -> list[int]:
    """Tokens drawn in order without replacement from p while more(drawn so far) holds.

    Whether to draw another child may depend on the children drawn so far, never on the next one: this
    is how the number of siblings varies in a stochastic beam (their truncated Gumbel values decide it,
    and by the Gumbel-max property those are independent of which tokens were drawn next).
    """
    weights = p.double().tolist()
    drawn: list[int] = []
    while any(w > 0 for w in weights) and more(drawn):
        left = sum(weights)
        token = ex.choose([w / left for w in weights])
        drawn.append(token)
        weights[token] = 0.0
    return drawn


class LazyTree(Tree):
    """A draft tree whose children are drawn (through the explorer) when verification first asks for them.

    Verification reads only the children of the nodes it reaches, so drawing lazily integrates over the
    whole tree's law at the cost of the paths it walks. Node ids follow the order of the draws.
    """

    def __init__(self, ex: Explorer, p: Rows, depth: int, more: Callable[[tuple[int, ...], list[int]], bool]):
        super().__init__()
        self.ex, self.p, self.depth, self.more = ex, p, depth, more
        self.kids: dict[int, list[int]] = {}

    def path(self, node: int) -> tuple[int, ...]:
        tokens: list[int] = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(tokens))

    def children(self) -> LazyChildren:
        return LazyChildren(self)

    def expand(self, node: int) -> list[int]:
        if node not in self.kids:
            context = self.path(node)
            ids: list[int] = []
            if len(context) < self.depth:
                for token in draw_children(self.ex, self.p(context), lambda drawn: self.more(context, drawn)):
                    ids.append(len(self.tokens))
                    self.tokens.append(token)
                    self.parents.append(node)
                    self.depths.append(len(context) + 1)
            self.kids[node] = ids
        return self.kids[node]


class LazyChildren:
    """`Tree.children()`'s mapping, expanding a node when it is looked up."""

    def __init__(self, tree: LazyTree) -> None:
        self.tree = tree

    def get(self, node: int, default=None) -> list[int]:
        return self.tree.expand(node)

    def __getitem__(self, node: int) -> list[int]:
        return self.tree.expand(node)


class LazyRows:
    """The rows verify_tree indexes by node + 1 (row 0 at the root): a model's rows at each node's path."""

    def __init__(self, tree: LazyTree, rows: Rows) -> None:
        self.tree, self.rows = tree, rows

    def __getitem__(self, index: int) -> Tensor:
        return self.rows(self.tree.path(index - 1))


def tree_law(
    explorer: Explorer, p: Rows, q: Rows, depth: int, more: Callable[[tuple[int, ...], list[int]], bool]
) -> dict[Hashable, float]:
    """A tree drawn level by level without replacement from p, verified by `verify_tree`: the law of
    (accepted path tokens, next token)."""

    def program(ex: Explorer) -> tuple[int, ...]:
        tree = LazyTree(ex, p, depth, more)
        path, token = verify_tree(tree, LazyRows(tree, p), LazyRows(tree, q), False, None)
        for a, b in zip([-1] + path, path):
            assert tree.parents[b] == a, "the accepted nodes do not form a path from the root"
        return tuple(tree.tokens[node] for node in path) + (token,)

    return explorer.law(program)


# The checks (tests/decoding/test_decoding_exact.py runs them; tests/decoding/test_decoding_mutations.py plants bugs under them)
V = 5
PLAIN, TOP_K, TOP_P = Sampling(1.0), Sampling(0.7, top_k=3), Sampling(1.0, top_p=0.9)
PAIRS = {"plain": (PLAIN, PLAIN), "top-k": (TOP_K, TOP_K), "top-p": (TOP_P, TOP_P), "mixed": (TOP_K, TOP_P)}
"""(drafter, target) truncations; `mixed` gives the two different supports."""


def check_chain(monkeypatch, k: int, pair: str, seed: int = 0) -> None:
    draft, target = PAIRS[pair]
    p, q = Rows(V, seed, draft), Rows(V, seed + 1, target)
    assert_target_law(chain_law(Explorer(monkeypatch), p, q, k), q, k + 1)


def check_rejection(monkeypatch, children: int | str, pair: str, seed: int = 0) -> None:
    """`children`: how many are drawn (at most the support), or `stop`: a count that depends on the
    tokens drawn (stop after a token whose id is odd), as sibling counts vary in a stochastic beam."""
    draft, target = PAIRS[pair]
    p, q = Rows(V, seed, draft), Rows(V, seed + 1, target)

    def more(drawn: list[int]) -> bool:
        if children == "stop":
            return not drawn or drawn[-1] % 2 == 0
        return len(drawn) < children

    assert_target_law(rejection_law(Explorer(monkeypatch), p(()), q(()), more), q, 1)


BRANCHING = {"rsd_c-332": [3, 3, 2], "rsd_c-3111": [3, 1, 1, 1]}
BEAMS = {"rsd_s-w3": 3}


def check_tree(monkeypatch, shape: str, pair: str, seed: int = 0) -> None:
    """RSD-C: node at depth d gets b_d children; RSD-S: a beam of width W spread over the nodes of a
    level: a node's sibling count depends on the tokens on its path and the siblings drawn before it
    (0 to W children, none below some nodes before the last level)."""
    draft, target = PAIRS[pair]
    p, q = Rows(V, seed, draft), Rows(V, seed + 1, target)
    if shape in BRANCHING:
        branching = BRANCHING[shape]
        depth = len(branching)

        def more(context: tuple[int, ...], drawn: list[int]) -> bool:
            return len(drawn) < branching[len(context)]
    else:
        width, depth = BEAMS[shape], 3

        def more(context: tuple[int, ...], drawn: list[int]) -> bool:
            allotted = (sum(context) + len(context)) % (width + 1) if context else width
            return len(drawn) < allotted and not (drawn and drawn[-1] == 3)

    assert_target_law(tree_law(Explorer(monkeypatch), p, q, depth, more), q, depth + 1)
