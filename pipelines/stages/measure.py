"""Stage `measure`: speculative decoders x eval sets x temperatures x seeds for every drafter of the run.

Drafters are found upstream (`decoding.inputs.discover_drafters`); for each (eval set, temperature, seed)
group every method decodes the same prompts in one process (`decoding.measure.measure_group`) and the
group's typed rows are appended to `results.jsonl` (`decoding.results`), so a killed run resumes with the
groups it has not finished. Ends with `summary.md` and PNG plots (`decoding.report`).
"""

from __future__ import annotations

import datetime
import functools
import logging
from typing import Any

import torch

from decoding.assisted import assisted
from decoding.control import BetaTS, CaliTS, FixedK
from decoding.engine import autoregressive
from decoding.inputs import EvalSet, discover_drafters, load_eval_sets
from decoding.lm import CachedLM
from decoding.measure import (
    Drafter,
    Method,
    UnsupportedDecoder,
    eos_ids_of,
    group_rows,
    hardware,
    headline,
    load_drafters,
    measure_group,
)
from decoding.report import write_report
from decoding.results import RESULTS_FILE, ResultsError, append_rows, read_rows, write_rows
from decoding.rsd import recursive_speculative
from decoding.sampling import Sampling
from decoding.sd import speculative
from decoding.tree import TreeShape
from models.drafters import DrafterMismatch
from pipelines.schema import MeasureConfig
from pipelines.schema.common import reader_args
from pipelines.schema.inputs import EvalPrompts, MeasureInputs
from pipelines.stage import StageContext, StageFailed, StageResult

log = logging.getLogger(__name__)


def eval_sets_of(
    prompts: EvalPrompts, num_prompts: int, max_prompt_tokens: int, tokenizer: Any
) -> list[EvalSet]:
    """The recipe's eval sets, tokenized as the distill stage builds prompts (shared with export)."""
    sources = [reader_args(s, prompts.data_seed, prompts.offline) for s in prompts.sources]
    return load_eval_sets(
        sources, prompts.prompt_format, prompts.text_prompt_tokens, num_prompts, max_prompt_tokens, tokenizer
    )


