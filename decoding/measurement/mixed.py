"""Mixed-language traffic: should a server hold one multilingual drafter, or one drafter per language
behind a router?

The mixed traffic of one repetition is every pair's held-out prompts of that repetition, interleaved
(de, fr, de, fr, ...). The measure stage's per-pair groups have already decoded each of those prompts
with every drafter, `ar` beside them (the order rotating per prompt), so the mixed traffic is composed from
their per-prompt results instead of decoded again (`pipelines.stages.measure_mixed`): `ar`; `sd` with each
drafter alone (each pair's drafter, and the multilingual one when the run trained it); `routed`, where the
language router (`pipelines.export.routing`) picks the drafter of each request from its text (the router runs on
every request, and its time is added to the request's wall time); and `oracle`, each prompt with its own
pair's drafter (what a perfect, free router would give). All at the recipe's fixed draft length. When the
run trained EAGLE-3 heads the same again with `eagle3` and the heads (`eagle3-de-en`, ...,
`eagle3-routed`, `eagle3-oracle`), the router's choice of pair taken for both.

Each group is one file, `mixed/T<temperature>-seed<seed>.json`: the requests in their order (pair,
prompt index, the router's language, confidence, choice and time) and a row per method and traffic
(`all`, then each pair's share of the same generations), with block efficiency and the speedup over
`ar` on the same prompts.

Which choice won is decided per prompt (`decoding.measurement.claims.paired_interval`): both choices decoded
the same requests, so each request's speedup over `ar` under one choice is paired with its speedup under
the other, and one choice won when the interval of the mean difference excludes zero; otherwise neither
won on this traffic, and the decision says the smallest difference those requests could have shown.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.claims import LEVEL, POWER, PairedInterval, paired_interval
from polydraft.decoding.measurement.eval_inputs import EvalSet, repetition_prompts
from polydraft.decoding.measurement.metrics import format_cell, mean_std
from polydraft.decoding.measurement.results import PromptResult, prompt_speedup

MIXED_DIR = "mixed"
ROUTED = "routed"
ORACLE = "oracle"
ALL = "all"


@dataclass(frozen=True)
class MixedPrompt:
    """One request of the mixed traffic: the user's text and where it came from."""

    text: str
    pair: str
    dataset: str
    """The name of its pair's eval set."""
    index: int
    """Its index in its pair's eval set."""
    position: int
    """Its place among the prompts its pair's group decoded in this repetition."""


def mixed_traffic(
    eval_sets: list[EvalSet], seeds: list[int], seed: int, num_prompts: int, disjoint: bool
) -> list[MixedPrompt]:
    """The repetition `seed`'s prompts of every pair's eval set, interleaved round-robin (the first pair's
    first prompt, the second pair's first, ...). ValueError with fewer than two pairs."""
    pairs = [s for s in eval_sets if s.pair is not None]
    if len({s.pair for s in pairs}) < 2:
        raise ValueError(
            "measure.mixed needs the eval sets of at least two language pairs in data.eval, "
            f"found {sorted({s.pair for s in pairs if s.pair})}"
        )
    shares = []
    for eval_set in pairs:
        indices = repetition_prompts(list(range(len(eval_set.prompts))), seeds, seed, num_prompts, disjoint)
        shares.append(
            [
                MixedPrompt(eval_set.texts[i], str(eval_set.pair), eval_set.name, i, position)
                for position, i in enumerate(indices)
            ]
        )
    return [share[i] for i in range(max(map(len, shares))) for share in shares if i < len(share)]


class MixedRequest(BaseModel):
    """One request of a group, in decoding order, and what the router did with it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pair: str
    index: int
    language: str
    """The language the router identified."""
    confidence: float
    drafter: str | None
    """The drafter the router chose (None: decoded without a drafter)."""
    fallback: bool
    router_ms: float
    """The router's time for this request, added to its `routed` decoding time."""


class MixedRow(BaseModel):
    """One method on one traffic of a group: every request (`all`) or one pair's requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    """`ar`, a drafter's name (`de-en`, `multilingual`), `routed` or `oracle`."""
    traffic: str
    """`all` or a pair."""
    temperature: float
    seed: int
    draft_length: int | None
    prompts: int
    new_tokens: int
    block_efficiency: float | None
    token_rate: float | None
    speedup: float | None
    """Token rate over `ar`'s on the same requests of the same group."""
    matches_ar: bool | None
    """At temperature 0: every output equals `ar`'s (None at T > 0)."""
    per_prompt: list[PromptResult] | None = None
    """Each request of the traffic in order (None in groups written before this field)."""


class MixedGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float
    seed: int
    requests: list[MixedRequest]
    router_accuracy: float
    """Share of the requests the router sent to their own pair's drafter."""
    rows: list[MixedRow]


@dataclass(frozen=True)
class Composed:
    """One method on the mixed traffic: each request's result, in the traffic's order, and whether the
    per-pair row it came from matched `ar`'s output (None at T > 0)."""

    name: str
    draft_length: int | None
    results: list[PromptResult]
    matches_ar: list[bool | None]


