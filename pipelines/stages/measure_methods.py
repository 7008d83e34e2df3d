"""What each measure group decodes: the methods (decoder x drafter x draft setting) built for a group, the
draft-length controls, the blockwise decoders' lattices and rescoring, the trees measured, and the forward
latencies behind the predicted speedups (`pipelines.stages.measure` runs them)."""

from __future__ import annotations

from typing import Any

import torch

from polydraft.decoding.assisted import assisted
from polydraft.decoding.blockwise import HeadsDraft, Rescoring, blockwise_chain, blockwise_tree
from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.eagle3 import eagle3_decode
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lattice import CandidateTree
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.costs import ar_cost, chain_cost, tree_cost
from polydraft.decoding.measurement.eval_inputs import EvalSet
from polydraft.decoding.measurement.groups import Drafter, Method
from polydraft.decoding.measurement.latency import RunLatencies, run_latencies
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.schema import MeasureConfig


def measured_on(cfg: MeasureConfig, drafter: Drafter, eval_set: EvalSet) -> bool:
    """A language-specific drafter is measured on another pair's eval set only with `cross_pairs`."""
    pair = drafter.source.pair
    return cfg.cross_pairs or not (pair and eval_set.pair and pair != eval_set.pair)


def controls_for(
    cfg: MeasureConfig, draft_length: int, seed: int, predict: Any
) -> list[tuple[str, int, Any]]:
    """(control name, K or cap, a fresh controller) for each setting of a chain decoder whose fixed K is
    `draft_length` in a group.

    Cali-TS is left out for a drafter without a calibration model.
    """
    out: list[tuple[str, int, Any]] = []
    lengths = list(dict.fromkeys([draft_length, *cfg.k_sweep]))
    cap = cfg.max_draft_length
    if "fixed" in cfg.controls:
        out += [("fixed", k, FixedK(k)) for k in lengths]
    else:  # the K sweep is a fixed-K experiment whatever the main control
        out += [("fixed", k, FixedK(k)) for k in cfg.k_sweep]
    if "beta_ts" in cfg.controls:
        out.append(("beta_ts", cap, BetaTS(cfg.beta_prior[0], cfg.beta_prior[1], cap, seed)))
    if "cali_ts" in cfg.controls and predict is not None:
        out.append(
            ("cali_ts", cap, CaliTS(cfg.cali_sigma_m, cfg.cali_sigma_s, cfg.cali_theta0, predict, cap, seed))
        )
    # the study's variants of them (pipelines.schema.measure.Control)
    if "beta_ts_literal" in cfg.controls:
        out.append(("beta_ts_literal", cap, BetaTS(*cfg.beta_prior, cap, seed, literal=True)))
    cali = (cfg.cali_sigma_m, cfg.cali_sigma_s, cfg.cali_theta0)
    if "cali_ts_model" in cfg.controls and predict is not None:
        out.append(("cali_ts_model", cap, CaliTS(*cali, predict, cap, seed, use="model")))
    if "cali_ts_sampling" in cfg.controls and predict is not None:  # the same drafters as Cali-TS
        out.append(("cali_ts_sampling", cap, CaliTS(*cali, None, cap, seed, use="sampling")))
    return out


