"""Join the folders of a distillation split over jobs (`distill.shard_index` / `num_shards`).

`merge_shards(shard_dirs, out_dir)` checks that the folders are the shards 0..N-1 of one configuration
and that every record their plans expect exists exactly once, then writes one distill folder (records,
prompts, plan and mix) that the training stages read like any other. Nothing is written when a check
fails: the error lists what is wrong.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from polydraft.data.mix import MixWriter, mix_pairs, mix_path
from polydraft.distill.requests import Key, record_id, sample_slots
from polydraft.distill.store import StoreError, iter_records, record_files, record_key

EXAMPLES = 5
PLAN_KEYS = (
    "fingerprint",
    "num_shards",
    "shard_index",
    "temperatures",
    "samples_per_prompt",
    "prompts",
    "expected_records",
)


class MergeError(ValueError):
    """Shard folders that do not add up to one complete distillation; the message lists every problem."""


def _read_plan(directory: Path) -> dict[str, Any]:
    path = directory / "plan.json"
    if not path.is_file():
        raise MergeError(f"{directory}: no plan.json (not a distill stage folder)")
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
        if not all(k in plan for k in PLAN_KEYS):
            raise ValueError(f"lacks one of {', '.join(PLAN_KEYS)}")
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MergeError(f"{path}: corrupt plan ({err})") from err
    return plan


def _prompt_ids(directory: Path) -> list[str]:
    path = directory / "prompts.jsonl"
    ids = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            try:
                ids.append(json.loads(line.decode("utf-8"))["id"])
            except (ValueError, KeyError, TypeError) as err:
                raise MergeError(f"{path}:{number}: not a prompt line with an `id` ({err!r})") from err
    return ids


def _examples(keys: list[Key]) -> str:
    shown = ", ".join(record_id(k) for k in sorted(keys)[:EXAMPLES])
    return shown + (f" and {len(keys) - EXAMPLES} more" if len(keys) > EXAMPLES else "")


def check_shards(shard_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """The plans of the shards and the list of problems (empty when they merge cleanly)."""
    plans = [_read_plan(d) for d in shard_dirs]
    problems: list[str] = []
    fingerprints = {p["fingerprint"] for p in plans}
    if len(fingerprints) > 1:
        problems.append(
            f"the folders come from different configurations (fingerprints {sorted(fingerprints)})"
        )
    num_shards = {p["num_shards"] for p in plans}
    if len(num_shards) > 1:
        problems.append(f"the folders disagree on num_shards: {sorted(num_shards)}")
    indices = Counter(p["shard_index"] for p in plans)
    expected_indices = set(range(max(num_shards)))
    if twice := sorted(i for i, n in indices.items() if n > 1):
        problems.append(f"shard index given by more than one folder: {twice}")
    if absent := sorted(expected_indices - set(indices)):
        problems.append(f"shards missing: {absent} of 0..{max(num_shards) - 1}")

    owner: dict[str, Path] = {}
    for directory, plan in zip(shard_dirs, plans, strict=True):
        slots = sample_slots(plan["temperatures"], plan["samples_per_prompt"])
        expected: set[Key] = set()
        for prompt_id in _prompt_ids(directory):
            if prompt_id in owner:
                problems.append(f"{directory}: prompt {prompt_id!r} also belongs to {owner[prompt_id]}")
            owner[prompt_id] = directory
            expected.update((prompt_id, t, s) for t, s in slots)
        seen: set[Key] = set()
        duplicated, unexpected = [], []
        try:
            for record in iter_records(directory):
                key = record_key(record)
                if key in seen:
                    duplicated.append(key)
                elif key not in expected:
                    unexpected.append(key)
                seen.add(key)
        except StoreError as err:
            problems.append(f"{err}; rerun that shard with `--only distill` after deleting the file")
            continue
        missing = sorted(expected - seen)
        if missing:
            problems.append(
                f"{directory}: {len(missing)} records missing ({_examples(missing)}); rerun that shard "
                "with `--only distill` to generate them"
            )
        if duplicated:
            problems.append(f"{directory}: {len(duplicated)} records written twice ({_examples(duplicated)})")
        if unexpected:
            problems.append(
                f"{directory}: {len(unexpected)} records not in its plan ({_examples(unexpected)})"
            )
    return plans, problems


def merge_shards(shard_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """Check the shard folders and write their union to `out_dir` (which must not exist yet).

    Returns a summary: shards, prompts, records, and mix rows per `<pair>_<split>`. Raises MergeError
    listing every problem (missing, duplicated or foreign records, absent or repeated shards, mixed
    configurations) without writing anything.
    """
    shard_dirs = [Path(d) for d in shard_dirs]
    out_dir = Path(out_dir)
    if not shard_dirs:
        raise MergeError("no shard folders given")
    if out_dir.exists():
        raise MergeError(f"{out_dir} exists already; merge into a new folder")
    plans, problems = check_shards(shard_dirs)
    if problems:
        raise MergeError("the shards do not merge:\n  " + "\n  ".join(problems))

    partial = out_dir.with_name(out_dir.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    (partial / "records").mkdir(parents=True)
    for directory in shard_dirs:
        for path in record_files(directory):
            shutil.copyfile(path, partial / "records" / path.name)
    with open(partial / "prompts.jsonl", "w", encoding="utf-8") as out:
        for directory in shard_dirs:
            with open(directory / "prompts.jsonl", encoding="utf-8") as handle:
                shutil.copyfileobj(handle, out)
    writer = MixWriter(partial)
    for directory in shard_dirs:
        for pair in mix_pairs(directory):
            for split in ("train", "eval"):
                with open(mix_path(directory, pair, split), encoding="utf-8") as handle:
                    for line in handle:
                        writer.add(json.loads(line), split)
    counts = writer.close()
    records = sum(p["expected_records"] for p in plans)
    merged_plan = {
        **plans[0],
        "shard_index": 0,
        "num_shards": 1,
        "prompts": sum(p["prompts"] for p in plans),
        "expected_records": records,
        "merged_from": [str(d) for d in shard_dirs],
    }
    (partial / "plan.json").write_text(json.dumps(merged_plan, indent=2), encoding="utf-8")
    partial.rename(out_dir)
    summary: dict[str, Any] = {
        "shards": len(shard_dirs),
        "prompts": merged_plan["prompts"],
        "records": records,
    }
    summary.update({f"mix_{pair}_{split}": n for (pair, split), n in sorted(counts.items())})
    return summary
