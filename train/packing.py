"""Packing tokenized documents into fixed-length sequences for causal-LM pretraining.

Documents are concatenated, each followed by an EOS separator, and cut into sequences of exactly
`seq_len` tokens, so no compute is spent on padding. A document longer than a sequence continues in
the next one. Every token of every document appears exactly once, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PackPosition:
    """Where a `PackedStream` stands: saved in checkpoints so that a resumed run reads the same sequences."""

    stream: dict[str, Any] | None = None
    """The document source's position after the last document read into the buffer (None: its start)."""
    carry: list[int] = field(default_factory=list)
    """Tokens read but not yet emitted (the start of the next sequence)."""


Documents = Callable[[dict[str, Any] | None], Iterator[tuple[Sequence[int] | None, dict[str, Any]]]]
"""`documents(position)`: the token ids of the documents after `position` (None: from the start), each
with the position right after it, endless (epoch after epoch); None stands for a source row skipped as
invalid (it adds no token). It must be a deterministic function of the position (`train/stream.py`)."""


class PackedStream:
    """An endless, resumable stream of packed sequences over a document source.

    The buffer carries over epoch boundaries, so no token is dropped there either.
    """

    def __init__(self, documents: Documents, seq_len: int, eos_id: int, position: PackPosition | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self._documents = documents
        self.seq_len = seq_len
        self.eos_id = eos_id
        start = position or PackPosition()
        self.position = PackPosition(start.stream, list(start.carry))
        self._iterator: Iterator[tuple[Sequence[int] | None, dict[str, Any]]] | None = None

    @property
    def epoch(self) -> int:
        """The pass over the corpus being read (0: the first; its readers' least)."""
        if not self.position.stream:
            return 0
        return min(int(reader["epoch"]) for reader in self.position.stream["readers"])

    def _next_document(self) -> Sequence[int]:
        if self._iterator is None:
            self._iterator = self._documents(self.position.stream)
        while True:
            doc, self.position.stream = next(self._iterator)
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
