"""The EAGLE-3 heads' goals, from demo runs' measure outputs (`bench/results/demo_runs/run-<i>/`, or any
run's `measure/` folder): at T=0, per repetition (measure seed: its own held-out prompts),

1. in domain, each pair's head against that pair's standalone drafter at the same K (block efficiency,
   paired by prompt, `decoding/measurement/claims.py`), and the head's speedup over `ar`;
2. on each pair whose answers are not English (en-de), its own head against the head of the
   English-answer pair with the same languages (de-en) on the same prompts: the gain, with its interval;
3. its own head's block efficiency there against the English-answer head's on its own pair (goal: within
   15%).

    python -m bench.eagle3_goals bench/results/demo_runs/run-1 ... [--record bench/results/eagle3_goals.md]

The columns BE and speedup: mean ± std over the repetitions (each one measure group, its prompts' tokens
over its target calls) of every run. A comparison pairs the two methods prompt by prompt (both decoded the
same prompts in each repetition) and judges the mean per-prompt difference of block efficiency by its
interval (`decoding.measurement.claims.paired_interval`); a prompt measured in several runs counts once,
its runs' values averaged (training is deterministic: runs differ in wall-clock time, not in tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench.held_out import mean_std, record
from polydraft.decoding.measurement.claims import PairedInterval, paired_interval

Prompts = dict[tuple[str, str], dict[tuple[int, int], list[float]]]
"""(method, dataset) -> (repetition seed, prompt position) -> that prompt's block efficiency in each run."""


def rows_of(folders: list[Path]) -> tuple[dict[tuple[str, str], dict[str, list[float]]], Prompts]:
    """(method, dataset) -> block efficiencies and speedups of every T=0 repetition of every run; and each
    prompt's block efficiency (rows written before `per_prompt` existed give none)."""
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    prompts: Prompts = defaultdict(lambda: defaultdict(list))
    for folder in folders:
        for line in (folder / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["temperature"] != 0.0 or row.get("engine", "polydraft") != "polydraft":
                continue
            for metric in ("block_efficiency", "speedup"):
                if row.get(metric) is not None:
                    values[(row["method"], row["dataset"])][metric].append(row[metric])
            for i, prompt in enumerate(row.get("per_prompt") or []):
                calls = max(prompt["target_calls"], 1)
                prompts[(row["method"], row["dataset"])][row["seed"], i].append(prompt["new_tokens"] / calls)
    return values, prompts


def _method(values: dict, prefix: str, dataset: str) -> str | None:
    """The one method named `prefix[...] K=k` measured on `dataset` (None when absent)."""
    found = [m for m, d in values if d == dataset and m.startswith(prefix)]
    return found[0] if len(found) == 1 else None


def _compare(values, prompts: Prompts, first: tuple[str, str], second: tuple[str, str]) -> list[str]:
    """BE of each, the paired difference with its interval, the outcome of `first > second`, and the
    smallest difference the prompts could show."""
    a, b = values[first]["block_efficiency"], values[second]["block_efficiency"]
    pa, pb = prompts[first], prompts[second]
    differences = {k: [statistics.fmean(pa[k]) - statistics.fmean(pb[k])] for k in pa if k in pb}
    interval: PairedInterval | None = paired_interval({0: differences})
    if interval is None:
        return [mean_std(a), mean_std(b), f"{statistics.fmean(a) - statistics.fmean(b):+.2f}", "-", "no per-prompt values", "-"]  # fmt: skip
    return [
        mean_std(a),
        mean_std(b),
        f"{interval.mean:+.2f}",
        f"[{interval.low:+.2f}, {interval.high:+.2f}] ({interval.prompts} prompts)",
        interval.outcome(">"),
        f"{interval.detectable:.2f}",
    ]


def goals(values: dict, prompts: Prompts) -> list[str]:
    pairs = sorted({d for _, d in values})
    lines = [
        "### 1. In domain: each pair's head against its standalone drafter at the same K",
        "",
        "| pair | head | drafter | head BE | drafter BE | paired difference | 95% interval | head > drafter "
        "| detectable | head speedup |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for pair in pairs:
        head, drafter = _method(values, f"eagle3[{pair}]", pair), _method(values, f"sd[{pair}]", pair)
        if head is None or drafter is None:
            continue
        cells = _compare(values, prompts, (head, pair), (drafter, pair))
        speedup = values[(head, pair)]["speedup"]
        lines.append(
            f"| {pair} | `{head}` | `{drafter}` | " + " | ".join(cells) + f" | {mean_std(speedup)} |"
        )
    lines += [
        "",
        "### 2-3. Pairs whose answers are not English: own head against the English-answer head",
        "",
        "| pair | own head BE | English-answer head BE (same prompts) | paired gain | 95% interval "
        "| own > English-answer | detectable | English-answer head on its own pair | own / that |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
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
        cells = _compare(values, prompts, (own, pair), (other, pair))
        own_be = statistics.fmean(values[(own, pair)]["block_efficiency"])
        home_be = values[(home, english)]["block_efficiency"]
        ratio = own_be / statistics.fmean(home_be)
        lines.append(
            f"| {pair} | {cells[0]} | {cells[1]} (`{other}`) | {cells[2]} | {cells[3]} | {cells[4]} | {cells[5]} "
            f"| {mean_std(home_be)} (`{home}` on {english}) | {ratio:.2f} ({ratio - 1:+.0%}) |"
        )
    if len(lines) == table:  # say so rather than leave an empty table
        lines[table - 2 :] = ["No pair en-X with its own head and X-en's head was measured in these runs."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="folders holding a measure results.jsonl")
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    values, prompts = rows_of(args.folders)
    repetitions = max(len(v["block_efficiency"]) for v in values.values())
    setting = (
        f"{len(args.folders)} run(s) ({', '.join(str(f) for f in args.folders)}), up to {repetitions} "
        "repetitions in all per row, T=0; BE and speedup: mean ± std over the repetitions; comparisons "
        "paired by prompt, their interval and detectable difference (at 80% power) from "
        "`decoding/measurement/claims.py`."
    )
    record("eagle3_goals", setting, goals(values, prompts), args.record)


if __name__ == "__main__":
    main()