def run(inputs: MeasureInputs, ctx: StageContext) -> StageResult:
    """Writes results.jsonl, summary.md and plots into the stage folder."""
    import transformers

    from models.loading import default_device, load_causal_lm, load_tokenizer

    cfg, spec = inputs.measure, inputs.target
    device = default_device()
    target = load_causal_lm(spec.path, spec.revision, spec.dtype, spec.trust_remote_code, device)
    tokenizer = load_tokenizer(spec.path, spec.revision, spec.trust_remote_code)
    eos_ids = eos_ids_of(target, tokenizer)
    try:
        eval_sets = eval_sets_of(inputs.eval, cfg.num_prompts, cfg.max_prompt_tokens, tokenizer)
        sources = discover_drafters(ctx.upstream, cfg.extra_drafters, cfg.include_pretrained)
        drafters = load_drafters(sources, target, tokenizer, device, cfg.profile)
    except (ValueError, DrafterMismatch) as err:
        raise StageFailed(f"measure: {err}") from err
    if not drafters:
        log.warning(
            "measure: no drafter found upstream (finetune/pretrain) nor in measure.extra_drafters: only `ar` runs"
        )
    target_lm = CachedLM(target, cfg.profile)
    context = {
        "target": spec.path,
        "device": device.type,
        "hardware": hardware(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    path = ctx.work_dir / RESULTS_FILE
    try:
        rows = read_rows(path)
    except ResultsError as err:
        raise StageFailed(f"measure: {err}; delete the file to measure again") from err
    write_rows(path, rows)  # drop what an interrupted run left half-written
    done = {row.group for row in rows}
    groups = [(s, t, seed) for s in eval_sets for t in cfg.temperatures for seed in cfg.seeds]
    warmed: set[str] = set()
    for eval_set, temperature, seed in ctx.progress(groups, desc="groups", unit="group"):
        if (eval_set.name, temperature, seed) in done:
            continue
        sampling = Sampling(temperature, cfg.top_p if temperature > 0 else 1.0)
        build = functools.partial(
            build_methods, cfg, eval_set, sampling, seed, target, target_lm, drafters, eos_ids
        )
        try:
            methods = measure_group(build, eval_set.prompts, warmed)
        except UnsupportedDecoder as err:
            raise StageFailed(f"measure: {err}") from err
        context["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        new_rows = group_rows(
            methods,
            eval_set,
            temperature,
            cfg.top_p,
            seed,
            cfg.max_new_tokens,
            {d.name: d for d in sources},
            context,
        )
        append_rows(path, new_rows)
        rows += new_rows
        ctx.tracker.log(
            {f"{eval_set.name}/T{temperature}/{r.method}/speedup": r.speedup for r in new_rows if r.speedup}
        )
    write_report(rows, ctx.work_dir)
    ctx.tracker.log_table("measure/results", [row.model_dump() for row in rows])
    return StageResult(metrics=headline(rows))


def controls_for(cfg: MeasureConfig, seed: int, predict: Any) -> list[tuple[str, int, Any]]:
    """(control name, K or cap, a fresh controller) for each chain-decoder setting of a group.

    Cali-TS is left out for a drafter without a calibration model.
    """
    out: list[tuple[str, int, Any]] = []
    lengths = list(dict.fromkeys([cfg.draft_length, *cfg.k_sweep]))
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
    return out


def build_methods(
    cfg: MeasureConfig,
    eval_set: EvalSet,
    sampling: Sampling,
    seed: int,
    target: Any,
    target_lm: CachedLM,
    drafters: list[Drafter],
    eos_ids: set[int],
) -> list[Method]:
    """Every method measured in one group, `ar` first."""
    device, new = target_lm.device, cfg.max_new_tokens

    def generator(index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

    methods = [
        Method(
            {"decoder": "ar"}, lambda p, i: autoregressive(target_lm, p, new, sampling, generator(i), eos_ids)
        )
    ]
    for d in drafters:
        pair = d.source.pair
        if pair and eval_set.pair and pair != eval_set.pair and not cfg.cross_pairs:
            continue
        base = {"drafter": d.source.name, "size_ratio": d.size_ratio}
        if d.self_speculative is not None:
            if "eesd" in cfg.decoders:
                from decoding.eesd import self_speculative

                for control, k, controller in controls_for(cfg, seed, d.predict):
                    methods.append(
                        Method(
                            {**base, "decoder": "eesd", "control": control, "draft_length": k},
                            lambda p, i, c=controller, d=d: self_speculative(
                                d.self_speculative, p, new, sampling, c, generator(i), eos_ids
                            ),
                        )
                    )
            continue
        if "sd" in cfg.decoders:
            for control, k, controller in controls_for(cfg, seed, d.predict):
                methods.append(
                    Method(
                        {**base, "decoder": "sd", "control": control, "draft_length": k},
                        lambda p, i, c=controller, d=d: speculative(
                            target_lm, d.lm, p, new, sampling, c, generator(i), eos_ids
                        ),
                    )
                )
        shapes = {
            "rsd_c": (TreeShape.constant(cfg.branching), "-".join(map(str, cfg.branching))),
            "rsd_s": (TreeShape.beam(cfg.beam_width, cfg.beam_depth), f"{cfg.beam_width}x{cfg.beam_depth}"),
        }
        for decoder, (shape, label) in shapes.items():
            if decoder in cfg.decoders:
                methods.append(
                    Method(
                        {**base, "decoder": decoder, "tree": label},
                        lambda p, i, s=shape, d=d: recursive_speculative(
                            target_lm, d.lm, p, new, sampling, s, generator(i), eos_ids
                        ),
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
