"""The distill stage's mix, tokenized once per run into an Arrow file that every process memory-maps.

Tokenizing the mix in every process into Python lists costs each rank memory in proportion to the mix
(and the tokenizing time, once per rank). Here the main process reads the mix files with `datasets`
(JSON to Arrow, in chunks) and tokenizes them with a batched `map` into
`<cache_dir>/<split>-<key>.arrow`; the other processes wait (`main_process_first`) and open the same file,
memory-mapped. `key` is a fingerprint of the mix files' bytes, the tokenizer, `max_length`, the
temperatures kept and `loss_on`, so a changed mix or setting tokenizes anew and a rerun (or a resumed
run) reads the file it made. The examples are those of `train.data.encode_texts`, in the mix's order,
rows without a response token within `max_length` dropped and counted.

A mix of more than PARALLEL_BYTES is tokenized by up to TOKENIZE_PROCESSES processes (`map(num_proc)`:
contiguous shards, the same examples in the same order): one process tokenizes about 1.7 MB of mix a
second (`bench/results/run_disk.md`), so a 1.5 GB mix would keep the other ranks waiting a quarter of an
hour.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polydraft.data.mix import keeps_row
from polydraft.train.data import encode_texts

# bump when the encoding changes, so that caches of an older encoding are not read
ENCODING_VERSION = "1"
PARALLEL_BYTES = 64 << 20
"""Mixes larger than this are tokenized by several processes (a pool costs seconds to start)."""
TOKENIZE_PROCESSES = 8


def tokenize_processes(mix_bytes: int) -> int | None:
    """`num_proc` of the tokenizing `map`: None (this process) for a small mix, else up to
    TOKENIZE_PROCESSES, at most the cores this process may use."""
    if mix_bytes <= PARALLEL_BYTES:
        return None
    return max(1, min(TOKENIZE_PROCESSES, len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class MixExamples:
    """Encoded mix rows: `examples[i]` is `{"input_ids": [...], "labels": [...]}` (a memory-mapped
    `datasets.Dataset`), `rows` the rows kept by temperature, `dropped` those of them left without a
    response token, `distilled` the kept rows that are the target's own answers."""

    examples: Any
    rows: int
    dropped: int
    distilled: int


def _features() -> tuple[Any, Any]:
    from datasets import Features, Sequence, Value

    raw = Features(
        {
            "id": Value("string"),
            "pair": Value("string"),
            "origin": Value("string"),
            "prompt": Value("string"),
            "response": Value("string"),
            "temperature": Value("float64"),
            "sample_index": Value("int64"),
        }
    )
    encoded = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))})
    return raw, encoded


