"""The pretraining document stream: each training process, and each of its DataLoader workers, reads a
disjoint share of the sources' rows, tokenizes it ahead of the training loop, and resumes from its own
saved position without reading the documents already used.

Shards: with `world` processes of `workers` workers each, reader s = rank x workers + worker of S = world
x workers readers reads row j of a list source when j mod S = s (a slice: nothing else is opened), and of
a streaming `hf` source the share `datasets.distributed.split_dataset_by_node(stream, s, S)` gives it
(whole files when the source has a multiple of S of them, else every S-th example). So adding processes
divides the rows each one reads and tokenizes, and their union is the sources' rows, each once.

A reader's position says, for the epoch being read, its next row of each source, which source reads next
and which have run out (and for a streaming `hf` source, its `datasets` state). Every document comes with
the position of every reader of the process right after it, so the consumer saves the positions of what
it really used, not of what the workers prefetched. A resume opens each source at the reader's saved row:
a list share is sliced, a streaming share loads its `datasets` state (`IterableDataset.load_state_dict`:
shards and offsets; its shuffle buffer is refilled from there, so the documents that were in it are not
seen again). The DataLoader returns its workers' items in turn, so a worker's documents stay in order,
and the position also says whose turn is next: a resumed process hands out the same documents in the same
order as one never stopped.
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


@dataclass(frozen=True)
class Shard:
    """Reader `index` of `count`: a disjoint share of every source's rows."""

    index: int = 0
    count: int = 1


def _open(source: dict[str, Any], seed: int, row: int, hf_state: dict[str, Any] | None, shard: Shard) -> Any:
    """The shard's rows of one source from its `row`-th on (a streaming `hf` source from its saved state);
    a streaming source is returned as the `datasets.IterableDataset` itself, to read its state as it goes."""
    from polydraft.data.sources import read_source

    if not (source["kind"] == "hf" and source["streaming"]):
        return iter(read_source(**{**source, "seed": seed}).rows[shard.index :: shard.count][row:])
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset(
        source["path"], source["name"], split=source["split"], revision=source["revision"], streaming=True
    ).shuffle(seed=seed, buffer_size=10_000)
    if source["limit"] is not None:
        stream = stream.take(source["limit"])
    if shard.count > 1:
        stream = split_dataset_by_node(stream, rank=shard.index, world_size=shard.count)
    if hf_state is not None:
        stream.load_state_dict(hf_state)
    return stream


def _rows(stream: Any) -> Iterator[dict[str, Any]]:
    """The rows of a streaming share one at a time. `IterableDataset.iter` and not `iter(stream)`: inside a
    DataLoader worker the latter splits the share again by worker (datasets' own worker sharding), so a
    reader would miss rows, read others' and fail to load its saved state."""
    for batch in stream.iter(batch_size=1):
        yield {key: values[0] for key, values in batch.items()}


def _normalised(source: dict[str, Any], index: int, raw: dict[str, Any]) -> dict[str, Any] | None:
    from polydraft.data.sources import describe, normalise

    description = describe("hf", source["format"], source["path"], source["name"], source["split"], None)
    rows = normalise(
        [(index, raw)], source["format"], source["fields"], source["pair"], description,
        source["skip_invalid"], f"hf:{source['path']}/{source['split']}",
    ).rows  # fmt: skip
    return rows[0] if rows else None


def texts(
    sources: list[dict[str, Any]],
    seed: int,
    start: StreamPosition,
    epochs: int | None = None,
    shard: Shard = Shard(),
) -> Iterator[tuple[str | None, StreamPosition]]:
    """(document text, position after it) of the shard's rows from `start` on, source after source in
    turn, epoch after epoch (sources shuffled with `seed + epoch`), `epochs` of them or without end. None
    stands for a row skipped as invalid. ValueError when two whole epochs in a row yield no document."""
    position = copy.deepcopy(start)
    empty_epochs = 0
    while epochs is None or position.epoch < epochs:
        count = len(sources)
        if not position.rows:
            position.rows, position.done = [0] * count, [False] * count
            position.hf_states = [None] * count
        readers = [
            _open(s, seed + position.epoch, position.rows[i], position.hf_states[i], shard)
            for i, s in enumerate(sources)
        ]
        streaming = [s["kind"] == "hf" and s["streaming"] for s in sources]
        iterators = [_rows(r) if stream else r for r, stream in zip(readers, streaming, strict=True)]
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
            where = f" for reader {shard.index} of {shard.count}" if shard.count > 1 else ""
            raise ValueError(f"the pretraining corpus yields no documents{where}")
        position = StreamPosition(epoch=position.epoch + 1)