def group_of(
    methods: list[Composed],
    traffic: list[MixedPrompt],
    requests: list[MixedRequest],
    temperature: float,
    seed: int,
) -> MixedGroup:
    """The rows of a group (`methods[0]` is `ar`), for all requests and for each pair's."""
    ar = methods[0]
    rows = []
    for share in [ALL, *dict.fromkeys(p.pair for p in traffic)]:
        keep = [i for i, p in enumerate(traffic) if share in (ALL, p.pair)]
        ar_rate = _rate([ar.results[i] for i in keep])
        for method in methods:
            chosen = [method.results[i] for i in keep]
            tokens = sum(r.new_tokens for r in chosen)
            rate = _rate(chosen)
            rows.append(
                MixedRow(
                    method=method.name,
                    traffic=share,
                    temperature=temperature,
                    seed=seed,
                    draft_length=method.draft_length,
                    prompts=len(chosen),
                    new_tokens=tokens,
                    block_efficiency=tokens / max(sum(r.target_calls for r in chosen), 1),
                    token_rate=rate,
                    speedup=rate / ar_rate if rate and ar_rate else None,
                    matches_ar=all(method.matches_ar[i] for i in keep) if temperature == 0 else None,
                    per_prompt=chosen,
                )
            )
    correct = sum(r.drafter == r.pair for r in requests)
    return MixedGroup(
        temperature=temperature,
        seed=seed,
        requests=requests,
        router_accuracy=correct / len(requests) if requests else 0.0,
        rows=rows,
    )


def _rate(results: list[PromptResult]) -> float | None:
    wall = sum(r.wall_seconds for r in results)
    return sum(r.new_tokens for r in results) / wall if wall else None


def group_path(folder: Path, temperature: float, seed: int) -> Path:
    return folder / MIXED_DIR / f"T{temperature:g}-seed{seed}.json"


