"""The pretraining data path's throughput with 1 and 2 training processes: documents read and tokenized per
second, the processes' shares together (`train/stream.py`: each process reads a disjoint share).

Each configuration reads `--documents` documents of the offline corpus in all (each of W processes its
share, at the same time, with `--workers` DataLoader workers each) and is timed from start to the last
process's end; configurations alternate within each of `--repeats` repetitions; mean ± std.

    python -m bench.data_path --record bench/results/data_path.md
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import time
from pathlib import Path

from bench.held_out import mean_std, record


def _read(rank: int, world: int, count: int, workers: int, out: multiprocessing.Queue, barrier) -> None:
    from polydraft.models.loading import load_tokenizer
    from polydraft.pipelines.schema.common import SourceConfig, reader_args
    from polydraft.train.stream import documents

    tokenizer = load_tokenizer(str(_target()), None, False)
    sources = [reader_args(SourceConfig(kind="offline", format="text", limit=20000), 0, _offline())]
    tokens = 0
    barrier.wait()
    out.put(("ready", rank))
    for ids, _ in itertools.islice(documents(tokenizer, sources, 0, None, workers, rank, world), count):
        tokens += len(ids or [])
    out.put(("done", tokens))


def _target() -> Path:
    return next(Path("recipes/demo/target").glob("*/config.json")).parent


def _offline():
    from polydraft.pipelines.schema.common import OfflineCorpusConfig

    return OfflineCorpusConfig()


def run(world: int, count: int, workers: int) -> float:
    """Tokens per second of `world` processes reading `count` documents in all."""
    queue: multiprocessing.Queue = multiprocessing.Queue()
    barrier = multiprocessing.Barrier(world)
    processes = [
        multiprocessing.Process(target=_read, args=(rank, world, count // world, workers, queue, barrier))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    for _ in range(world):
        assert queue.get()[0] == "ready"
    start = time.perf_counter()
    tokens = sum(queue.get()[1] for _ in range(world))
    seconds = time.perf_counter() - start
    for process in processes:
        process.join()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeats):
        for world in rates:
            rates[world].append(run(world, args.documents, args.workers))
    lines = ["| processes | tokens/s (all processes) |", "| ---: | ---: |"]
    lines += [f"| {world} | {mean_std(values, 0)} |" for world, values in rates.items()]
    setting = (
        f"{args.documents} documents of the offline corpus in all, {args.workers} DataLoader worker(s) per "
        f"process, {args.repeats} repetitions (mean ± std), the configurations alternating; timed from the "
        "moment all processes are ready to the last one done (imports and tokenizer loading left out)."
    )
    record("data_path", setting, lines, args.record)


if __name__ == "__main__":
    main()
