"""Table language models: the interface the decoders call (`CachedLM`, `SelfSpeculative`) without a network.

A decoder's losslessness depends on which context each logits row belongs to, not on how the logits are
computed. These doubles give every context its own pseudo-random logits (a function of the positioned
tokens the row can see), so that a decode costs microseconds instead of milliseconds and the exact
output distribution is computable by enumeration. They honour what the real models honour:

- the cache is a list of (position, token) entries; `crop` and `keep` act on it as they do on KV caches;
- a row sees the cached entries and the new inputs its attention mask allows (causal without a mask),
  at the position ids given (consecutive after the cache without them);
- the logits of a row depend on the visible (position, token) pairs, positions included: a row that
  sees a stale or missing token, or sees a token at the wrong position, gets other logits, as a
  transformer would.

A context is well formed when its positions are 0, 1, ..., n-1; `TableModel.logits(tokens)` gives
the logits of such a context, which is what the exact distributions are computed from.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

HIDDEN = 4


class TableModel:
    """Pseudo-random logits [V] and hidden states [HIDDEN] per context of (position, token) pairs.

    `base`, when given, is a model this one resembles: its logits plus `noise` times standard normals
    (a drafter that agrees with its target to a chosen degree).
    """

    def __init__(self, vocab: int, seed: int, scale: float = 1.0, base: TableModel | None = None, noise=0.0):
        self.vocab, self.seed, self.scale, self.base, self.noise = vocab, seed, scale, base, noise
        self.memo: dict[tuple[tuple[int, int], ...], tuple[list[float], list[float]]] = {}

    def row(self, context: tuple[tuple[int, int], ...]) -> tuple[list[float], list[float]]:
        """(logits, hidden) of a context given as sorted (position, token) pairs."""
        found = self.memo.get(context)
        if found is None:
            rng = random.Random(hash((self.seed, context)))
            if self.base is None:
                logits = [self.scale * rng.gauss(0.0, 1.0) for _ in range(self.vocab)]
            else:
                logits = [x + self.noise * rng.gauss(0.0, 1.0) for x in self.base.row(context)[0]]
            hidden = [rng.random() for _ in range(HIDDEN)]
            found = self.memo[context] = (logits, hidden)
        return found

    def logits(self, tokens: list[int]) -> Tensor:
        """Logits [V] after the well-formed context `tokens` (positions 0..n-1)."""
        return torch.tensor(self.row(tuple(enumerate(tokens)))[0], dtype=torch.float64)


class TableLM:
    """`decoding.lm.CachedLM`'s interface over a `TableModel` (float64 logits, CPU)."""

    device = torch.device("cpu")
    dtype = torch.float32
    window = None

    def __init__(self, model: TableModel) -> None:
        self.table = model
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[int, int]] = []
        self.seconds = 0.0
        self.calls = 0

    @property
    def length(self) -> int:
        return len(self.cache)

    def forward(
        self,
        input_ids: Tensor,
        num_logits: int = 1,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        tokens = input_ids.view(-1).tolist()
        cached = len(self.cache)
        if position_ids is None:
            positions = list(range(cached, cached + len(tokens)))
        else:
            positions = position_ids.view(-1).tolist()
        entries = self.cache + list(zip(positions, tokens))
        if attention_mask is None:
            visible = [range(cached + i + 1) for i in range(len(tokens))]
        else:
            allowed = (attention_mask[0, 0] == 0).tolist()
            if len(allowed) != len(tokens) or len(allowed[0]) != len(entries):
                raise ValueError(
                    f"mask {tuple(attention_mask.shape)} for {len(tokens)} inputs after {cached}"
                )
            visible = [[j for j, ok in enumerate(row) if ok] for row in allowed]
        rows = [self.table.row(tuple(sorted(entries[j] for j in seen))) for seen in visible[-num_logits:]]
        self.cache = entries
        self.calls += 1
        logits = torch.tensor([r[0] for r in rows], dtype=torch.float64)
        return logits, torch.tensor([r[1] for r in rows], dtype=torch.float64)

    def crop(self, length: int) -> None:
        del self.cache[length:]

    def keep(self, start: int, indices: list[int]) -> None:
        self.cache = self.cache[:start] + [self.cache[start + i] for i in indices]


class TableSelfSpeculative:
    """`decoding.eesd.SelfSpeculative`'s interface: one cache shared by an early-exit drafter and its target.

    Three slot groups as in the real class: the shared layers (every token drafted or verified goes
    through them once), the deep layers (the target's remaining layers) and the exit layers. The shared
    group's tokens are the context of both models; the deep and exit groups hold a prefix of them.
    Drafting reads the exit head's table at the newest shared position; verification runs the deep
    layers on every shared position they have not processed and reads the target's table there. A
    deep or exit group asked to process positions it already holds, or that the shared group lacks,
    raises: the real cache would hold stale or missing states.
    """

    device = torch.device("cpu")
    shared_slots = [0]
    deep_slots = [1]

    def __init__(self, target: TableModel, drafter: TableModel, exit_layers: bool = True) -> None:
        self.target, self.drafter_table = target, drafter
        self.exit_slots = [2] if exit_layers else []
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.lengths = {0: 0, 1: 0, 2: 0}
        self.draft_seconds = self.target_seconds = 0.0
        self.draft_calls = self.target_calls = 0

    def length(self, slots: list[int]) -> int:
        return self.lengths[slots[0]] if slots else 0

    def _shared(self, input_ids: Tensor) -> None:
        self.tokens.extend(input_ids.view(-1).tolist())
        self.lengths[0] = len(self.tokens)

    def draft_step(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        self._shared(input_ids)
        if self.exit_slots:
            self.lengths[2] = len(self.tokens)
        logits, hidden = self.drafter_table.row(tuple(enumerate(self.tokens)))
        self.draft_calls += 1
        return torch.tensor(logits, dtype=torch.float64), torch.tensor(hidden, dtype=torch.float64)

    def verify(self, pending: Tensor, num_logits: int) -> tuple[Tensor, Tensor]:
        if pending.numel():
            self._shared(pending)
        first, end = self.lengths[1], len(self.tokens)
        if end - first < num_logits:
            raise ValueError(f"{num_logits} logits asked, the deep layers process {end - first} positions")
        rows = [self.target.row(tuple(enumerate(self.tokens[: i + 1]))) for i in range(end - num_logits, end)]
        self.lengths[1] = end
        self.target_calls += 1
        logits = torch.tensor([r[0] for r in rows], dtype=torch.float64)
        return logits, torch.tensor([r[1] for r in rows], dtype=torch.float64)

    def crop(self, shared_and_deep: int, exit_length: int) -> None:
        del self.tokens[shared_and_deep:]
        self.lengths[0] = len(self.tokens)
        self.lengths[1] = min(self.lengths[1], shared_and_deep)
        if self.exit_slots:
            if exit_length > self.lengths[2]:
                raise ValueError(f"exit layers cropped to {exit_length} > {self.lengths[2]} positions held")
            self.lengths[2] = exit_length


class TableFeatureLM(TableLM):
    """`CachedLM(model, aux_layers=...)`'s interface: also `features` [n, HIDDEN] of every new position
    (the table's hidden state of the context that position sees)."""

    aux_layers = [0]

    def forward(
        self,
        input_ids: Tensor,
        num_logits: int = 1,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        new = input_ids.numel()
        logits, hidden = super().forward(input_ids, new, position_ids, attention_mask)
        self.features = hidden
        return logits[-num_logits:], hidden[-num_logits:]


class TableEagle3:
    """`decoding.eagle3.Eagle3Drafter`'s interface over a `TableModel`: the draft logits of a context of
    (position, token, feature) entries, so that a token read at the wrong position, a stale feature or a
    draft step's entry left in the cache gives other logits, as the real head's cache would. The last
    token of the vocabulary lies outside its draft vocabulary (probability zero)."""

    aux_layers = [0]

    def __init__(self, table: TableModel) -> None:
        self.table = table
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[int, int, tuple[float, ...]]] = []
        self.true_length = 0
        self.last: tuple[float, ...] = ()
        self.seconds = 0.0
        self.calls = 0

    @property
    def length(self) -> int:
        return len(self.cache)

    def read(self, tokens: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.shape[0] != features.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for {features.shape[0]} feature rows")
        for token, feature in zip(tokens.tolist(), features.tolist(), strict=True):
            self.cache.append((len(self.cache), token, tuple(round(x, 6) for x in feature)))
        self.true_length = len(self.cache)
        return self._row()

    def step(self, token: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.append((len(self.cache), int(token.view(-1)[0]), self.last))
        return self._row()

    def drop_drafts(self) -> None:
        del self.cache[self.true_length :]

    def _row(self) -> tuple[Tensor, Tensor]:
        logits, hidden = self.table.row(tuple(self.cache))
        self.last = tuple(round(x, 6) for x in hidden)
        self.calls += 1
        row = torch.tensor(logits, dtype=torch.float64)
        row[-1] = float("-inf")
        return row, torch.tensor(hidden, dtype=torch.float64)