def write_group(folder: Path, group: MixedGroup) -> None:
    """The group's file, written atomically (a kill leaves the group to measure again)."""
    path = group_path(folder, group.temperature, group.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(group.model_dump_json(indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_groups(folder: Path) -> list[MixedGroup]:
    """The finished groups in `folder/mixed/`; ValueError naming a file that is not a group."""
    groups = []
    for path in sorted((folder / MIXED_DIR).glob("*.json")):
        try:
            groups.append(MixedGroup.model_validate_json(path.read_text(encoding="utf-8")))
        except ValueError as err:
            raise ValueError(
                f"{path}: not a mixed-traffic group ({err}); delete it to measure again"
            ) from err
    return groups


CHOICES = [(ROUTED, "multilingual"), (f"eagle3-{ROUTED}", "eagle3-multilingual")]
"""(routed, single) method names compared: the per-language drafters behind the router against the
multilingual drafter, and the same for EAGLE-3 heads."""


@dataclass(frozen=True)
class Decision:
    """Routed per-language drafters (or heads) against the multilingual one on all the mixed traffic."""

    temperature: float
    routed: tuple[float, float, int]
    """Mean, sample std and repetitions of the routed overall speedup."""
    multilingual: tuple[float, float, int]
    interval: PairedInterval | None
    """Of the per-request difference of speedups, routed - multilingual (None without per-request values
    in every group, or with fewer than 2 requests)."""
    winner: str | None
    """The routed or the multilingual method's name, or None (the interval holds zero, or no interval)."""
    names: tuple[str, str] = CHOICES[0]
    """(routed, multilingual) method names."""

    def text(self) -> str:
        def cell(value: tuple[float, float, int]) -> str:
            return f"{value[0]:.2f} ± {value[1]:.2f}"

        routed, single = self.names
        numbers = (
            f"{routed} {cell(self.routed)}x vs {single} {cell(self.multilingual)}x over "
            f"{self.routed[2]} repetitions at T={self.temperature:g}"
        )
        if self.interval is None:
            return f"no winner ({numbers}; no per-request speedups to pair)"
        i = self.interval
        paired = f"per request {i.mean:+.3f} [{i.low:+.3f}, {i.high:+.3f}] at {i.level:.0%} over {i.prompts} requests"
        if self.winner is None:
            return (
                f"no winner ({numbers}; {paired}, which holds 0: the smallest difference these requests "
                f"would show at {POWER:.0%} power is {i.detectable:.3f})"
            )
        heads = routed.startswith("eagle3")
        what = ("per-language EAGLE-3 heads", "multilingual EAGLE-3 head") if heads else (
            "per-language drafters", "multilingual drafter"
        )  # fmt: skip
        name = f"the routed {what[0]}" if self.winner == routed else f"the {what[1]}"
        return f"{name} won ({numbers}; {paired}, which excludes 0)"


RULE = (
    "each request's speedup over `ar` with the routed choice minus its speedup with the multilingual one "
    f"(both decoded the same requests); a choice won when the {LEVEL:.0%} interval of the mean difference "
    "(a bootstrap over the requests, `decoding.measurement.claims.paired_interval`) excludes zero; otherwise "
    "neither won"
)


def decisions(groups: list[MixedGroup]) -> list[Decision]:
    """Per temperature and choice of `CHOICES` measured: routed vs multilingual on all requests, by `RULE`."""
    speedups: dict[float, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for group in groups:
        for row in group.rows:
            if row.traffic == ALL and row.speedup is not None:
                speedups[group.temperature][row.method].append(row.speedup)
    out = []
    for temperature, by_method in sorted(speedups.items()):
        for names in CHOICES:
            routed, single = by_method.get(names[0], []), by_method.get(names[1], [])
            if not routed or not single:
                continue
            (rm, rs), (mm, ms) = mean_std(routed), mean_std(single)
            assert rm is not None and rs is not None and mm is not None and ms is not None
            members = [g for g in groups if g.temperature == temperature]
            interval = _paired(members, names)
            winner = None
            if interval is not None and interval.outcome(">") == "holds":
                winner = names[0]
            elif interval is not None and interval.outcome(">") == "contradicted":
                winner = names[1]
            out.append(
                Decision(temperature, (rm, rs, len(routed)), (mm, ms, len(single)), interval, winner, names)
            )
    return out


def _paired(groups: list[MixedGroup], names: tuple[str, str]) -> PairedInterval | None:
    """The interval of routed - multilingual per request, a request's speedup being its token rate over
    `ar`'s on the same request; None when a group lacks per-request values."""
    differences: dict[tuple[int, int], list[float]] = {}
    for group in groups:
        rows = {r.method: r.per_prompt for r in group.rows if r.traffic == ALL}
        ar, routed, single = rows.get("ar"), rows.get(names[0]), rows.get(names[1])
        if ar is None or routed is None or single is None:
            return None
        for i, (a, r, m) in enumerate(zip(ar, routed, single, strict=True)):
            differences[group.seed, i] = [prompt_speedup(r, a) - prompt_speedup(m, a)]
    return paired_interval({0: differences})


def markdown(groups: list[MixedGroup]) -> str:
    """The mixed-traffic section of the measure summary: block efficiency and speedup per method and
    traffic, mean ± std over the repetitions, the router's accuracy and cost, and the decision."""
    if not groups:
        return ""
    lines = [
        "## Mixed-language traffic",
        "",
        "Every pair's held-out prompts of a repetition, interleaved: `sd` with each drafter alone, with the "
        "drafter the language router picks per request (`routed`, the router's time included) and with each "
        "prompt's own pair drafter (`oracle`); likewise `eagle3` with the EAGLE-3 heads (`eagle3-...`) when the "
        "run trained them. Each request's result is its decoding in the per-pair group of its pair and "
        "repetition (the same drafter on the same prompt, timed beside `ar`), not a second decoding. Each "
        "cell: mean ± std over the repetitions.",
        "",
    ]
    by_temperature: dict[float, list[MixedGroup]] = defaultdict(list)
    for group in groups:
        by_temperature[group.temperature].append(group)
    for temperature, members in sorted(by_temperature.items()):
        traffics = list(dict.fromkeys(r.traffic for r in members[0].rows))
        methods = list(dict.fromkeys(r.method for r in members[0].rows))
        cells: dict[tuple[str, str], dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
        for group in members:
            for row in group.rows:
                cells[row.method, row.traffic]["be"].append(row.block_efficiency)
                cells[row.method, row.traffic]["speedup"].append(row.speedup)
        header = ["method"] + [f"{t} {m}" for t in traffics for m in ("BE", "speedup")]
        lines += [
            f"### T={temperature:g}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + " --- |" * len(header),
        ]
        for method in methods:
            row_cells = [method]
            for traffic in traffics:
                for metric in ("be", "speedup"):
                    values = cells[method, traffic][metric]
                    mean, std = mean_std(values)
                    row_cells.append(format_cell((mean, std, sum(v is not None for v in values)), False))
            lines.append("| " + " | ".join(row_cells) + " |")
        accuracy = mean_std([g.router_accuracy for g in members])
        router_ms = mean_std([r.router_ms for g in members for r in g.requests])
        fallbacks = sum(r.fallback for g in members for r in g.requests)
        requests = sum(len(g.requests) for g in members)
        lines += [
            "",
            f"Router: {format_cell((*accuracy, len(members)), True)} of the requests to their own pair's drafter, "
            f"{fallbacks} of {requests} to the fallback, {router_ms[0] or 0:.3f} ± {router_ms[1] or 0:.3f} ms "
            "per request.",
            "",
        ]
    lines += [f"Decision rule: {RULE}.", ""]
    lines += [f"- {d.text()}" for d in decisions(groups)] or ["- no multilingual drafter was measured"]
    return "\n".join(lines) + "\n"
