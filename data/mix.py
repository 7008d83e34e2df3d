"""The `mix`: what the training stages read from the distill stage.

`<distill_dir>/mix/<pair>/<split>.jsonl`, one JSON object per line:
- `id`: unique row id
- `pair`: language pair (`de-en`, ...) or `chat` for instruction data without a pair
- `origin`: `distill` (the target's own answer) or `open` (open-source data mixed in, seed 001 §3.2)
- `prompt`: the exact string the target was prompted with (chat format included)
- `response`: the text that follows the prompt (the target's answer, or the open-source reference)
- `temperature`: sampling temperature of a distilled answer (None for open rows)
- `sample_index`: index of the sample at that temperature (0 for greedy and open rows)
Trainers tokenize `prompt` then `response` + EOS and put the loss on the response tokens only.
`split` is `train` or `eval` (held out for eval loss and top-1 agreement).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MIX_KEYS = ("id", "pair", "origin", "prompt", "response", "temperature", "sample_index")


def mix_path(distill_dir: Path, pair: str, split: str) -> Path:
    return Path(distill_dir) / "mix" / pair / f"{split}.jsonl"


def mix_pairs(distill_dir: Path) -> list[str]:
    """Pairs that have a mix, sorted."""
    root = Path(distill_dir) / "mix"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def mix_file(distill_dir: Path, pair: str, split: str) -> Path:
    """The path of one pair's `split` mix; FileNotFoundError naming the pairs that have one if it is missing."""
    path = mix_path(distill_dir, pair, split)
    if not path.is_file():
        available = ", ".join(mix_pairs(distill_dir)) or "none"
        raise FileNotFoundError(f"{path}: no `{split}` mix for pair {pair!r} (pairs with a mix: {available})")
    return path


def keeps_row(
    origin: str, temperature: float | None, temperatures: list[float] | None, open_rows: bool = True
) -> bool:
    """Whether a trainer keeps a mix row: a distilled answer when `temperatures` is None or holds its
    temperature, an open row when `open_rows`. Every reader of the mix filters with this."""
    if origin != "distill":
        return open_rows
    return temperatures is None or temperature in temperatures


def read_mix(
    distill_dir: Path,
    pair: str,
    split: str,
    temperatures: list[float] | None = None,
) -> list[dict[str, Any]]:
    """Rows of one pair's mix; `temperatures` keeps distilled rows of those temperatures (open rows stay)."""
    path = mix_file(distill_dir, pair, split)
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if keeps_row(row["origin"], row["temperature"], temperatures):
                rows.append(row)
    return rows


class MixWriter:
    """Writes the `train` and `eval` mix of every pair in one pass over the rows.

    Rows go to temporary files; `close()` fsyncs them and renames them into place (so a kill never
    leaves a half-written mix that looks complete), with an empty `eval` (or `train`) file for a pair
    whose rows all fell on one side. Returns the row count per (pair, split).
    """

    def __init__(self, distill_dir: Path):
        self.distill_dir = Path(distill_dir)
        self._handles: dict[tuple[str, str], Any] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def _handle(self, pair: str, split: str) -> Any:
        if (pair, split) not in self._handles:
            path = mix_path(self.distill_dir, pair, split)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._handles[(pair, split)] = open(path.with_suffix(".jsonl.tmp"), "w", encoding="utf-8")  # noqa: SIM115
            self.counts[(pair, split)] = 0
        return self._handles[(pair, split)]

    def add(self, row: dict[str, Any], split: str) -> None:
        missing = [k for k in MIX_KEYS if k not in row]
        if missing:
            raise ValueError(f"mix row {row.get('id')!r} lacks {missing}")
        self._handle(row["pair"], split).write(
            json.dumps({k: row[k] for k in MIX_KEYS}, ensure_ascii=False) + "\n"
        )
        self.counts[(row["pair"], split)] += 1

    def close(self) -> dict[tuple[str, str], int]:
        for pair in {p for p, _ in list(self._handles)}:
            for split in ("train", "eval"):
                self._handle(pair, split)
        for (pair, split), handle in self._handles.items():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            path = mix_path(self.distill_dir, pair, split)
            path.with_suffix(".jsonl.tmp").replace(path)
        self._handles = {}
        return dict(self.counts)

    def abort(self) -> None:
        """Drop the temporary files (after an error)."""
        for (pair, split), handle in self._handles.items():
            handle.close()
            mix_path(self.distill_dir, pair, split).with_suffix(".jsonl.tmp").unlink(missing_ok=True)
        self._handles = {}
