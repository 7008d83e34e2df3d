"""The measure stage's mixed-language traffic (`measure.mixed`, `decoding.measurement.mixed`): one group per
temperature x repetition with `ar`, `sd` with each finetuned drafter alone (each pair's, the multilingual
one), `routed` (the language router picks the drafter per request; its time is added to the request's) and
`oracle` (each request with its own pair's drafter); and the same with `eagle3` and the EAGLE-3 heads when
the run trained them.

Nothing is decoded here: every request of the traffic is a prompt of its pair's group of the same
repetition, which the per-pair groups already decoded with every one of those drafters, `ar` beside them.
A request's result under a method is that decoding's (tokens, target calls, wall time), read from the
per-prompt values of the per-pair rows; the router runs on every request and its time is added to the
`routed` requests' wall time. The groups are composed again on every run of the stage, from the rows."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from polydraft.data.prompts import MULTILINGUAL
from polydraft.decoding.measurement.eval_inputs import EAGLE3_PREFIX, EvalSet
from polydraft.decoding.measurement.mixed import (
    MIXED_DIR,
    ORACLE,
    ROUTED,
    Composed,
    MixedGroup,
    MixedPrompt,
    MixedRequest,
    group_of,
    markdown,
    mixed_traffic,
    read_groups,
    write_group,
)
from polydraft.decoding.measurement.results import PromptResult, ResultRow
from polydraft.pipelines.export.routing import LanguageRouter, routing_table_for
from polydraft.pipelines.schema import MeasureConfig

FAMILIES = (("sd", "finetune"), ("eagle3", "eagle3"))
"""(decoder, the drafters' kind) of the mixed traffic's families: the finetuned drafters and the heads."""

RowKey = tuple[str, float, int, str, str | None]
"""(eval set, temperature, seed, decoder, drafter) of a per-pair row."""


def measure_mixed(
    cfg: MeasureConfig, eval_sets: list[EvalSet], rows: list[ResultRow], folder: Path
) -> list[MixedGroup]:
    """Compose every group from the per-pair `rows` into `folder/mixed/` and return them. ValueError without
    a pair drafter or head for every eval pair, or when a row the traffic needs is missing."""
    lengths = {"sd": cfg.draft_length, "eagle3": cfg.eagle3_k}
    by_key: dict[RowKey, ResultRow] = {}
    families: dict[str, dict[str, str]] = {}
    """decoder -> the router's name for a drafter (its pair, or `multilingual`) -> the drafter's name."""
    for row in rows:
        if row.engine != "polydraft" or (row.decoder != "ar" and row.control != "fixed"):
            continue
        if row.decoder == "ar":
            by_key[row.dataset, row.temperature, row.seed, "ar", None] = row
        for decoder, kind in FAMILIES:
            if row.decoder == decoder and row.drafter_kind == kind and row.draft_length == lengths[decoder]:
                assert row.drafter is not None
                by_key[row.dataset, row.temperature, row.seed, decoder, row.drafter] = row
                key = row.drafter_pair or row.drafter.removeprefix(EAGLE3_PREFIX)
                families.setdefault(decoder, {})[key] = row.drafter
    if not families:
        raise ValueError(
            "measure.mixed routes requests to the per-pair drafters or EAGLE-3 heads, but the finetune and "
            "eagle3 stages made none"
        )
    eval_pairs = sorted({str(s.pair) for s in eval_sets if s.pair is not None})
    for decoder, members in families.items():
        missing = sorted(set(eval_pairs) - set(members))
        if missing:
            what = "drafter was finetuned" if decoder == "sd" else "EAGLE-3 head was trained"
            raise ValueError(f"measure.mixed: no {what} for the eval pairs {missing}")
    # the router picks a pair (or the multilingual fallback); each family decodes with its member for it
    multilingual = any(MULTILINGUAL in members for members in families.values())
    router = LanguageRouter(
        routing_table_for({p: p for p in eval_pairs}, MULTILINGUAL if multilingual else None)
    )
    router.route(eval_sets[0].texts[0])  # its first call loads what it needs: not a request's cost
    shutil.rmtree(folder / MIXED_DIR, ignore_errors=True)
    for temperature in cfg.temperatures:
        for seed in cfg.seeds:
            traffic = mixed_traffic(eval_sets, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts)
            requests = [route(router, request) for request in traffic]

            methods = [composed(by_key, traffic, (temperature, seed), "ar", None, None)]
            for decoder, members in families.items():
                alone = {key: composed(by_key, traffic, (temperature, seed), decoder, name, lengths[decoder]) for key, name in members.items()}  # fmt: skip
                methods += sorted(alone.values(), key=lambda m: m.name)
                methods += routed_and_oracle(methods[0], alone, traffic, requests, EAGLE3_PREFIX if decoder == "eagle3" else "")  # fmt: skip
            write_group(folder, group_of(methods, traffic, requests, temperature, seed))
    return read_groups(folder)


def composed(
    by_key: dict[RowKey, ResultRow],
    traffic: list[MixedPrompt],
    group: tuple[float, int],
    decoder: str,
    drafter: str | None,
    draft_length: int | None,
) -> Composed:
    """Each request's result with `drafter` (None: `ar`) in the group (temperature, seed)."""
    found = [lookup(by_key, (p.dataset, *group, decoder, drafter), p) for p in traffic]
    return Composed(
        drafter or "ar", draft_length, [r for _, r in found], [row.matches_ar for row, _ in found]
    )


def routed_and_oracle(
    ar: Composed,
    alone: dict[str, Composed],
    traffic: list[MixedPrompt],
    requests: list[MixedRequest],
    prefix: str,
) -> list[Composed]:
    """`routed`: each request with the member the router chose (`ar` when it chose none), the router's time
    added; `oracle`: each request with its own pair's member."""
    routed, oracle = [], []
    for i, (prompt, request) in enumerate(zip(traffic, requests, strict=True)):
        chosen = (alone.get(request.drafter) if request.drafter else None) or ar
        seconds = chosen.results[i].wall_seconds + request.router_ms / 1000
        routed.append((chosen.results[i].model_copy(update={"wall_seconds": seconds}), chosen.matches_ar[i]))
        own = alone[prompt.pair]
        oracle.append((own.results[i], own.matches_ar[i]))
    length = next(iter(alone.values())).draft_length
    return [
        Composed(prefix + name, length, [r for r, _ in chosen], [m for _, m in chosen])
        for name, chosen in ((ROUTED, routed), (ORACLE, oracle))
    ]


def route(router: LanguageRouter, request: MixedPrompt) -> MixedRequest:
    """The router's choice for one request, timed."""
    clock = time.perf_counter()
    choice = router.route(request.text)
    seconds = time.perf_counter() - clock
    return MixedRequest(
        pair=request.pair, index=request.index, language=choice.language, confidence=choice.confidence,
        drafter=choice.drafter, fallback=choice.fallback, router_ms=1000 * seconds,
    )  # fmt: skip


def lookup(
    by_key: dict[RowKey, ResultRow], key: RowKey, prompt: MixedPrompt
) -> tuple[ResultRow, PromptResult]:
    """The per-pair row of `key` and its result on `prompt`; ValueError naming what is missing."""
    dataset, temperature, seed, decoder, drafter = key
    row = by_key.get(key)
    where = f"on {dataset} at T={temperature:g}, repetition {seed}"
    if row is None:
        raise ValueError(
            f"measure.mixed composes the traffic from the per-pair rows, but results.jsonl has no "
            f"{decoder} row of {drafter or 'the target alone'} {where}"
        )
    if row.per_prompt is None or len(row.per_prompt) <= prompt.position:
        raise ValueError(
            f"measure.mixed: the row {row.method} {where} has no per-prompt values (measured before they "
            "were kept): delete results.jsonl to measure again"
        )
    return row, row.per_prompt[prompt.position]


def mixed_summary(folder: Path, groups: list[MixedGroup]) -> None:
    """Append the mixed-traffic section to the stage's summary.md."""
    if groups:
        summary = folder / "summary.md"
        summary.write_text(summary.read_text(encoding="utf-8") + "\n" + markdown(groups), encoding="utf-8")
