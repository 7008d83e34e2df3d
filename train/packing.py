"""Packing tokenized documents into fixed-length sequences for causal-LM pretraining.

Documents are concatenated, each followed by an EOS separator, and cut into sequences of exactly
`seq_len` tokens, so no compute is spent on padding. A document longer than a sequence continues in
the next one. Every token of every document appears exactly once, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

_END = object()


@dataclass
class PackPosition:
    """Where a `PackedStream` stands: saved in checkpoints so that a resumed run reads the same sequences."""

    epoch: int = 0
    documents: int = 0
    """Documents of `epoch` already read into the buffer."""
    carry: list[int] = field(default_factory=list)
    """Tokens read but not yet emitted (the start of the next sequence)."""


class PackedStream:
    """An endless, resumable stream of packed sequences over epochs of a document source.

    `documents(epoch, start)` yields the token ids of the documents of `epoch` from index `start` on
    (None for a source row that was skipped as invalid: it counts as a document but adds no token);
    it must be a deterministic function of its arguments (e.g. a source shuffled with `seed + epoch`).
    When an epoch runs out, the stream continues with the next one; the buffer carries over, so no
    token is dropped at epoch boundaries either.
    """

    def __init__(
        self,
        documents: Callable[[int, int], Iterator[Sequence[int] | None]],
        seq_len: int,
        eos_id: int,
        position: PackPosition | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self._documents = documents
        self.seq_len = seq_len
        self.eos_id = eos_id
        start = position or PackPosition()
        self.position = PackPosition(start.epoch, start.documents, list(start.carry))
        self._iterator: Iterator[Sequence[int] | None] | None = None

    def _next_document(self) -> Sequence[int]:
        rollovers = 0
        while True:
            if self._iterator is None:
                self._iterator = iter(self._documents(self.position.epoch, self.position.documents))
            doc = next(self._iterator, _END)
            if doc is _END:
                # two whole epochs without a single document (the first end may be a resumed one): empty
                rollovers += 1
                if rollovers > 2:
                    raise ValueError("the pretraining corpus yields no documents")
                self.position.epoch += 1
                self.position.documents = 0
                self._iterator = None
                continue
            self.position.documents += 1
            if doc is not None:
                return doc

    def take(self, count: int) -> list[list[int]]:
        """The next `count` full sequences."""
        carry = self.position.carry
        out = []
        for _ in range(count):
            while len(carry) < self.seq_len:
                carry.extend(self._next_document())
                carry.append(self.eos_id)
            out.append(carry[: self.seq_len])
            del carry[: self.seq_len]
        return out
