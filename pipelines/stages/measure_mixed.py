"""The measure stage's mixed-language traffic (`measure.mixed`, `decoding.measurement.mixed`): one group per
temperature x repetition, decoded by `ar`, `sd` with each finetuned drafter alone (each pair's, the
multilingual one), `routed` (the language router picks the drafter per request; its time is added to the
request's) and `oracle` (each request with its own pair's drafter); and the same with `eagle3` and the
EAGLE-3 heads when the run trained them. Finished groups are files, so a killed run measures only the
groups it has not finished."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch

from polydraft.data.prompts import MULTILINGUAL
from polydraft.decoding.control import FixedK
from polydraft.decoding.eagle3 import eagle3_decode
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.eval_inputs import EAGLE3_PREFIX, EvalSet
from polydraft.decoding.measurement.groups import Drafter, Method, measure_group
from polydraft.decoding.measurement.mixed import (
    ORACLE,
    ROUTED,
    MixedGroup,
    MixedPrompt,
    MixedRequest,
    group_of,
    group_path,
    markdown,
    mixed_traffic,
    read_groups,
    write_group,
)
from polydraft.decoding.routing import LanguageRouter, routing_table_for
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.pipelines.schema import MeasureConfig
from polydraft.pipelines.stage import StageContext


def measure_mixed(
    cfg: MeasureConfig,
    eval_sets: list[EvalSet],
    target_lm: CachedLM,
    drafters: list[Drafter],
    eos_ids: set[int],
    warmed: set[str],
    ctx: StageContext,
) -> list[MixedGroup]:
    """Measure the groups `mixed/` lacks and return every group. ValueError without a pair drafter or head
    for every eval pair."""
    families = {
        kind: {d.source.name: d for d in drafters if d.source.kind == source_kind}
        for kind, source_kind in (("sd", "finetune"), ("eagle3", "eagle3"))
    }
    families = {kind: members for kind, members in families.items() if members}
    if not families:
        raise ValueError(
            "measure.mixed routes requests to the per-pair drafters or EAGLE-3 heads, but the finetune and "
            "eagle3 stages made none"
        )
    eval_pairs = sorted({str(s.pair) for s in eval_sets if s.pair is not None})
    for kind, members in families.items():
        missing = sorted(set(eval_pairs) - {d.source.pair for d in members.values()})
        if missing:
            what = "drafter was finetuned" if kind == "sd" else "EAGLE-3 head was trained"
            raise ValueError(f"measure.mixed: no {what} for the eval pairs {missing}")
    # the router picks a pair (or the multilingual fallback); each family decodes with its member for it
    multilingual = any(
        MULTILINGUAL in (d.source.path.rsplit("/", 1)[-1] for d in m.values()) for m in families.values()
    )
    router = LanguageRouter(
        routing_table_for({p: p for p in eval_pairs}, MULTILINGUAL if multilingual else None)
    )
    groups = [(t, seed) for t in cfg.temperatures for seed in cfg.seeds]
    for temperature, seed in ctx.track(groups, "measured", "mixed group"):
        if group_path(ctx.work_dir, temperature, seed).is_file():
            continue
        traffic = mixed_traffic(eval_sets, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts)
        routes: dict[int, MixedRequest] = {}
        sampling = Sampling(temperature, cfg.top_p if temperature > 0 else 1.0)

        build = functools.partial(
            mixed_methods, cfg, traffic, sampling, seed, target_lm, families, router, routes, eos_ids
        )
        methods = measure_group(build, [p.prompt for p in traffic], warmed)
        requests = [routes[i] for i in range(len(traffic))]
        write_group(ctx.work_dir, group_of(methods, traffic, requests, temperature, seed))
    return read_groups(ctx.work_dir)


def route_key(drafter: Drafter) -> str:
    """What the router names a drafter or head by: its pair, or `multilingual`."""
    return drafter.source.pair or drafter.source.name.removeprefix(EAGLE3_PREFIX)


def mixed_methods(
    cfg: MeasureConfig,
    traffic: list[MixedPrompt],
    sampling: Sampling,
    seed: int,
    target_lm: CachedLM,
    families: dict[str, dict[str, Drafter]],
    router: LanguageRouter,
    routes: dict[int, MixedRequest],
    eos_ids: set[int],
) -> list[Method]:
    """`ar`, then for each family (`sd` with the finetuned drafters, `eagle3` with the heads): each member
    alone, `routed` and `oracle` on the mixed traffic. The first family's `routed` records the router's
    decision per request (by index) into `routes`."""
    device, new = target_lm.device, cfg.max_new_tokens
    lengths = {"sd": cfg.draft_length, "eagle3": cfg.eagle3_k}

    def generator(index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

    def decode(kind: str, drafter: Drafter | None, prompt: torch.Tensor, index: int) -> Any:
        control = FixedK(lengths[kind])
        if drafter is None:
            return autoregressive(target_lm, prompt, new, sampling, generator(index), eos_ids)
        if kind == "eagle3":
            return eagle3_decode(
                drafter.featured, drafter.eagle3, prompt, new, sampling, control, generator(index), eos_ids
            )
        assert drafter.lm is not None
        return speculative(target_lm, drafter.lm, prompt, new, sampling, control, generator(index), eos_ids)

    methods = [Method({"decoder": "ar"}, lambda p, i: decode("sd", None, p, i))]
    for position, (kind, members) in enumerate(families.items()):
        prefix = "" if kind == "sd" else EAGLE3_PREFIX
        by_pair = {route_key(d): d for d in members.values()}

        def routed(prompt: torch.Tensor, index: int, by_pair=by_pair, kind=kind, record=position == 0) -> Any:
            request = traffic[index]
            clock = time.perf_counter()
            route = router.route(request.text)
            seconds = time.perf_counter() - clock
            generation = decode(kind, by_pair.get(route.drafter) if route.drafter else None, prompt, index)
            generation.wall_seconds += seconds
            if record and index >= 0:  # not the warm-up call
                routes[index] = MixedRequest(
                    pair=request.pair, index=request.index, language=route.language, confidence=route.confidence,
                    drafter=route.drafter, fallback=route.fallback, router_ms=1000 * seconds,
                )  # fmt: skip
            return generation

        def fields(name: str, kind=kind) -> dict[str, Any]:
            return {"decoder": kind, "drafter": name, "control": "fixed", "draft_length": lengths[kind]}

        for name, drafter in members.items():
            methods.append(Method(fields(name), lambda p, i, kind=kind, d=drafter: decode(kind, d, p, i)))
        methods.append(Method(fields(prefix + ROUTED), routed))
        methods.append(
            Method(
                fields(prefix + ORACLE),
                lambda p, i, kind=kind, by_pair=by_pair: decode(kind, by_pair[traffic[i].pair], p, i),
            )
        )
    return methods


def mixed_summary(folder: Path, groups: list[MixedGroup]) -> None:
    """Append the mixed-traffic section to the stage's summary.md."""
    if groups:
        summary = folder / "summary.md"
        summary.write_text(summary.read_text(encoding="utf-8") + "\n" + markdown(groups), encoding="utf-8")
