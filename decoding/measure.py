"""The measure stage: decoders x eval sets x temperatures x seeds for every drafter of the run.

For each (eval set, temperature, seed) group, every method (ar, then sd / rsd_c / rsd_s / assisted per
drafter, eesd with the early-exit head) decodes the same prompts in the same process, the method order
rotating from prompt to prompt so that timing noise hits all of them alike; speedups are token rates
relative to `ar` in the same group. At temperature 0 each method's output is compared with `ar`'s.

Outputs in the stage folder:
- `results.jsonl`: one JSON object per decoder x drafter x dataset x temperature x seed (x draft
  setting), appended group by group so that a killed run resumes with the groups it has not finished;
- `summary.md` and PNG plots (`decoding.report`).

Row schema of `results.jsonl` (read by the export stage and the demo's summary):
- identity: `decoder` (`ar`, `sd`, `rsd_c`, `rsd_s`, `eesd`, `assisted`), `method` (a readable label
  unique within a group, e.g. `sd[de-en] K=4`), `drafter` (name or null for `ar`), `drafter_kind`
  (`finetune`, `pretrain`, `extra`, `early_exit` or null), `drafter_pair` (pair or null), `dataset`,
  `dataset_pair` (pair or null), `in_domain` (drafter_pair == dataset_pair; null when either is null),
  `temperature`, `top_p`, `seed`;
- settings: `draft_length` (K of a chain; the cap under Thompson sampling; null otherwise), `control`
  (`fixed`, `beta_ts`, `cali_ts`, null), `tree` (`2-2-1` for rsd_c, `3x3` = W x L for rsd_s, null),
  `max_new_tokens`, `size_ratio` (drafter / target parameters, null for `ar`);
- metrics (`decoding.metrics.summarize`): `prompts`, `new_tokens`, `target_calls`, `draft_calls`,
  `block_efficiency`, `mean_accepted_length`, `mean_draft_length`, `acceptance_rate` (v_d),
  `draft_proportion` (r_d), `hm`, `mbsu`, `token_rate` (tokens/s), `wall_seconds`, `target_seconds`,
  `draft_seconds`, `overhead_share`, `eos_stops`; plus `speedup` (token rate / ar's token rate in the
  same group) and `matches_ar` (temperature 0: identical tokens on every prompt; null otherwise);
- context: `target`, `device`, `hardware` (CPU model or GPU name), `date` (UTC, ISO 8601), `torch`,
  `transformers`, `group_rows` (rows written for the group, used to detect a torn write).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoding.assisted import assisted
from decoding.control import BetaTS, CaliTS, FixedK
from decoding.engine import Generation, autoregressive
from decoding.inputs import DrafterSource, EvalSet, discover_drafters, load_eval_sets
from decoding.lm import CachedLM, parameter_count
from decoding.metrics import summarize
from decoding.report import write_report
from decoding.rsd import recursive_speculative
from decoding.sampling import Sampling
from decoding.sd import speculative
from decoding.tree import TreeShape
from pipelines.schema import MeasureConfig, Recipe
from pipelines.stage import StageContext, StageFailed, StageResult

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"


@dataclass
class Drafter:
    """A loaded drafter ready to decode with: a standalone model (`lm`) or the early-exit head attached
    to the target (`self_speculative`, a `decoding.eesd.SelfSpeculative`)."""

    source: DrafterSource
    model: Any
    size_ratio: float
    lm: CachedLM | None = None
    self_speculative: Any = None
    predict: Callable[[int, torch.Tensor, torch.Tensor], float] | None = None


@dataclass
class Method:
    """One decoder with one drafter and one setting; `decode(prompt, prompt_index)` -> Generation."""

    fields: dict[str, Any]
    decode: Callable[[torch.Tensor, int], Generation]
    generations: list[Generation] = field(default_factory=list)


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model} ({os.cpu_count()} cores)"


def eos_ids_of(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def load_drafters(
    sources: list[DrafterSource], target: Any, device: torch.device, profile: bool
) -> list[Drafter]:
    """Standalone drafters on the target's device and dtype, checked to share its vocabulary; the
    early-exit head attached to the target; their calibration models when they have one."""
    from transformers import AutoModelForCausalLM

    target_size = parameter_count(target)
    vocab = target.config.get_text_config().vocab_size
    loaded = []
    for source in sources:
        predict = None
        if source.calibration is not None:
            from models.calibration import CalibrationModel

            predict = CalibrationModel.load(source.calibration, device).predict
        if source.kind == "early_exit":
            from decoding.eesd import SelfSpeculative
            from models.early_exit import attach_exit_head

            try:
                head = attach_exit_head(target, source.path)
            except ValueError as err:
                raise StageFailed(f"measure: {err}") from err
            loaded.append(
                Drafter(
                    source,
                    head,
                    parameter_count(head) / target_size,
                    self_speculative=SelfSpeculative(target, head, profile),
                    predict=predict,
                )
            )
            continue
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=target.dtype).to(device).eval()
        if model.config.get_text_config().vocab_size != vocab:
            raise StageFailed(
                f"measure: drafter {source.name} ({source.path}) has {model.config.get_text_config().vocab_size} "
                f"tokens, the target {vocab}: a drafter must share the target's vocabulary"
            )
        loaded.append(
            Drafter(
                source,
                model,
                parameter_count(model) / target_size,
                lm=CachedLM(model, profile),
                predict=predict,
            )
        )
    return loaded


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


def method_label(fields: dict[str, Any]) -> str:
    """A readable name unique within a group: `sd[de-en] K=4`, `rsd_s[de-en] 3x3`, `eesd beta_ts`."""
    decoder = fields["decoder"]
    if decoder == "ar":
        return "ar"
    name = decoder if decoder == "eesd" else f"{decoder}[{fields['drafter']}]"
    if fields.get("tree"):
        return f"{name} {fields['tree']}"
    if fields.get("control") in ("beta_ts", "cali_ts"):
        return f"{name} {fields['control']}"
    return f"{name} K={fields['draft_length']}"


def measure_group(
    build: Callable[[], list[Method]], prompts: list[torch.Tensor], warmed: set[str]
) -> list[Method]:
    """Decode every prompt with every method, rotating the order, and return the methods.

    Each method is first warmed up once per run (first calls allocate memory and pick kernels) on
    its own copy, so that the measured methods' controllers start from their seeds untouched.
    """
    for method in build():
        label = method_label(method.fields)
        if label not in warmed:
            decode(method, prompts[0], -1)
            warmed.add(label)
    methods = build()
    for index, prompt in enumerate(prompts):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            method.generations.append(decode(method, prompt, index))
    return methods


def decode(method: Method, prompt: torch.Tensor, index: int) -> Generation:
    try:
        return method.decode(prompt, index)
    except NotImplementedError as err:  # a decoder this model cannot run (trees past a sliding window)
        raise StageFailed(
            f"measure: {method_label(method.fields)}: {err}; remove `{method.fields['decoder']}` "
            "from measure.decoders for this target"
        ) from err


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Complete rows of results.jsonl: a torn last line and incomplete groups are dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    counts: dict[tuple, int] = {}
    for row in rows:
        counts[group_key(row)] = counts.get(group_key(row), 0) + 1
    return [row for row in rows if counts[group_key(row)] == row["group_rows"]]


def group_key(row: dict[str, Any]) -> tuple:
    return (row["dataset"], row["temperature"], row["seed"])


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rewrite results.jsonl with these rows (atomically)."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


def group_rows(
    methods: list[Method],
    eval_set: EvalSet,
    cfg: MeasureConfig,
    temperature: float,
    seed: int,
    sources: dict[str, DrafterSource],
    context: dict[str, Any],
) -> list[dict[str, Any]]:
    """One row per method of a finished group, with speedups against the group's `ar`."""
    ar = methods[0]
    ar_rate = summarize(ar.generations, None)["token_rate"]
    rows = []
    for method in methods:
        fields = method.fields
        fixed_k = fields.get("draft_length") if fields.get("decoder") == "assisted" else None
        metrics = summarize(method.generations, fields.get("size_ratio"), fixed_k)
        drafter = fields.get("drafter")
        source = sources.get(drafter) if drafter else None
        drafter_pair = source.pair if source else None
        matches = None
        if temperature == 0:
            matches = all(
                g.tokens == r.tokens for g, r in zip(method.generations, ar.generations, strict=True)
            )
            if not matches:
                log.warning(
                    "measure: %s differs from ar at temperature 0 on %s", method_label(fields), eval_set.name
                )
        rows.append(
            {
                "decoder": fields["decoder"],
                "method": method_label(fields),
                "drafter": drafter,
                "drafter_kind": source.kind if source else None,
                "drafter_pair": drafter_pair,
                "dataset": eval_set.name,
                "dataset_pair": eval_set.pair,
                "in_domain": (drafter_pair == eval_set.pair) if drafter_pair and eval_set.pair else None,
                "temperature": temperature,
                "top_p": cfg.top_p,
                "seed": seed,
                "draft_length": fields.get("draft_length"),
                "control": fields.get("control"),
                "tree": fields.get("tree"),
                "max_new_tokens": cfg.max_new_tokens,
                "size_ratio": fields.get("size_ratio"),
                **metrics,
                "speedup": metrics["token_rate"] / ar_rate if metrics["token_rate"] and ar_rate else None,
                "matches_ar": matches,
                **context,
                "group_rows": len(methods),
            }
        )
    return rows


