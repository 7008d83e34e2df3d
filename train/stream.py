"""The pretraining document stream: sources read in turn, tokenized by DataLoader workers ahead of the
training loop, and resumable from a saved position without reading the documents already used.

A position says, for the epoch being read, the next row of each source, which source reads next and
which have run out (and for a streaming `hf` source, its `datasets` state). Every document comes with the
position right after it, so the consumer saves the position of what it really used, not of what the
workers prefetched. A resume opens each source at its saved row: a list source is sliced, a streaming
`hf` source loads its `datasets` state (`IterableDataset.load_state_dict`: shards and offsets; its shuffle
buffer is refilled from there, so the documents that were in it are not seen again).

With `workers` > 0, every worker walks the same sequence of rows (reading is cheap) and tokenizes only
its share, document i going to worker i mod workers; the DataLoader returns workers' items in turn, so
the documents arrive in order. Each worker of a streaming source streams it too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from polydraft.train.data import document_text


@dataclass
class StreamPosition:
    """Where the document stream stands (saved in pretraining checkpoints)."""

    epoch: int = 0
    rows: list[int] = field(default_factory=list)
    """Next raw row of each source in this epoch (streaming sources count rows too, for the log)."""
    turn: int = 0
    """The source that reads next (round robin over the sources not run out)."""
    done: list[bool] = field(default_factory=list)
    hf_states: list[dict[str, Any] | None] = field(default_factory=list)
    """`datasets` state of each streaming source; None for the others or before their first row."""
    documents: int = 0
    """Documents of this epoch read so far."""


def _open(source: dict[str, Any], seed: int, row: int, hf_state: dict[str, Any] | None) -> Any:
    """Rows of one source from `row` on (a streaming `hf` source from its saved state); a streaming
    source is returned as the `datasets.IterableDataset` itself, to read its state as it goes."""
    from polydraft.distill.sources import read_source

    if not (source["kind"] == "hf" and source["streaming"]):
        return iter(read_source(**{**source, "seed": seed}).rows[row:])
    import datasets

    stream = datasets.load_dataset(
        source["path"], source["name"], split=source["split"], revision=source["revision"], streaming=True
    ).shuffle(seed=seed, buffer_size=10_000)
    if source["limit"] is not None:
        stream = stream.take(source["limit"])
    if hf_state is not None:
        stream.load_state_dict(hf_state)
    return stream


def _normalised(source: dict[str, Any], index: int, raw: dict[str, Any]) -> dict[str, Any] | None:
    from polydraft.distill.sources import describe, normalise

    description = describe("hf", source["format"], source["path"], source["name"], source["split"], None)
    rows = normalise(
        [(index, raw)], source["format"], source["fields"], source["pair"], description,
        source["skip_invalid"], f"hf:{source['path']}/{source['split']}",
    ).rows  # fmt: skip
    return rows[0] if rows else None


def texts(
    sources: list[dict[str, Any]], seed: int, start: StreamPosition, epochs: int | None = None
) -> Iterator[tuple[str | None, StreamPosition]]:
    """(document text, position after it) from `start` on, source after source in turn, epoch after
    epoch (sources shuffled with `seed + epoch`), `epochs` of them or without end. None stands for a row
    skipped as invalid. ValueError when two whole epochs in a row yield no document."""
    position = copy.deepcopy(start)
    empty_epochs = 0
    while epochs is None or position.epoch < epochs:
        count = len(sources)
        if not position.rows:
            position.rows, position.done = [0] * count, [False] * count
            position.hf_states = [None] * count
        readers = [
            _open(s, seed + position.epoch, position.rows[i], position.hf_states[i])
            for i, s in enumerate(sources)
        ]
        streaming = [s["kind"] == "hf" and s["streaming"] for s in sources]
        iterators = [iter(r) for r in readers]
        read_before = position.documents
        while not all(position.done):
            i = position.turn
            position.turn = (i + 1) % count
            if position.done[i]:
                continue
            raw = next(iterators[i], None)
            if raw is None:
                position.done[i] = True
                continue
            source = sources[i]
            row = _normalised(source, position.rows[i], raw) if streaming[i] else raw
            position.rows[i] += 1
            if streaming[i]:
                position.hf_states[i] = readers[i].state_dict()
            position.documents += 1
            yield (None if row is None else document_text(row, source["format"])), copy.deepcopy(position)
        empty_epochs = empty_epochs + 1 if position.documents == read_before else 0
        if empty_epochs >= 2:
            raise ValueError("the pretraining corpus yields no documents")
        position = StreamPosition(epoch=position.epoch + 1)


class DocumentStream(IterableDataset):
    """Token ids of the documents (None for a skipped row) with the position after each, as dicts."""

    def __init__(
        self,
        tokenizer: Any,
        sources: list[dict[str, Any]],
        seed: int,
        start: StreamPosition,
        epochs: int | None = None,
        chunk: int = 64,
    ):
        self.tokenizer, self.sources, self.seed = tokenizer, sources, seed
        self.start, self.epochs, self.chunk = start, epochs, chunk

    def __iter__(self) -> Iterator[tuple[list[int] | None, dict[str, Any]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch: list[tuple[str | None, StreamPosition]] = []
        for index, item in enumerate(texts(self.sources, self.seed, self.start, self.epochs)):
            if index % workers == worker:
                batch.append(item)
            if len(batch) == self.chunk:
                yield from self._encoded(batch)
                batch = []
        yield from self._encoded(batch)

    def _encoded(self, batch: list[tuple[str | None, StreamPosition]]) -> Iterator[Any]:
        present = [text for text, _ in batch if text is not None]
        encoded = iter(self.tokenizer(present, add_special_tokens=False)["input_ids"] if present else [])
        for text, position in batch:
            yield (None if text is None else list(next(encoded))), asdict(position)


def documents(
    tokenizer: Any, sources: list[dict[str, Any]], seed: int, start: dict[str, Any] | None, workers: int
) -> Iterator[tuple[list[int] | None, dict[str, Any]]]:
    """The stream from a saved position (None: the beginning), tokenized by `workers` DataLoader worker
    processes (0: in this process)."""
    position = StreamPosition(**start) if start else StreamPosition()
    stream = DocumentStream(tokenizer, sources, seed, position)
    if workers == 0:
        return iter(stream)
    loader = DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_as_is)
    return iter(loader)


def _as_is(item: Any) -> Any:
    return item


def corpus_tokens(tokenizer: Any, sources: list[dict[str, Any]], seed: int) -> int:
    """Tokens of one epoch, each document followed by its separator."""
    stream = DocumentStream(tokenizer, sources, seed, StreamPosition(), epochs=1)
    return sum(len(ids) + 1 for ids, _ in stream if ids is not None)
