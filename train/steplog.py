"""The per-step training log, `<job>/train_log.jsonl`: one JSON object per optimizer step.

Entries carry at least `step` and `loss`. A resumed run first truncates the log to its checkpoint's step
(the steps a killed run logged after its last checkpoint are redone and logged again), so the log of a
resumed run reads like that of a run that was never interrupted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def append_log(path: Path, entry: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop entries past `step`."""
    entries = [e for e in read_log(path) if e["step"] <= step]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")


def mean_loss(path: Path, window: int) -> float | None:
    """Mean loss of the last `window` steps (None before any step)."""
    entries = read_log(path)[-window:]
    return sum(e["loss"] for e in entries) / len(entries) if entries else None
