"""Append-only, sharded JSONL records that survive a crash or `kill -9`.

Records live in `<dir>/records/shard<NNNNN>-part<NNNNN>.jsonl` (`shard<NNNNN>-engine<EE>-part<NNNNN>.jsonl`
when several vLLM engines write at once, see `distill/engines.py`). Every run opens a new part file and
appends whole lines in one write per batch, then flushes and fsyncs, so a kill loses at most the batch
being written: at worst a torn last line, which `repair()` cuts off before the next run reads the keys
that are done. `datasets.load_dataset("json", data_files=".../records/*.jsonl")` loads the folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polydraft.distill.requests import Generation, Key, Request, record_id, request_seed

log = logging.getLogger(__name__)

RECORDS_DIR = "records"
_PART = re.compile(r"shard(\d+)(?:-engine\d+)?-part(\d+)\.jsonl$")


class StoreError(RuntimeError):
    """Record files that cannot be trusted (a corrupt line in the middle, a duplicated key)."""


def record_key(record: dict[str, Any]) -> Key:
    return (record["prompt_id"], float(record["temperature"]), int(record["sample_index"]))


def record_files(directory: Path) -> list[Path]:
    root = Path(directory) / RECORDS_DIR
    return sorted(p for p in root.glob("*.jsonl") if _PART.search(p.name)) if root.is_dir() else []


def _cut_torn_tail(path: Path) -> int:
    """Truncate a file after its last newline; returns the number of bytes cut."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as handle:
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return 0
        # scan backwards in blocks for the last complete line
        end = size
        while end > 0:
            start = max(0, end - 65536)
            handle.seek(start)
            block = handle.read(end - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return size - keep


RECORD_FIELDS = {
    "id": str,
    "prompt_id": str,
    "pair": str,
    "prompt": str,
    "temperature": (int, float),
    "sample_index": int,
    "response": str,
    "finish_reason": (str, type(None)),
    "prompt_tokens": int,
    "response_tokens": int,
}
"""The fields every reader of the records uses, with their JSON types."""


def parse_record(line: bytes, where: str) -> dict[str, Any]:
    """One record line; a line that is not UTF-8 JSON of the record's shape is an error naming `where`."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise StoreError(
            f"{where}: not UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1})"
        ) from err
    except json.JSONDecodeError as err:
        raise StoreError(f"{where}: not a JSON record ({err})") from err
    if not isinstance(record, dict):
        raise StoreError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    wrong = [
        name
        for name, kind in RECORD_FIELDS.items()
        if name not in record or not isinstance(record[name], kind) or isinstance(record[name], bool)
    ]
    if wrong:
        raise StoreError(f"{where}: not a distill record: missing or mistyped {', '.join(wrong)}")
    return record


def iter_records(directory: Path) -> Iterator[dict[str, Any]]:
    """Every record of a folder, file by file; a line that is not a record is an error naming file and line."""
    for path in record_files(directory):
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                yield parse_record(line, f"{path}:{number}")


class RecordStore:
    """The records of one shard of the distill stage, in `<directory>/records/`; `engine` names the files
    of one of several engines that write at once (each to its own files)."""

    def __init__(self, directory: Path, shard_index: int, records_per_file: int, engine: int | None = None):
        self.root = Path(directory) / RECORDS_DIR
        self.directory = Path(directory)
        self.shard_index = shard_index
        self.records_per_file = records_per_file
        self.prefix = f"shard{shard_index:05d}" + (f"-engine{engine:02d}" if engine is not None else "")
        self._handle: Any = None
        self._in_file = 0
        self._next_part = 0

    def repair(self) -> int:
        """Cut torn last lines left by a kill; returns the number of bytes cut."""
        cut = 0
        for path in record_files(self.directory):
            dropped = _cut_torn_tail(path)
            if dropped:
                log.warning("%s: cut a torn last line (%d bytes) left by an interrupted run", path, dropped)
            if path.stat().st_size == 0:
                path.unlink()  # an empty file would trip `datasets`' schema inference
            cut += dropped
        return cut

    def keys(self) -> set[Key]:
        """Keys of the records written so far; a key written twice is an error."""
        keys: set[Key] = set()
        for record in iter_records(self.directory):
            key = record_key(record)
            if key in keys:
                raise StoreError(f"{self.root}: record {record['id']!r} is written twice")
            keys.add(key)
        return keys

    def _open_next(self) -> None:
        self.close()
        self.root.mkdir(parents=True, exist_ok=True)
        parts = [int(m.group(2)) for p in record_files(self.directory) if (m := _PART.search(p.name))]
        self._next_part = max([self._next_part, *[p + 1 for p in parts]])
        path = self.root / f"{self.prefix}-part{self._next_part:05d}.jsonl"
        self._next_part += 1
        self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across batches
        self._in_file = 0

    def append(self, records: list[dict[str, Any]]) -> None:
        """Write records as whole lines, one write per file, then flush and fsync."""
        while records:
            if self._handle is None or self._in_file >= self.records_per_file:
                self._open_next()
            room = self.records_per_file - self._in_file
            chunk, records = records[:room], records[room:]
            self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chunk))
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._in_file += len(chunk)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class RecordWriter:
    """Turns backend answers into records, appends them per batch of `batch_size`, remembers failures.

    A record holds: id, prompt_id, source, pair, messages, reference ("" if none), prompt (the exact
    string), temperature, sample_index, seed, response, finish_reason, prompt_tokens, response_tokens
    (-1 if unknown), backend, model, model_revision, and token_ids when the backend returns them (the
    key is left out otherwise, so that every file has the same column types for `datasets`).
    """

    def __init__(
        self,
        store: RecordStore,
        meta: dict[str, Any],
        seed: int,
        batch_size: int,
        done: set[Key],
        bar: Any,
        log_metrics: Callable[[dict[str, Any]], None],
    ):
        self.store, self.meta, self.seed, self.batch_size = store, meta, seed, batch_size
        self.done, self.bar, self.log_metrics = done, bar, log_metrics
        self.buffer: list[dict[str, Any]] = []
        self.failures: dict[Key, str] = {}
        self.written = 0
        self.response_tokens = 0
        self.last_log = time.time()

    def emit(self, request: Request, sample_index: int, generation: Generation) -> None:
        key = request.key(sample_index)
        if key in self.done:  # never write a key twice, whatever a backend does
            log.warning("distill: %s answered twice; keeping the first answer", record_id(key))
            return
        self.done.add(key)
        self.failures.pop(key, None)
        item = request.item
        record = {
            "id": record_id(key),
            "prompt_id": item.id,
            "source": item.source,
            "pair": item.pair,
            "messages": item.messages,
            "reference": item.reference,
            "prompt": item.prompt,
            "temperature": request.temperature,
            "sample_index": sample_index,
            "seed": request_seed(self.seed, key),
            "response": generation.text,
            "finish_reason": generation.finish_reason,
            "prompt_tokens": generation.prompt_tokens,
            "response_tokens": generation.response_tokens,
            **self.meta,
        }
        if generation.token_ids is not None:
            record["token_ids"] = generation.token_ids
        self.buffer.append(record)
        self.response_tokens += max(0, generation.response_tokens)
        if len(self.buffer) >= self.batch_size:
            self.flush()

    def absorb(self, keys: set[Key], failures: dict[Key, str], written: int, response_tokens: int) -> None:
        """Count what engine processes wrote to the same store (`distill/engines.py`): the keys now on
        disk, the samples that failed, the records and response tokens they wrote."""
        self.done |= keys
        self.failures.update({key: why for key, why in failures.items() if key not in self.done})
        self.written += written
        self.response_tokens += response_tokens

    def fail(self, request: Request, sample_index: int, reason: str) -> None:
        self.failures[request.key(sample_index)] = reason

    def flush(self) -> None:
        if not self.buffer:
            return
        self.store.append(self.buffer)
        self.written += len(self.buffer)
        self.bar.update(len(self.buffer))
        self.buffer = []
        if time.time() - self.last_log > 30:
            self.log_metrics({"records_written": self.written, "response_tokens": self.response_tokens})
            self.last_log = time.time()