def blockwise_methods(
    cfg: MeasureConfig,
    heads: Drafter,
    rescorers: list[Drafter],
    sampling: Sampling,
    target_lm: CachedLM,
    new: int,
    generator: Any,
    eos_ids: set[int],
) -> list[Method]:
    """`bpd`, `medusa` with the heads alone, and their `+rescore` variants with each standalone drafter."""
    draft = HeadsDraft(heads.model, target_lm, cfg.profile)
    shape = CandidateTree.from_paths(cfg.medusa_tree)
    base = {"drafter": heads.source.name, "size_ratio": heads.size_ratio}
    methods = []
    if "bpd" in cfg.decoders:
        methods.append(
            Method(
                {**base, "decoder": "bpd", "control": "fixed", "draft_length": draft.num_heads},
                lambda p, i: blockwise_chain(target_lm, draft, p, new, sampling, generator(i), eos_ids),
            )
        )
    if "medusa" in cfg.decoders:
        methods.append(
            Method(
                {**base, "decoder": "medusa", "tree": f"{len(shape.paths)} nodes"},
                lambda p, i: blockwise_tree(
                    target_lm, draft, p, new, sampling, generator(i), eos_ids, shape=shape
                ),
            )
        )
    beams = f"{cfg.rescore_beam_width}x{draft.num_heads}"
    for d in rescorers:
        rescoring = Rescoring(d.lm, cfg.rescore_weight, cfg.rescore_top_k, cfg.rescore_beam_width)
        fields = {
            "drafter": heads.source.name,
            "size_ratio": heads.size_ratio + d.size_ratio,
            "rescorer": d.source.name,
            "rescore_weight": cfg.rescore_weight,
        }
        if "bpd+rescore" in cfg.decoders:
            methods.append(
                Method(
                    {**fields, "decoder": "bpd+rescore", "control": "fixed", "draft_length": draft.num_heads},
                    lambda p, i, r=rescoring: blockwise_chain(
                        target_lm, draft, p, new, sampling, generator(i), eos_ids, rescoring=r
                    ),
                )
            )
        if "medusa+rescore" in cfg.decoders:
            methods.append(
                Method(
                    {**fields, "decoder": "medusa+rescore", "tree": beams},
                    lambda p, i, r=rescoring: blockwise_tree(
                        target_lm, draft, p, new, sampling, generator(i), eos_ids, rescoring=r
                    ),
                )
            )
    return methods


