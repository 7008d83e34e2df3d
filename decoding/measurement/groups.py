"""The measurement engine of the measure stage: decode the same prompts with every method in one process,
the method order rotating from prompt to prompt so that timing noise hits all of them alike, and turn the
generations into typed result rows (`decoding.measurement.results.ResultRow`) with speedups relative to `ar` in the
same group (eval set x temperature x seed). At temperature 0 each method's output is compared with `ar`'s.

The stage entry point (which methods a recipe asks for, the resumable loop over groups, the report) is
`pipelines.stages.measure`.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from polydraft.decoding.engine import Generation
from polydraft.decoding.lm import CachedLM, parameter_count
from polydraft.decoding.measurement.costs import RoundCost, predicted_speedup
from polydraft.decoding.measurement.eval_inputs import EAGLE3_PREFIX, DrafterSource, EvalSet
from polydraft.decoding.measurement.metrics import summarize
from polydraft.decoding.measurement.results import MeasureMetrics, MethodHeadline, ResultRow, prompt_results

log = logging.getLogger(__name__)


class UnsupportedDecoder(RuntimeError):
    """A decoder the target cannot run (draft trees past a sliding-window cache)."""


@dataclass
class Drafter:
    """A loaded drafter ready to decode with: a standalone model (`lm`), the early-exit head attached
    to the target (`self_speculative`, a `decoding.eesd.SelfSpeculative`), an EAGLE-3 head (`eagle3`, a
    `decoding.eagle3.Eagle3Drafter`, with `featured`, the target returning the head's features) or
    proposal heads on the target's hidden states (`model` a `models.heads.Heads`, the others None)."""

    source: DrafterSource
    model: Any
    size_ratio: float
    lm: CachedLM | None = None
    self_speculative: Any = None
    predict: Callable[[int, torch.Tensor, torch.Tensor], float] | None = None
    eagle3: Any = None
    featured: CachedLM | None = None


@dataclass
class Method:
    """One decoder with one drafter and one setting; `decode(prompt, prompt_index)` -> Generation."""

    fields: dict[str, Any]
    decode: Callable[[torch.Tensor, int], Generation]
    cost: RoundCost | None = None
    """A round's cost from measured forward latencies (`decoding.measurement.latency`); None: no prediction."""
    prefill: float = 0.0
    """The extra seconds of its models' first calls on a prompt (`RunLatencies.method_prefill`), charged
    once per generation by the prediction."""
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
    sources: list[DrafterSource], target: Any, tokenizer: Any, device: torch.device, profile: bool
) -> list[Drafter]:
    """Standalone drafters on the target's device and dtype, checked to share its vocabulary (DrafterMismatch
    otherwise); the early-exit head attached to the target (ValueError for a head of another target); their
    calibration models when they have one."""
    from polydraft.models.drafters import load_drafter

    target_size = parameter_count(target)
    vocab = target.config.get_text_config().vocab_size
    loaded = []
    for source in sources:
        predict = None
        if source.calibration is not None:
            from polydraft.models.calibration import CalibrationModel

            predict = CalibrationModel.load(source.calibration, device).predict
        if source.kind == "early_exit":
            from polydraft.decoding.eesd import SelfSpeculative
            from polydraft.models.early_exit import attach_exit_head

            head = attach_exit_head(target, source.path)
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
        if source.kind == "heads":
            from polydraft.models.heads import attach_heads

            heads = attach_heads(target, source.path)
            loaded.append(Drafter(source, heads, parameter_count(heads) / target_size))
            continue
        if source.kind == "eagle3":
            loaded.append(eagle3_drafter(source, target, device, profile, target_size))
            continue
        model = load_drafter(
            source.path,
            None,
            target_vocab_size=vocab,
            target_tokenizer=tokenizer,
            target_name="the target",
            dtype=target.dtype,
        )
        model = model.to(device).eval()
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


def eagle3_drafter(
    source: DrafterSource, target: Any, device: torch.device, profile: bool, target_size: int
) -> Drafter:
    """An EAGLE-3 head ready to draft for `target`; ValueError for a head of another target (vocabulary,
    width or layers)."""
    from polydraft.decoding.eagle3 import Eagle3Drafter
    from polydraft.models.eagle3 import load_eagle3

    head = load_eagle3(source.path, device, target.dtype)
    text = target.config.get_text_config(decoder=True)
    found = (head.config.vocab_size, head.target_hidden_size, max(head.aux_layers) < text.num_hidden_layers)
    if found != (text.vocab_size, text.hidden_size, True):
        raise ValueError(
            f"{source.path}: an EAGLE-3 head for another target (vocabulary {head.config.vocab_size}, "
            f"width {head.target_hidden_size}, feature layers {head.aux_layers}; the target has "
            f"{text.vocab_size}, {text.hidden_size}, {text.num_hidden_layers} layers)"
        )
    featured = CachedLM(target, profile, aux_layers=head.aux_layers)
    return Drafter(
        source,
        head,
        parameter_count(head) / target_size,
        eagle3=Eagle3Drafter(head, target.get_input_embeddings(), profile),
        featured=featured,
    )


