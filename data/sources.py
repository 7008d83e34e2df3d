"""Reading the rows of a data source declared in a recipe: `datasets` hub names, local files, the offline corpus.

Rows come out normalised by format:
- translation: `{"id", "pair", "source", "target"}` (the target is the reference translation)
- chat: `{"id", "conversations": [{"role": "user"|"assistant"|"system", "content": str}, ...]}`
- text: `{"id", "text"}`
- prompts: `{"id", "prompt"}`
A row with a missing or empty field is an error naming the source, the row index and the field, unless
`skip_invalid` is set: then it is counted and reported, never silently dropped.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polydraft.data.offline import offline_pairs, offline_texts
from polydraft.models.folders import mirrored

log = logging.getLogger(__name__)

ROLES = {
    "translation": ("source", "target"),
    "chat": ("conversations",),
    "text": ("text",),
    "prompts": ("prompt",),
}
# ShareGPT spells roles `from: human|gpt`; OpenAI-style data spells them `role: user|assistant`.
CHAT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


class SourceError(ValueError):
    """A row of a data source that cannot be used; the message names source, row and field."""


@dataclass
class SourceRows:
    """The rows of one source plus what was skipped, so that nothing disappears silently."""

    description: str
    rows: list[dict[str, Any]]
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)


def describe(kind: str, format: str, path: str | None, name: str | None, split: str, pair: str | None) -> str:
    if kind == "offline":
        return f"offline[{format}{', ' + pair if pair else ''}, {split}]"
    return f"{kind}:{path}{'/' + name if name else ''}[{split}]"


def field_value(row: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted field path: names walk into mappings, integers into lists (`prompt.0` is the
    first turn of a `prompt` list, `turns.-1` the last); None where the path leads nowhere."""
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif (
            isinstance(value, (list, tuple))
            and part.lstrip("-").isdigit()
            and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return None
    return value


def _conversation(value: Any) -> list[dict[str, str]] | None:
    """ShareGPT `[{"from": "human", "value": ...}]` or `[{"role": "user", "content": ...}]` -> role/content turns."""
    if not isinstance(value, list) or not value:
        return None
    turns = []
    for turn in value:
        if not isinstance(turn, dict):
            return None
        role = CHAT_ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        turns.append({"role": role, "content": content})
    return turns


def normalise(
    raw: Iterable[tuple[int, dict[str, Any]]],
    format: str,
    fields: dict[str, str],
    pair: str | None,
    description: str,
    skip_invalid: bool,
    id_prefix: str,
) -> SourceRows:
    out = SourceRows(description=description, rows=[])
    for index, row in raw:
        record: dict[str, Any] = {"id": str(row.get("id", f"{id_prefix}/{index}"))}
        if pair is not None:
            record["pair"] = pair
        problem = None
        for role in ROLES[format]:
            path = fields.get(role, role)
            value = field_value(row, path)
            if role == "conversations":
                value = _conversation(value)
            if value is None or (isinstance(value, str) and not value.strip()):
                problem = f"row {index}: field {path!r} is missing or empty"
                break
            record[role] = value
        if problem is None:
            out.rows.append(record)
        elif skip_invalid:
            out.invalid += 1
            if len(out.invalid_examples) < 5:
                out.invalid_examples.append(problem)
        else:
            raise SourceError(
                f"{description}: {problem} (set skip_invalid: true to count and skip such rows)"
            )
    if out.invalid:
        log.warning(
            "%s: skipped %d invalid rows (e.g. %s)", description, out.invalid, out.invalid_examples[0]
        )
    return out


def load_hf(path: str, name: str | None, split: str, revision: str | None, streaming: bool) -> Any:
    """A `datasets` hub dataset (its copy in the $POLYDRAFT_HUB_MIRROR folder when there is one)."""
    import datasets

    local = mirrored(path, "datasets", revision)
    if local is not None:
        return datasets.load_dataset(local, name, split=split, streaming=streaming)
    return datasets.load_dataset(path, name, split=split, revision=revision, streaming=streaming)


def load_local(path: str, streaming: bool = False) -> Any:
    """A local JSON/JSONL/Parquet file, or every such file under a folder, as one split."""
    import datasets

    root = Path(path)
    files = (
        sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
        if root.is_dir()
        else [root]
    )
    if not files or not all(f.exists() for f in files):
        raise SourceError(f"local:{path}: no .jsonl/.json/.parquet file found")
    builder = "parquet" if files[0].suffix == ".parquet" else "json"
    if builder == "json" and not streaming:
        for file in files:
            _check_utf8(file)
    try:
        return datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", streaming=streaming
        )
    except Exception as err:  # datasets wraps the parser's error in its own types
        names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise SourceError(f"local:{path}: cannot be read as {builder} ({names}): {err}") from err


