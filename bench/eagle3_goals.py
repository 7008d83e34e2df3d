"""The EAGLE-3 heads' goals, from demo runs' measure outputs (`bench/results/demo_runs/run-<i>/`, or any
run's `measure/` folder): at T=0, per repetition (measure seed: its own held-out prompts),

1. in domain, each pair's head against that pair's standalone drafter at the same K (block efficiency,
   by the study's noise rule, `decoding/measurement/claims.py`), and the head's speedup over `ar`;
2. on each pair whose answers are not English (en-de), its own head against the head of the
   English-answer pair with the same languages (de-en) on the same prompts: the gain, with the noise;
3. its own head's block efficiency there against the English-answer head's on its own pair (goal: within
   15%).

    python -m bench.eagle3_goals bench/results/demo_runs/run-1 ... [--record bench/results/eagle3_goals.md]

Each repetition's value is one measure group (its prompts' tokens over its target calls); the runs'
repetitions are pooled (training is deterministic: the runs differ in wall-clock time only, so speedups
vary between runs and block efficiencies do not).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench.held_out import mean_std, record
from polydraft.decoding.measurement.claims import noise_of, outcome_of


def rows_of(folders: list[Path]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(method, dataset) -> block efficiencies and speedups of every T=0 repetition of every run."""
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for folder in folders:
        for line in (folder / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["temperature"] != 0.0 or row.get("engine", "polydraft") != "polydraft":
                continue
            for metric in ("block_efficiency", "speedup"):
                if row.get(metric) is not None:
                    values[(row["method"], row["dataset"])][metric].append(row[metric])
    return values


def _method(values: dict, prefix: str, dataset: str) -> str | None:
    """The one method named `prefix[...] K=k` measured on `dataset` (None when absent)."""
    found = [m for m, d in values if d == dataset and m.startswith(prefix)]
    return found[0] if len(found) == 1 else None


def _compare(values, first: tuple[str, str], second: tuple[str, str], metric: str) -> list[str]:
    a, b = values[first][metric], values[second][metric]
    difference = statistics.fmean(a) - statistics.fmean(b)
    noise = noise_of(a, b)
    outcome = outcome_of(">", difference, noise) if noise is not None else "too few repetitions"
    return [mean_std(a), mean_std(b), f"{difference:+.2f}", f"{noise:.2f}" if noise else "-", outcome]


def goals(values: dict) -> list[str]:
    pairs = sorted({d for _, d in values})
    lines = [
        "### 1. In domain: each pair's head against its standalone drafter at the same K",
        "",
        "| pair | head | drafter | head BE | drafter BE | difference | noise | head > drafter | head speedup |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for pair in pairs:
        head, drafter = _method(values, f"eagle3[{pair}]", pair), _method(values, f"sd[{pair}]", pair)
        if head is None or drafter is None:
            continue
        cells = _compare(values, (head, pair), (drafter, pair), "block_efficiency")
        speedup = values[(head, pair)]["speedup"]
        lines.append(
            f"| {pair} | `{head}` | `{drafter}` | " + " | ".join(cells) + f" | {mean_std(speedup)} |"
        )
    lines += [
        "",
        "### 2-3. Pairs whose answers are not English: own head against the English-answer head",
        "",
        "| pair | own head BE | English-answer head BE (same prompts) | gain | noise | own > English-answer "
        "| English-answer head on its own pair | own / that |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    table = len(lines)
    for pair in pairs:
        source, answer = pair.split("-")
        if answer == "en" or source != "en":
            continue
        english = f"{answer}-en"
        own, other = _method(values, f"eagle3[{pair}]", pair), _method(values, f"eagle3[{english}]", pair)
        home = _method(values, f"eagle3[{english}]", english)
        if own is None or other is None or home is None:
            continue
        cells = _compare(values, (own, pair), (other, pair), "block_efficiency")
        own_be = statistics.fmean(values[(own, pair)]["block_efficiency"])
        home_be = values[(home, english)]["block_efficiency"]
        ratio = own_be / statistics.fmean(home_be)
        lines.append(
            f"| {pair} | {cells[0]} | {cells[1]} (`{other}`) | {cells[2]} | {cells[3]} | {cells[4]} | "
            f"{mean_std(home_be)} (`{home}` on {english}) | {ratio:.2f} ({ratio - 1:+.0%}) |"
        )
    if len(lines) == table:  # say so rather than leave an empty table
        lines[table - 2 :] = ["No pair en-X with its own head and X-en's head was measured in these runs."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="folders holding a measure results.jsonl")
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    values = rows_of(args.folders)
    repetitions = max(len(v["block_efficiency"]) for v in values.values())
    setting = (
        f"{len(args.folders)} run(s) ({', '.join(str(f) for f in args.folders)}), up to {repetitions} "
        "repetitions in all per row, T=0; mean ± std over the repetitions; noise: twice the pooled std "
        "(`decoding/measurement/claims.py`)."
    )
    record("eagle3_goals", setting, goals(values), args.record)


if __name__ == "__main__":
    main()
