"""Mixed-language traffic: should a server hold one multilingual drafter, or one drafter per language
behind a router?

The mixed eval set of one repetition is every pair's held-out prompts of that repetition, interleaved
(de, fr, de, fr, ...), so each decoding method meets the languages in the same order. Every method
decodes it in one `measure_group` (the order rotating per prompt, as everywhere): `ar`; `sd` with each
drafter alone (each pair's drafter, and the multilingual one when the run trained it); `routed`, where
the language router (`decoding.measurement.routing`) picks the drafter of each request from its text
before decoding starts (its time is added to the request's wall time); and `oracle`, each prompt with
its own pair's drafter (what a perfect, free router would give). All at the recipe's fixed draft length.
When the run trained EAGLE-3 heads the same again with `eagle3` and the heads (`eagle3-de-en`, ...,
`eagle3-routed`, `eagle3-oracle`), the router's choice of pair taken for both.

Each group is one file, `mixed/T<temperature>-seed<seed>.json`: the requests in their order (pair,
prompt index, the router's language, confidence, choice and time) and a row per method and traffic
(`all`, then each pair's share of the same generations), with block efficiency and the speedup over
`ar` on the same prompts.

Which choice won is decided by the rule for a strict claim (`decoding.measurement.claims`, which the
study's verdicts use too): the difference of the overall speedups' means over the repetitions must
exceed twice their pooled sample std; otherwise neither won on this traffic.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.claims import noise_of, outcome_of
from polydraft.decoding.measurement.inputs import EvalSet, repetition_prompts
from polydraft.decoding.measurement.measure import Method
from polydraft.decoding.measurement.metrics import format_cell, mean_std, summarize

MIXED_DIR = "mixed"
ROUTED = "routed"
ORACLE = "oracle"
ALL = "all"


@dataclass(frozen=True)
class MixedPrompt:
    """One request of the mixed traffic: its tokenized prompt, the user's text, and where it came from."""

    prompt: torch.Tensor
    text: str
    pair: str
    index: int
    """Its index in its pair's eval set."""


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
            [MixedPrompt(eval_set.prompts[i], eval_set.texts[i], str(eval_set.pair), i) for i in indices]
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


class MixedGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float
    seed: int
    requests: list[MixedRequest]
    router_accuracy: float
    """Share of the requests the router sent to their own pair's drafter."""
    rows: list[MixedRow]


def group_of(
    methods: list[Method],
    traffic: list[MixedPrompt],
    requests: list[MixedRequest],
    temperature: float,
    seed: int,
) -> MixedGroup:
    """The rows of a finished group (`methods[0]` is `ar`; a method is named by its `drafter` field), for
    all requests and for each pair's."""
    ar = methods[0]
    rows = []
    for share in [ALL, *dict.fromkeys(p.pair for p in traffic)]:
        keep = [share in (ALL, p.pair) for p in traffic]
        ar_chosen = [g for g, k in zip(ar.generations, keep, strict=True) if k]
        ar_rate = summarize(ar_chosen, None)["token_rate"]
        for method in methods:
            chosen = [g for g, k in zip(method.generations, keep, strict=True) if k]
            metrics = summarize(chosen, None)
            rate = metrics["token_rate"]
            rows.append(
                MixedRow(
                    method=method.fields.get("drafter") or "ar",
                    traffic=share,
                    temperature=temperature,
                    seed=seed,
                    draft_length=method.fields.get("draft_length"),
                    prompts=len(chosen),
                    new_tokens=int(metrics["new_tokens"] or 0),
                    block_efficiency=metrics["block_efficiency"],
                    token_rate=rate,
                    speedup=rate / ar_rate if rate and ar_rate else None,
                    matches_ar=all(g.tokens == a.tokens for g, a in zip(chosen, ar_chosen, strict=True))
                    if temperature == 0
                    else None,
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
    """Mean, sample std and repetitions of the routed speedup."""
    multilingual: tuple[float, float, int]
    difference: float
    noise: float | None
    """Twice the pooled std (None with fewer than 2 repetitions each)."""
    winner: str | None
    """The routed or the multilingual method's name, or None (within the noise, or too few repetitions)."""
    names: tuple[str, str] = CHOICES[0]
    """(routed, multilingual) method names."""

    def text(self) -> str:
        def cell(value: tuple[float, float, int]) -> str:
            return f"{value[0]:.2f} ± {value[1]:.2f}"

        routed, single = self.names
        numbers = (
            f"{routed} {cell(self.routed)}x vs {single} {cell(self.multilingual)}x over "
            f"{self.routed[2]} repetitions at T={self.temperature:g}: difference {self.difference:+.2f}"
        )
        if self.noise is None:
            return f"no winner ({numbers}, too few repetitions for a noise)"
        if self.winner is None:
            return f"no winner ({numbers}, within the noise {self.noise:.2f})"
        heads = routed.startswith("eagle3")
        what = ("per-language EAGLE-3 heads", "multilingual EAGLE-3 head") if heads else (
            "per-language drafters", "multilingual drafter"
        )  # fmt: skip
        name = f"the routed {what[0]}" if self.winner == routed else f"the {what[1]}"
        return f"{name} won ({numbers}, beyond the noise {self.noise:.2f})"


RULE = (
    "the overall speedup of one choice must exceed the other's by more than twice the pooled sample std "
    "of the two over the repetitions (the study's rule for a strict claim); otherwise neither won"
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
            noise, difference = noise_of(routed, single), rm - mm
            winner = None  # the one ahead wins when its lead is a strict claim that holds
            if noise is not None and outcome_of(">", abs(difference), noise) == "holds":
                winner = names[0] if difference > 0 else names[1]
            out.append(
                Decision(
                    temperature,
                    (rm, rs, len(routed)),
                    (mm, ms, len(single)),
                    difference,
                    noise,
                    winner,
                    names,
                )
            )
    return out


def markdown(groups: list[MixedGroup]) -> str:
    """The mixed-traffic section of the measure summary: block efficiency and speedup per method and
    traffic, mean ± std over the repetitions, the router's accuracy and cost, and the decision."""
    if not groups:
        return ""
    lines = [
        "## Mixed-language traffic",
        "",
        "Every pair's held-out prompts of a repetition, interleaved, decoded by `sd` with each drafter alone, "
        "with the drafter the language router picks per request (`routed`, the router's time included) and "
        "with each prompt's own pair drafter (`oracle`); likewise by `eagle3` with the EAGLE-3 heads "
        "(`eagle3-...`) when the run trained them. Each cell: mean ± std over the repetitions.",
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