def build_methods(
    cfg: MeasureConfig,
    eval_set: EvalSet,
    sampling: Sampling,
    seed: int,
    target: Any,
    target_lm: CachedLM,
    drafters: list[Drafter],
    eos_ids: set[int],
    latencies: RunLatencies,
) -> list[Method]:
    """Every method measured in one group, `ar` first, each with its round cost from `latencies`."""
    device, new = target_lm.device, cfg.max_new_tokens

    def generator(index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

    methods = [
        Method(
            {"decoder": "ar"},
            lambda p, i: autoregressive(target_lm, p, new, sampling, generator(i), eos_ids),
            ar_cost(latencies.target),
            latencies.method_prefill(),
        )
    ]
    standalone = []
    for d in drafters:
        pair = d.source.pair
        if pair and eval_set.pair and pair != eval_set.pair and not cfg.cross_pairs:
            continue
        if d.lm is not None:
            standalone.append(d)
    for d in drafters:
        if not measured_on(cfg, d, eval_set):
            continue
        base = {"drafter": d.source.name, "size_ratio": d.size_ratio}
        if d.source.kind == "heads":
            methods += blockwise_methods(cfg, d, standalone, sampling, target_lm, new, generator, eos_ids)
            continue
        if d.eagle3 is not None:
            if "eagle3" in cfg.decoders:
                for control, k, controller in controls_for(cfg, cfg.eagle3_k, seed, None):
                    methods.append(
                        Method(
                            {**base, "decoder": "eagle3", "control": control, "draft_length": k},
                            lambda p, i, c=controller, d=d: eagle3_decode(
                                d.featured, d.eagle3, p, new, sampling, c, generator(i), eos_ids
                            ),
                            chain_cost(latencies.rounds[d.source.name]),
                            latencies.method_prefill(d.source.name),
                        )
                    )
            continue
        if d.self_speculative is not None:
            if "eesd" in cfg.decoders:
                from polydraft.decoding.eesd import self_speculative

                for control, k, controller in controls_for(cfg, cfg.eesd_k, seed, d.predict):
                    methods.append(
                        Method(
                            {**base, "decoder": "eesd", "control": control, "draft_length": k},
                            lambda p, i, c=controller, d=d: self_speculative(
                                d.self_speculative, p, new, sampling, c, generator(i), eos_ids
                            ),
                            chain_cost(latencies.rounds[d.source.name]),
                            latencies.method_prefill(d.source.name),
                        )
                    )
            continue
        if "sd" in cfg.decoders:
            for control, k, controller in controls_for(cfg, cfg.draft_length, seed, d.predict):
                methods.append(
                    Method(
                        {**base, "decoder": "sd", "control": control, "draft_length": k},
                        lambda p, i, c=controller, d=d: speculative(
                            target_lm, d.lm, p, new, sampling, c, generator(i), eos_ids
                        ),
                        chain_cost(latencies.rounds[d.source.name]),
                        latencies.method_prefill(d.source.name, standalone=True),
                    )
                )
        for decoder, shape, label in tree_shapes(cfg):
            methods.append(
                Method(
                    {**base, "decoder": decoder, "tree": label},
                    lambda p, i, s=shape, d=d: recursive_speculative(
                        target_lm, d.lm, p, new, sampling, s, generator(i), eos_ids
                    ),
                    tree_cost(latencies.target, latencies.drafters[d.source.name], shape),
                    latencies.method_prefill(d.source.name, standalone=True),
                )
            )
        if "assisted" in cfg.decoders:
            methods.append(
                Method(
                    {**base, "decoder": "assisted", "control": "fixed", "draft_length": cfg.draft_length},
                    lambda p, i, d=d: assisted(
                        target,
                        d.model,
                        p,
                        new,
                        sampling,
                        cfg.draft_length,
                        cfg.assisted_confidence_threshold,
                        seed * 1_000_003 + i,
                        eos_ids,
                        cfg.profile,
                    ),
                )
            )
    return methods


def tree_shapes(cfg: MeasureConfig) -> list[tuple[str, TreeShape, str]]:
    """(decoder, shape, label) of every tree measured: `branching` and `rsd_c_trees` for `rsd_c`,
    `beam_width` x `beam_depth` and `rsd_s_trees` for `rsd_s`, each label once."""
    out: list[tuple[str, TreeShape, str]] = []
    if "rsd_c" in cfg.decoders:
        for b in dict.fromkeys(tuple(b) for b in [cfg.branching, *cfg.rsd_c_trees]):
            out.append(("rsd_c", TreeShape.constant(list(b)), "-".join(map(str, b))))
    if "rsd_s" in cfg.decoders:
        for w, depth in dict.fromkeys(tuple(t) for t in [[cfg.beam_width, cfg.beam_depth], *cfg.rsd_s_trees]):
            out.append(("rsd_s", TreeShape.beam(w, depth), f"{w}x{depth}"))
    return out


def measure_latencies(
    cfg: MeasureConfig, target_lm: CachedLM, drafters: list[Drafter], prompt: torch.Tensor
) -> RunLatencies:
    """The forward latencies of every model the run's decoders call, on a context as long as a prompt
    plus half an answer."""
    lengths = [cfg.draft_length, cfg.eesd_k, cfg.eagle3_k, *cfg.k_sweep]
    if any(c != "fixed" for c in cfg.controls):
        lengths.append(cfg.max_draft_length)
    shapes = [shape for _, shape, _ in tree_shapes(cfg)]
    size = max([max(lengths) + 1, *(shape.max_nodes + 1 for shape in shapes)])
    length = max(prompt.numel() + cfg.max_new_tokens // 2, size + 1)
    context = prompt.repeat(-(-length // prompt.numel()))[:length].view(1, -1)
    try:
        return run_latencies(
            target_lm,
            {d.source.name: d.lm for d in drafters if d.lm is not None},
            {d.source.name: d.self_speculative for d in drafters if d.self_speculative is not None},
            {d.source.name: (d.featured, d.eagle3) for d in drafters if d.eagle3 is not None},
            context,
            max(lengths),
            shapes,
            cfg.latency_repeats,
            prompt.view(1, -1),
        )
    except NotImplementedError as err:  # trees past a sliding window
        trees = " and ".join(f"`{d}`" for d in ("rsd_c", "rsd_s") if d in cfg.decoders)
        raise StageFailed(f"measure: {err}; remove {trees} from measure.decoders for this target") from err