def method_label(fields: dict[str, Any]) -> str:
    """A readable name unique within a group: `sd[de-en] K=4`, `rsd_s[de-en] 3x3`, `eesd beta_ts`."""
    decoder = fields["decoder"]
    if decoder == "ar":
        return "ar"
    name = decoder if decoder == "eesd" else f"{decoder}[{fields['drafter'].removeprefix(EAGLE3_PREFIX)}]"
    if fields.get("rescorer"):
        name = f"{decoder}[{fields['rescorer']}]"
    if fields.get("tree"):
        return f"{name} {fields['tree']}"
    if fields.get("control") not in (None, "fixed"):
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
        raise UnsupportedDecoder(
            f"{method_label(method.fields)}: {err}; remove `{method.fields['decoder']}` "
            "from measure.decoders for this target"
        ) from err


def group_rows(
    methods: list[Method],
    eval_set: EvalSet,
    temperature: float,
    top_p: float,
    seed: int,
    max_new_tokens: int,
    sources: dict[str, DrafterSource],
    context: dict[str, Any],
    target_step: float | None = None,
) -> list[ResultRow]:
    """One row per method of a finished group, with speedups against the group's `ar` (`methods[0]`)
    and, given the target's one-token latency `target_step`, the predicted speedups of methods with a cost."""
    ar = methods[0]
    ar_rate = summarize(ar.generations, None)["token_rate"]
    rows = []
    for method in methods:
        fields = method.fields
        fixed_k = fields.get("draft_length") if fields["decoder"] == "assisted" else None
        metrics = summarize(method.generations, fields.get("size_ratio"), fixed_k)
        drafter = fields.get("drafter")
        source = sources.get(drafter) if drafter else None
        rescorer = sources.get(fields["rescorer"]) if fields.get("rescorer") else None
        drafter_pair = (rescorer or source).pair if source else None  # a rescorer's language decides
        matches = None
        if temperature == 0:
            matches = all(
                g.tokens == r.tokens for g, r in zip(method.generations, ar.generations, strict=True)
            )
            if not matches:
                log.warning(
                    "measure: %s differs from ar at temperature 0 on %s", method_label(fields), eval_set.name
                )
        rate = metrics["token_rate"]
        rows.append(
            ResultRow(
                engine="polydraft",
                engine_detail=None,
                decoder=fields["decoder"],
                method=method_label(fields),
                drafter=drafter,
                drafter_kind=source.kind if source else None,
                drafter_pair=drafter_pair,
                dataset=eval_set.name,
                dataset_pair=eval_set.pair,
                in_domain=(drafter_pair == eval_set.pair) if drafter_pair and eval_set.pair else None,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                draft_length=fields.get("draft_length"),
                control=fields.get("control"),
                tree=fields.get("tree"),
                max_new_tokens=max_new_tokens,
                size_ratio=fields.get("size_ratio"),
                rescorer=fields.get("rescorer"),
                rescore_weight=fields.get("rescore_weight"),
                **metrics,
                speedup=rate / ar_rate if rate and ar_rate else None,
                batch_rates=None,
                predicted_speedup=predicted_speedup(
                    method.generations, target_step, method.cost, method.prefill, ar.prefill
                )
                if method.cost and target_step
                else None,
                matches_ar=matches,
                per_prompt=prompt_results(method.generations),
                **context,
                group_rows=len(methods),
            )
        )
    return rows


def headline(rows: list[ResultRow]) -> MeasureMetrics:
    """Mean speedup and block efficiency per method and temperature over in-domain (or pair-less) sets."""
    groups: dict[tuple[str, float], list[ResultRow]] = {}
    for row in rows:
        if row.decoder != "ar" and row.in_domain is not False:
            groups.setdefault((row.method, row.temperature), []).append(row)
    out = []
    for (method, temperature), members in sorted(groups.items()):
        speedups = [m.speedup for m in members if m.speedup is not None]
        efficiencies = [m.block_efficiency for m in members if m.block_efficiency is not None]
        out.append(
            MethodHeadline(
                method=method,
                temperature=temperature,
                speedup=sum(speedups) / len(speedups) if speedups else None,
                block_efficiency=sum(efficiencies) / len(efficiencies) if efficiencies else None,
            )
        )
    return MeasureMetrics(rows=len(rows), methods=out)