def _check_utf8(file: Path) -> None:
    """JSON text must be UTF-8: name the file, line and byte that is not (the JSON reader names neither)."""
    with open(file, "rb") as handle:
        for number, line in enumerate(handle, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise SourceError(
                    f"{file}:{number}: not UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}); "
                    "re-encode the file as UTF-8"
                ) from err


def read_source(
    *,
    kind: str,
    format: str,
    path: str | None = None,
    name: str | None = None,
    split: str = "train",
    revision: str | None = None,
    streaming: bool = False,
    fields: dict[str, str] | None = None,
    pair: str | None = None,
    limit: int | None = None,
    skip_invalid: bool = False,
    seed: int = 0,
    offline_entries_per_sample: tuple[int, int] = (2, 4),
    offline_test_fraction: float = 0.1,
    offline_samples: int = 4000,
    offline_kind_weights: dict[str, float] | None = None,
) -> SourceRows:
    """All (or `limit`, shuffled with `seed`) rows of one source, normalised for its format."""
    fields = fields or {}
    description = describe(kind, format, path, name, split, pair)
    if kind == "offline":
        if format == "translation":
            count = offline_samples if split == "train" else max(1, offline_samples // 10)
            count = count if limit is None else min(count, limit)  # a prefix: the same first rows
            raw: Any = offline_pairs(
                pair or "",
                split,
                count,
                offline_entries_per_sample,
                offline_test_fraction,
                seed,
                offline_kind_weights,
            )
        elif format == "text":
            count = offline_samples if limit is None else min(offline_samples, limit)
            raw = offline_texts(["de", "fr", "ru", "ja", "zh"], count, seed)
        else:
            raise SourceError(
                f"{description}: the offline corpus has `translation` and `text` rows, not {format!r}"
            )
        rows = list(enumerate(raw))[:limit]
        return normalise(
            rows, format, {}, pair, description, skip_invalid, f"offline/{pair or 'text'}/{split}"
        )
    dataset = (
        load_hf(path or "", name, split, revision, streaming) if kind == "hf" else load_local(path or "")
    )
    if streaming:
        # a stream has no random access: shuffle within a buffer; row indices count the shuffled stream
        stream = dataset.shuffle(seed=seed, buffer_size=10_000)
        indexed: Iterable[tuple[int, dict[str, Any]]] = enumerate(
            stream.take(limit) if limit is not None else stream
        )
    else:
        # shuffle indices, not the dataset, so that errors name a row by its index in the source
        order = list(range(len(dataset)))
        random.Random(seed).shuffle(order)
        indexed = ((i, dataset[i]) for i in order[:limit])
    return normalise(indexed, format, fields, pair, description, skip_invalid, f"{kind}:{path}/{split}")


@dataclass
class Peek:
    """The first rows of a source as `read_source` would see them, for `polydraft check`."""

    rows: SourceRows
    columns: list[str]
    """The columns of the source's rows (of the first raw row)."""


def peek_source(count: int = 3, **args: Any) -> Peek:
    """The first `count` rows of a source, opened with `read_source`'s arguments (`args`: kind, format,
    path, name, split, revision, fields, pair, skip_invalid, ...) through the same loaders, config, split,
    revision and field mapping, without reading the rest (a hub dataset is streamed). SourceError names
    a row that the stage would refuse (with `skip_invalid`: when none of them is usable), with the
    columns and the first row; the loaders' own errors (no such config, split or file) propagate."""
    kind, format, split = args["kind"], args["format"], args.get("split", "train")
    description = describe(kind, format, args.get("path"), args.get("name"), split, args.get("pair"))
    if kind == "offline":
        # the corpus's first samples do not depend on how many are drawn: draw only those
        rows = read_source(**{**args, "limit": count, "offline_samples": 10 * count})
        return Peek(rows, list(rows.rows[0]) if rows.rows else [])
    if kind == "hf":
        dataset = load_hf(args["path"], args.get("name"), split, args.get("revision"), streaming=True)
    else:
        dataset = load_local(args["path"], streaming=True)
    raw = list(itertools.islice(iter(dataset), count))
    if not raw:
        raise SourceError(f"{description}: no rows")
    first, columns = raw[0], list(raw[0])
    fields, skip_invalid = args.get("fields") or {}, bool(args.get("skip_invalid"))
    shown = f"its columns: {columns}; its first row: {abridged(first)}"
    try:
        rows = normalise(enumerate(raw), format, fields, args.get("pair"), description, skip_invalid, "peek")
    except SourceError as err:
        raise SourceError(f"{err}; {shown}") from err
    if not rows.rows:  # skip_invalid: a few invalid rows are expected, all of them are not
        raise SourceError(
            f"{description}: none of the first {len(raw)} rows is usable ({rows.invalid_examples[0]}); {shown}"
        )
    return Peek(rows, columns)


def abridged(value: Any, width: int = 60) -> str:
    """A row as one short line: strings cut to `width` characters, lists to their first 2 items."""

    def cut(item: Any) -> Any:
        if isinstance(item, str):
            return item if len(item) <= width else item[:width] + "..."
        if isinstance(item, dict):
            return {k: cut(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [cut(v) for v in item[:2]] + (["..."] if len(item) > 2 else [])
        return item

    return repr(cut(value))