def cache_key(files: list[Path], tokenizer: Any, settings: dict[str, Any]) -> str:
    """Fingerprint of the mix files' bytes (read in chunks), the tokenizer and the encoding settings."""
    from datasets.fingerprint import Hasher

    digest = hashlib.sha256(f"{ENCODING_VERSION}|{sorted(settings.items())!r}".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    digest.update(Hasher.hash(tokenizer).encode())
    return digest.hexdigest()[:20]


def _encoder(
    tokenizer: Any, max_length: int, temperatures: list[float] | None, loss_on: str, open_rows: bool
) -> Callable[[dict[str, list[Any]]], dict[str, list[list[int]]]]:
    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        rows = [
            (prompt, response)
            for prompt, response, origin, temperature in zip(
                batch["prompt"], batch["response"], batch["origin"], batch["temperature"], strict=True
            )
            if keeps_row(origin, temperature, temperatures, open_rows)
        ]
        examples = [e for e in encode_texts(tokenizer, rows, max_length) if e is not None]
        return {
            "input_ids": [e["input_ids"] for e in examples],
            "labels": [e["input_ids"] if loss_on == "all" else e["labels"] for e in examples],
        }

    return encode


def mix_examples(
    files: list[Path],
    tokenizer: Any,
    *,
    split: str,
    temperatures: list[float] | None,
    loss_on: str,
    max_length: int,
    cache_dir: Path,
    main_process_first: Callable[[], AbstractContextManager[Any]],
    open_rows: bool = True,
) -> MixExamples:
    """The encoded rows of the mix `files` (in order), from the cache under `cache_dir`, made by the
    first process to enter `main_process_first()` (`accelerator.main_process_first`; a
    `contextlib.nullcontext` for one process). `loss_on: all` puts the labels on the prompt too;
    `open_rows: False` keeps the target's own answers only."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Dataset

    raw_features, encoded_features = _features()
    files = [path for path in files if path.stat().st_size > 0]
    if not files:
        return MixExamples(Dataset.from_dict({"input_ids": [], "labels": []}, encoded_features), 0, 0, 0)
    settings = {"max_length": max_length, "temperatures": temperatures, "loss_on": loss_on}
    if not open_rows:  # only then in the key: caches of the other trainers keep theirs
        settings["open_rows"] = False
    key = cache_key(files, tokenizer, settings)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with main_process_first():
        raw = Dataset.from_json(
            [str(path) for path in files], features=raw_features, cache_dir=str(cache_dir / "json")
        )
        examples = raw.map(
            _encoder(tokenizer, max_length, temperatures, loss_on, open_rows),
            batched=True,
            num_proc=tokenize_processes(sum(path.stat().st_size for path in files)),
            remove_columns=raw.column_names,
            features=encoded_features,
            cache_file_name=str(cache_dir / f"{split}-{key}.arrow"),
            new_fingerprint=key,
            desc=f"tokenizing the {split} mix",
        )
    # the counts come from two columns of the memory-mapped raw rows, not from the texts
    distill = pc.equal(raw.data.column("origin"), "distill")
    if temperatures is None:
        distilled = pc.sum(distill).as_py() or 0
    else:
        kept = pa.array(temperatures, type=pa.float64())
        at_temperature = pc.and_kleene(distill, pc.is_in(raw.data.column("temperature"), value_set=kept))
        distilled = pc.sum(at_temperature).as_py() or 0
    rows = distilled + ((len(raw) - (pc.sum(distill).as_py() or 0)) if open_rows else 0)
    return MixExamples(examples, rows, rows - len(examples), distilled)


def load_examples(
    distill_dir: Path,
    tokenizer: Any,
    split: str,
    *,
    temperatures: list[float] | None,
    loss_on: str,
    max_length: int,
    cache_dir: Path,
    main_process_first: Callable[[], AbstractContextManager[Any]],
    pairs: list[str] | None = None,
    need_distilled: bool = False,
    open_rows: bool = True,
) -> MixExamples:
    """`mix_examples` of the `split` mix of `pairs` (default: every pair, in sorted order). ValueError
    when the distill folder holds no mix, FileNotFoundError when a pair has no train split (a pair
    without an `eval` split adds no eval row). `need_distilled`: a ValueError when no distilled row is
    kept (training on open rows alone would not teach the drafter the target's own answers)."""
    from polydraft.data.mix import mix_file, mix_pairs

    pairs = mix_pairs(distill_dir) if pairs is None else pairs
    if not pairs:
        raise ValueError(f"{distill_dir}/mix holds no pair; did the distill stage write one?")
    files = []
    for pair in pairs:
        try:
            files.append(mix_file(distill_dir, pair, split))
        except FileNotFoundError:
            if split == "train":
                raise
    mix = mix_examples(
        files, tokenizer, split=split, temperatures=temperatures, loss_on=loss_on, max_length=max_length,
        cache_dir=cache_dir, main_process_first=main_process_first, open_rows=open_rows,
    )  # fmt: skip
    if need_distilled and mix.distilled == 0:
        kept = "any temperature" if temperatures is None else f"temperatures {temperatures}"
        where = files[0] if len(files) == 1 else Path(distill_dir) / "mix"
        raise ValueError(f"{where}: no distilled row at {kept} ({mix.rows} open rows only)")
    return mix


class BalancedMix(Sequence):
    """Several pairs' encoded rows as one sequence, balanced by pair (`balanced_union`): row `i` is
    `parts[k][j]` for `(k, j) = index[i]`, read one at a time (a part may be a memory-mapped dataset)."""

    def __init__(self, parts: list[Any], index: list[tuple[int, int]]):
        self.parts, self.index = parts, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        part, row = self.index[i]
        return self.parts[part][row]


def balanced_union(mixes: dict[str, Any], seed: int) -> tuple[BalancedMix, dict[str, int]]:
    """(the union of the pairs' encoded rows, rows per pair in it). Every pair gives as many rows as the
    largest one has: all of its own rows once, then as many again as it lacks, drawn without replacement
    in a seeded order (repeated passes while it still lacks rows). Pairs are taken in sorted order; the
    training batches shuffle the union. ValueError for a pair without rows (it cannot be balanced)."""
    empty = sorted(pair for pair, examples in mixes.items() if len(examples) == 0)
    if not mixes or empty:
        raise ValueError(f"no encoded rows for pairs {empty} to balance the multilingual mix with")
    largest = max(len(examples) for examples in mixes.values())
    parts, index, counts = [], [], {}
    for part, pair in enumerate(sorted(mixes)):
        examples = mixes[pair]
        rows = list(range(len(examples)))
        rng = random.Random(f"{seed}/balanced/{pair}")
        while len(rows) < largest:
            extra = list(range(len(examples)))
            rng.shuffle(extra)
            rows.extend(extra[: largest - len(rows)])
        parts.append(examples)
        index.extend((part, row) for row in rows)
        counts[pair] = len(rows)
    return BalancedMix(parts, index), counts