def run(recipe: Recipe, ctx: StageContext) -> StageResult:
    """Stage `measure`: writes results.jsonl, summary.md and plots into the stage folder."""
    import transformers

    from models.loading import default_device, load_causal_lm, load_tokenizer

    cfg = recipe.measure
    device = default_device()
    spec = ctx.target
    target = load_causal_lm(spec.path, spec.revision, spec.dtype, spec.trust_remote_code, device)
    tokenizer = load_tokenizer(spec.path, spec.revision, spec.trust_remote_code)
    eos_ids = eos_ids_of(target, tokenizer)
    eval_sets = load_eval_sets(recipe, cfg.num_prompts, cfg.max_prompt_tokens, tokenizer)
    sources = discover_drafters(ctx.upstream, cfg.extra_drafters, cfg.include_pretrained)
    drafters = load_drafters(sources, target, device, cfg.profile)
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
    rows = read_rows(path)
    write_rows(path, rows)  # drop what an interrupted run left half-written
    done = {group_key(row) for row in rows}
    groups = [(s, t, seed) for s in eval_sets for t in cfg.temperatures for seed in cfg.seeds]
    warmed: set[str] = set()
    for eval_set, temperature, seed in ctx.progress(groups, desc="groups", unit="group"):
        if (eval_set.name, temperature, seed) in done:
            continue
        sampling = Sampling(temperature, cfg.top_p if temperature > 0 else 1.0)
        methods = measure_group(
            functools.partial(
                build_methods, cfg, eval_set, sampling, seed, target, target_lm, drafters, eos_ids
            ),
            eval_set.prompts,
            warmed,
        )
        context["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        new_rows = group_rows(
            methods, eval_set, cfg, temperature, seed, {d.name: d for d in sources}, context
        )
        append_rows(path, new_rows)
        rows += new_rows
        ctx.tracker.log(
            {
                f"{eval_set.name}/T{temperature}/{r['method']}/speedup": r["speedup"]
                for r in new_rows
                if r["speedup"]
            }
        )
    write_report(rows, ctx.work_dir)
    ctx.tracker.log_table("measure/results", rows)
    return StageResult(metrics=headline(rows))


def headline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean speedup and block efficiency per method and temperature over in-domain (or pair-less) sets."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["decoder"] != "ar" and row["in_domain"] is not False:
            groups.setdefault(f"{row['method']}@T{row['temperature']}", []).append(row)
    out = {}
    for key, members in sorted(groups.items()):
        for metric in ("speedup", "block_efficiency"):
            values = [m[metric] for m in members if m[metric] is not None]
            if values:
                out[f"{key}/{metric}"] = sum(values) / len(values)
    return out
