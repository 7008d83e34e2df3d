"""The measure stage's mixed-language traffic (`measure.mixed`, `decoding.measurement.mixed`): one group per
temperature x repetition, decoded by `ar`, `sd` with each finetuned drafter alone (each pair's, the
multilingual one), `routed` (the language router picks the drafter per request; its time is added to the
request's) and `oracle` (each request with its own pair's drafter). Finished groups are files, so a
killed run measures only the groups it has not finished."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch

from polydraft.decoding.control import FixedK
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.inputs import EvalSet
from polydraft.decoding.measurement.measure import Drafter, Method, measure_group
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
from polydraft.decoding.measurement.routing import LanguageRouter, routing_table_for
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.distill.prompts import MULTILINGUAL
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
    """Measure the groups `mixed/` lacks and return every group. ValueError without a pair drafter."""
    finetuned = {d.source.name: d for d in drafters if d.source.kind == "finetune" and d.lm is not None}
    pairs = {d.source.pair: name for name, d in finetuned.items() if d.source.pair is not None}
    if not pairs:
        raise ValueError(
            "measure.mixed routes requests to the per-pair drafters, but the finetune stage made none"
        )
    missing = sorted({str(s.pair) for s in eval_sets if s.pair is not None} - set(pairs))
    if missing:
        raise ValueError(f"measure.mixed: no drafter was finetuned for the eval pairs {missing}")
    fallback = MULTILINGUAL if MULTILINGUAL in finetuned else None
    router = LanguageRouter(routing_table_for(pairs, fallback))
    groups = [(t, seed) for t in cfg.temperatures for seed in cfg.seeds]
    for temperature, seed in ctx.track(groups, "measured", "mixed group"):
        if group_path(ctx.work_dir, temperature, seed).is_file():
            continue
        traffic = mixed_traffic(eval_sets, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts)
        routes: dict[int, MixedRequest] = {}
        sampling = Sampling(temperature, cfg.top_p if temperature > 0 else 1.0)

        build = functools.partial(
            mixed_methods, cfg, traffic, sampling, seed, target_lm, finetuned, pairs, router, routes, eos_ids
        )
        methods = measure_group(build, [p.prompt for p in traffic], warmed)
        requests = [routes[i] for i in range(len(traffic))]
        write_group(ctx.work_dir, group_of(methods, traffic, requests, temperature, seed))
    return read_groups(ctx.work_dir)


def mixed_methods(
    cfg: MeasureConfig,
    traffic: list[MixedPrompt],
    sampling: Sampling,
    seed: int,
    target_lm: CachedLM,
    finetuned: dict[str, Drafter],
    pairs: dict[str, str],
    router: LanguageRouter,
    routes: dict[int, MixedRequest],
    eos_ids: set[int],
) -> list[Method]:
    """`ar`, `sd` with each finetuned drafter, `routed` and `oracle` on the mixed traffic, in that order.
    `routed` records its decision per request (by index) into `routes`."""
    device, new, k = target_lm.device, cfg.max_new_tokens, cfg.draft_length

    def generator(index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

    def with_drafter(name: str | None, prompt: torch.Tensor, index: int) -> Any:
        if name is None:
            return autoregressive(target_lm, prompt, new, sampling, generator(index), eos_ids)
        lm = finetuned[name].lm
        assert lm is not None
        return speculative(target_lm, lm, prompt, new, sampling, FixedK(k), generator(index), eos_ids)

    def routed(prompt: torch.Tensor, index: int) -> Any:
        request = traffic[index]
        clock = time.perf_counter()
        route = router.route(request.text)
        seconds = time.perf_counter() - clock
        generation = with_drafter(route.drafter, prompt, index)
        generation.wall_seconds += seconds
        if index >= 0:  # not the warm-up call
            routes[index] = MixedRequest(
                pair=request.pair,
                index=request.index,
                language=route.language,
                confidence=route.confidence,
                drafter=route.drafter,
                fallback=route.fallback,
                router_ms=1000 * seconds,
            )
        return generation

    def fields(drafter: str) -> dict[str, Any]:
        return {"decoder": "sd", "drafter": drafter, "control": "fixed", "draft_length": k}

    methods = [Method({"decoder": "ar"}, lambda p, i: with_drafter(None, p, i))]
    for name in finetuned:
        methods.append(Method(fields(name), lambda p, i, name=name: with_drafter(name, p, i)))
    methods.append(Method(fields(ROUTED), routed))
    methods.append(Method(fields(ORACLE), lambda p, i: with_drafter(pairs[traffic[i].pair], p, i)))
    return methods


def mixed_summary(folder: Path, groups: list[MixedGroup]) -> None:
    """Append the mixed-traffic section to the stage's summary.md."""
    if groups:
        summary = folder / "summary.md"
        summary.write_text(summary.read_text(encoding="utf-8") + "\n" + markdown(groups), encoding="utf-8")