class DocumentStream(IterableDataset):
    """Token ids of one process's documents (None for a skipped row), each with the positions of the
    process's readers after it (`{"readers": [StreamPosition as a dict, ...]}`, one per worker)."""

    def __init__(
        self,
        tokenizer: Any,
        sources: list[dict[str, Any]],
        seed: int,
        starts: list[StreamPosition],
        epochs: int | None = None,
        chunk: int = 64,
        rank: int = 0,
        world: int = 1,
    ):
        self.tokenizer, self.sources, self.seed = tokenizer, sources, seed
        self.starts, self.epochs, self.chunk, self.rank, self.world = starts, epochs, chunk, rank, world

    def __iter__(self) -> Iterator[tuple[list[int] | None, int, dict[str, Any]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        readers = len(self.starts)
        shard = Shard(self.rank * readers + worker, self.world * readers)
        batch: list[tuple[str | None, StreamPosition]] = []
        for item in texts(self.sources, self.seed, self.starts[worker], self.epochs, shard):
            batch.append(item)
            if len(batch) == self.chunk:
                yield from self._encoded(batch, worker)
                batch = []
        yield from self._encoded(batch, worker)

    def _encoded(self, batch: list[tuple[str | None, StreamPosition]], worker: int) -> Iterator[Any]:
        present = [text for text, _ in batch if text is not None]
        encoded = iter(self.tokenizer(present, add_special_tokens=False)["input_ids"] if present else [])
        for text, position in batch:
            yield (None if text is None else list(next(encoded))), worker, asdict(position)


def documents(
    tokenizer: Any,
    sources: list[dict[str, Any]],
    seed: int,
    start: dict[str, Any] | None,
    workers: int,
    rank: int = 0,
    world: int = 1,
) -> Iterator[tuple[list[int] | None, dict[str, Any]]]:
    """Process `rank` of `world`'s documents from a saved position (None: the beginning), read and
    tokenized by `workers` DataLoader worker processes (0: by this process), each with the position of
    every reader after it and the worker whose document comes next (`turn`)."""
    readers = max(1, workers)
    positions = [StreamPosition(**p) for p in start["readers"]] if start else [StreamPosition()] * readers
    if len(positions) != readers:
        raise ValueError(
            f"the saved data position has {len(positions)} readers per process, pretrain.data_workers gives "
            f"{readers}: resume with the same data_workers"
        )
    stream = DocumentStream(tokenizer, sources, seed, positions, rank=rank, world=world)
    items = (
        iter(stream)
        if workers == 0
        else iter(DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_as_is))
    )
    current = [asdict(p) for p in positions]
    # the DataLoader hands out its workers' documents in turn from worker 0 on; a process that stopped
    # after worker `turn - 1`'s document goes on with worker `turn`'s, so documents wait for their turn
    turn = start.get("turn", 0) if start else 0
    waiting: list[list[Any]] = [[] for _ in range(readers)]
    for ids, worker, after in items:
        waiting[worker].append((ids, after))
        while waiting[turn]:
            ids, after = waiting[turn].pop(0)
            current[turn] = after
            turn = (turn + 1) % readers
            yield ids, {"readers": [dict(p) for p in current], "turn": turn}


def _as_is(item: Any) -> Any:
    return item


def corpus_tokens(tokenizer: Any, sources: list[dict[str, Any]], seed: int) -> int:
    """Tokens of one epoch of every reader, each document followed by its separator."""
    stream = DocumentStream(tokenizer, sources, seed, [StreamPosition()], epochs=1)
    return sum(len(ids) + 1 for ids, _, _ in stream if ids is not None)
