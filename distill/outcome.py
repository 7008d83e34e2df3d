"""After generation: the failures file, the record statistics and the mix the trainers read."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from polydraft.data.mix import MixWriter
from polydraft.distill.requests import Key, in_eval_split, record_id, shard_of
from polydraft.distill.store import iter_records

log = logging.getLogger(__name__)

NOT_REACHED = "not generated: the backend stopped before reaching it"


def write_failures(directory: Path, missing: list[Key], reasons: dict[Key, str]) -> Path:
    """`failures.jsonl`: every expected record that is missing, with the reason it is missing."""
    path = Path(directory) / "failures.jsonl"
    with open(path.with_suffix(".tmp"), "w", encoding="utf-8") as handle:
        for key in missing:
            prompt_id, temperature, sample_index = key
            entry = {
                "id": record_id(key),
                "prompt_id": prompt_id,
                "temperature": temperature,
                "sample_index": sample_index,
                "reason": reasons.get(key, NOT_REACHED),
            }
            handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
    path.with_suffix(".tmp").replace(path)
    return path


def record_stats(directory: Path, temperatures: list[float]) -> dict[str, Any]:
    """Counts over every record of the folder (this run's and earlier runs')."""
    per_temperature = Counter({float(t): 0 for t in temperatures})
    per_pair: Counter = Counter()
    stats = {"empty": 0, "truncated": 0, "prompt_tokens": 0, "response_tokens": 0}
    for record in iter_records(directory):
        per_temperature[float(record["temperature"])] += 1
        per_pair[record["pair"]] += 1
        stats["empty"] += not record["response"].strip()
        stats["truncated"] += record["finish_reason"] == "length"
        stats["prompt_tokens"] += max(0, record["prompt_tokens"])
        stats["response_tokens"] += max(0, record["response_tokens"])
    return {
        **stats,
        "per_temperature": {f"{t:g}": n for t, n in sorted(per_temperature.items())},
        "records_per_pair": dict(per_pair),
    }


def choose_open_rows(
    rows: list[dict[str, Any]],
    records_per_pair: dict[str, int],
    open_fraction: float,
    seed: int,
    shard_index: int,
    num_shards: int,
) -> list[dict[str, Any]]:
    """Open rows of this shard, `open_fraction` x the distilled records of each pair, chosen with `seed`.

    Open rows are split over shards by a hash of their id, like prompts, so merged shards never hold
    the same open row twice.
    """
    by_pair: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if shard_of(row["id"], num_shards) == shard_index:
            by_pair[row["pair"]].append(row)
    chosen = []
    for pair, distilled in sorted(records_per_pair.items()):
        wanted = round(open_fraction * distilled)
        available = sorted(by_pair.get(pair, []), key=lambda r: r["id"])
        random.Random(f"{seed}|open|{pair}").shuffle(available)
        if wanted > len(available):
            log.warning(
                "distill: pair %s wants %d open rows, the open sources have %d", pair, wanted, len(available)
            )
        chosen += available[:wanted]
    return chosen


def build_mix(
    directory: Path, open_rows: list[dict[str, Any]], eval_fraction: float, seed: int
) -> dict[str, dict[str, int]]:
    """Write `mix/<pair>/{train,eval}.jsonl` from every record plus the chosen open rows; returns the
    rows per pair and split.

    The eval side is chosen per prompt id (all samples of a prompt on one side). Rows keep the order
    the records were written in, open rows after them; trainers shuffle.
    """
    writer = MixWriter(directory)
    try:
        for record in iter_records(directory):
            row = {
                "id": record["id"],
                "pair": record["pair"],
                "origin": "distill",
                "prompt": record["prompt"],
                "response": record["response"],
                "temperature": record["temperature"],
                "sample_index": record["sample_index"],
            }
            writer.add(row, "eval" if in_eval_split(record["prompt_id"], seed, eval_fraction) else "train")
        for row in open_rows:
            writer.add(row, "eval" if in_eval_split(row["id"], seed, eval_fraction) else "train")
        counts = writer.close()
    except BaseException:
        writer.abort()
        raise
    mix: dict[str, dict[str, int]] = {}
    for (pair, split), n in sorted(counts.items()):
        mix.setdefault(pair, {})[split] = n
    return mix


class DistillMetrics(BaseModel):
    """What the distill stage reports (its manifest's `metrics`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: int
    records: int
    records_per_temperature: dict[str, int]
    """By temperature, written `0`, `0.3`, ..."""
    records_per_pair: dict[str, int]
    failures: int
    empty_responses: int
    truncated_responses: int
    prompt_tokens: int
    response_tokens: int
    generated_this_run: int
    wall_time_s: float
    tokens_per_s: float
    invalid_rows: int
    """Source rows with a missing or empty field, counted and skipped (`skip_invalid`)."""
    long_prompts: int
    """Prompts over the length limit, counted and skipped."""
    mix: dict[str, dict[str, int]]
    """Rows of the trainers' mix, by pair and split (`train`, `eval`)."""
    mix_open_rows: int
    server: dict[str, int] = {}
    """Counters of the `openai` backend (retries, fallbacks, ...)."""
