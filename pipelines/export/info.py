"""What an exported folder says about itself: the facts its card and `results.json` are made of.

Everything here is read from the run's files: the measure stage's `results.jsonl` (typed rows,
`decoding.measurement.results`), the upstream stages' manifests (typed metrics, `train.stage_metrics`), and the export
stage's inputs. The model card (`pipelines.export.cards`) is rendered from the records built here
(`pipelines.export.records`) and nothing else, so no number in a card is typed by hand and
`polydraft publish` can re-render a card for its final repo id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from polydraft.decoding.measurement.metrics import mean_std
from polydraft.decoding.measurement.mixed import RULE, decisions, markdown, read_groups
from polydraft.decoding.measurement.results import ResultRow
from polydraft.pipelines.export.records import (
    CalibrationCard,
    FinetuneCard,
    HeadCard,
    HeadsCard,
    MeanStd,
    Measurement,
    MeasurementContext,
    MixedTrafficCard,
    PretrainCard,
    PublicTarget,
    SummaryEntry,
)
from polydraft.pipelines.runtime.manifest import read_manifest
from polydraft.pipelines.schema import ResolvedTarget, SourceConfig
from polydraft.pipelines.schema.inputs import FinetuneFacts, PretrainFacts
from polydraft.train.stage_metrics import (
    CalibrationReport,
    EarlyExitMetrics,
    FinetuneMetrics,
    HeadsEval,
    HeadsMetrics,
    PretrainMetrics,
)

Row = ResultRow

SUMMARY_METRICS = ("block_efficiency", "speedup", "acceptance_rate", "mean_accepted_length", "token_rate")
"""Per (method, dataset, temperature): mean and std over seeds of these row metrics."""


# ----------------------------------------------------------------------------- the target


def public_target(base_model: str | None, target_path: str | None, resolved: ResolvedTarget) -> PublicTarget:
    """The target as a card may name it: a hub id (from `export.base_model` or `target.path` when that is
    not a local folder) or, for a local or bootstrap target, no id at all, so no local path leaks."""
    hub_id = base_model
    if hub_id is None and target_path is not None and not Path(target_path).expanduser().exists():
        hub_id = target_path
    revision = resolved.revision if hub_id is not None and hub_id == target_path else None
    return PublicTarget(id=hub_id, revision=revision, label=hub_id.rsplit("/", 1)[-1] if hub_id else None)


# ----------------------------------------------------------------------------- measurements


def rows_for(rows: list[Row], name: str) -> list[Row]:
    """A drafter's rows plus the `ar` rows of the groups (dataset, temperature, seed) it was measured in."""
    mine = [r for r in rows if r.drafter == name]
    groups = {r.group for r in mine}
    return [r for r in rows if r.decoder == "ar" and r.group in groups] + mine


def summarize_rows(rows: list[Row]) -> list[SummaryEntry]:
    """One entry per (method, dataset, temperature): settings and mean/std over seeds of the main metrics."""
    groups: dict[tuple[str, str, float], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row.method, row.dataset, row.temperature)].append(row)
    out = []
    for (method, dataset, temperature), members in groups.items():
        first = members[0]
        metrics = {}
        for metric in SUMMARY_METRICS:
            mean, std = mean_std([getattr(r, metric) for r in members])
            metrics[metric] = MeanStd(mean=mean, std=std)
        out.append(
            SummaryEntry(
                method=method,
                engine=first.engine,
                decoder=first.decoder,
                control=first.control,
                draft_length=first.draft_length,
                tree=first.tree,
                dataset=dataset,
                temperature=temperature,
                in_domain=first.in_domain,
                seeds=sorted(r.seed for r in members),
                matches_ar=None if temperature != 0 else all(r.matches_ar is not False for r in members),
                **metrics,
            )
        )
    return out


def best_draft_length(rows: list[Row], decoder: str) -> int | None:
    """The fixed K of `decoder` with the highest mean speedup in polydraft's engine over the rows that are
    not out of domain (ties: the smaller K); None when that decoder was not measured with a fixed K."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if (
            row.engine == "polydraft"
            and row.decoder == decoder
            and row.control == "fixed"
            and row.in_domain is not False
            and row.speedup is not None
            and row.draft_length is not None
        ):
            by_k[row.draft_length].append(row.speedup)
    if not by_k:
        return None
    return max(sorted(by_k), key=lambda k: sum(by_k[k]) / len(by_k[k]))


def headline(summary: list[SummaryEntry], decoder: str, k: int | None) -> SummaryEntry | None:
    """The entry of `decoder` at K=k on the lowest temperature measured, best speedup among the
    datasets that are not out of domain: the one-line result shown in commit messages and the demo."""
    candidates = [
        s
        for s in summary
        if s.engine == "polydraft"
        and s.decoder == decoder
        and s.control == "fixed"
        and s.draft_length == k
        and s.in_domain is not False
        and s.speedup.mean is not None
    ]
    if not candidates:
        return None
    coldest = min(s.temperature for s in candidates)
    return max((s for s in candidates if s.temperature == coldest), key=lambda s: s.speedup.mean or 0.0)


def measurement_context(rows: list[Row]) -> MeasurementContext:
    """Where and when the rows were measured (every distinct value, so mixed runs show as such)."""

    def distinct(key: str) -> list[Any]:
        return sorted({getattr(r, key) for r in rows if getattr(r, key) is not None})

    dates = distinct("date")
    return MeasurementContext(
        hardware=distinct("hardware"),
        device=distinct("device"),
        dates=[dates[0], dates[-1]] if dates else [],
        torch=distinct("torch"),
        transformers=distinct("transformers"),
        seeds=distinct("seed"),
        prompts=distinct("prompts"),
        max_new_tokens=distinct("max_new_tokens"),
        top_p=distinct("top_p"),
    )


def measurements(rows: list[Row], name: str, decoder: str, target_id: str | None) -> Measurement:
    """The measured part of `results.json` for one drafter (`decoder`: `sd`, `eesd` for the early-exit head,
    `bpd` for proposal heads, whose rows also hold `medusa` and both `+rescore` decoders).

    The rows' `target` (the path the measure stage loaded, a local folder for a bootstrap target) is
    replaced by the target's hub id, or `local`, so that no local path is published.
    """
    mine = [row.model_copy(update={"target": target_id or "local"}) for row in rows_for(rows, name)]
    measured = any(r.drafter == name for r in mine)
    summary = summarize_rows(mine) if measured else []
    k, best = None, None
    # the chain decoder's fixed K; else the K transformers' assisted generation was measured with
    for candidate in (decoder, "assisted") if measured else ():
        k = best_draft_length(mine, candidate)
        if k is not None:
            best = headline(summary, candidate, k)
            break
    return Measurement(
        measured=measured,
        decoder=decoder,
        best_draft_length=k,
        headline=best,
        context=measurement_context(mine) if measured else None,
        summary=summary,
        rows=mine,
    )


# ----------------------------------------------------------------------------- training facts


def describe_source(source: SourceConfig) -> str:
    """A source as a card shows it; a local file by its name only (its folder may be a personal path)."""
    where = {
        "offline": "the built-in offline corpus (gettext catalogs, CLDR names and dates, spelled-out numbers)",
        "hf": f"`{source.path}`"
        + (f" (`{source.name}`)" if source.name else "")
        + " from the Hugging Face Hub",
        "local": f"the local file `{Path(source.path or '').name}`",
    }[source.kind]
    details = [source.format]
    if source.pair:
        details.append(source.pair)
    details.append(f"split {source.split}")
    if source.limit is not None:
        details.append(f"at most {source.limit} rows")
    return f"{where} ({', '.join(details)})"


def hub_datasets(sources: list[SourceConfig]) -> list[str]:
    """Hub dataset ids of the sources, for the card's `datasets` metadata."""
    return list(dict.fromkeys(s.path for s in sources if s.kind == "hf" and s.path))


def pair_sources(sources: list[SourceConfig], pair: str | None) -> list[SourceConfig]:
    """The sources a drafter for `pair` was trained on: that pair's translation sets and every other kind."""
    return [s for s in sources if s.format != "translation" or pair is None or s.pair == pair]


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _stage_metrics(stage_dir: Path) -> dict[str, Any]:
    """The `metrics` of an upstream stage's manifest (the runner only hands complete stages to export)."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise ValueError(f"{stage_dir}: no readable manifest.json")
    return manifest["metrics"]


def pretrain_facts(facts: PretrainFacts | None, upstream: dict[str, Path]) -> PretrainCard | None:
    """P: the generic corpora and what the pretrain stage's manifest reports (tokens, steps, loss)."""
    if facts is None or "pretrain" not in upstream:
        return None
    drafter = PretrainMetrics.model_validate(_stage_metrics(upstream["pretrain"])).drafter
    return PretrainCard(
        arch=facts.arch,
        sources=[describe_source(s) for s in facts.corpora],
        token_budget=facts.token_budget,
        tokens=drafter.tokens,
        steps=drafter.steps,
        train_loss=_finite(drafter.train_loss),
    )


def finetune_facts(
    facts: FinetuneFacts | None, upstream: dict[str, Path], pair: str | None, prompt_format: str
) -> FinetuneCard | None:
    """F: the pair's distilled data (temperatures kept) and what the finetune manifest reports for it."""
    if facts is None or "finetune" not in upstream or pair is None:
        return None
    metrics = FinetuneMetrics.model_validate(_stage_metrics(upstream["finetune"])).pairs.get(pair)
    if "pretrain" in upstream:
        start = "the pretrained drafter (P-F)"
    elif facts.init:
        start = f"`{facts.init}` (F only, no pretraining)"
    else:
        start = "random initialisation (F only, no pretraining)"
    held_out = metrics.eval.get(pair) if metrics is not None else None
    return FinetuneCard(
        pair=pair,
        start=start,
        distill_sources=[describe_source(s) for s in pair_sources(facts.distill_sources, pair)],
        open_sources=[describe_source(s) for s in pair_sources(facts.open_sources, pair)],
        prompt_format=prompt_format,
        distilled_temperatures=facts.distilled_temperatures,
        temperatures=facts.temperatures,
        loss=facts.loss,
        tokens=metrics.tokens if metrics else None,
        steps=metrics.steps if metrics else None,
        train_loss=_finite(metrics.train_loss) if metrics else None,
        eval_loss=_finite(held_out.eval_loss) if held_out else None,
        top1_agreement=_finite(held_out.top1_agreement) if held_out else None,
    )


def early_exit_facts(head_config: dict[str, Any], upstream: dict[str, Path]) -> HeadCard:
    """The head's shape (N, exit layers) and the early_exit stage's training metrics."""
    training = EarlyExitMetrics.model_validate(_stage_metrics(upstream["early_exit"]))
    return HeadCard(
        num_hidden_layers=head_config["num_hidden_layers"],
        num_shared_layers=head_config["num_shared_layers"],
        num_exit_layers=head_config["num_exit_layers"],
        steps=training.steps,
        train_loss=_finite(training.train_loss),
        initial_top1_target=_finite(training.initial.top1_target) if training.initial else None,
        top1_target=_finite(training.final.top1_target) if training.final else None,
    )


def heads_facts(config: dict[str, Any], upstream: dict[str, Path]) -> HeadsCard:
    """The heads' shape (`heads.json`) and the heads stage's training metrics."""
    training = HeadsMetrics.model_validate(_stage_metrics(upstream["heads"]))
    hidden, vocab, heads = config["hidden_size"], config["vocab_size"], config["num_heads"]
    block = config["num_layers"] * (hidden * hidden + (hidden if config["bias"] else 0))
    parameters = heads * (block + (vocab * hidden if config["kind"] == "medusa" else 0))

    def top1(scores: HeadsEval | None) -> list[float] | None:
        return [score.top1_target for score in scores.heads] if scores is not None else None

    return HeadsCard(
        kind=config["kind"],
        num_heads=config["num_heads"],
        num_layers=config["num_layers"],
        parameters=parameters,
        steps=training.steps,
        train_loss=_finite(training.train_loss),
        initial_top1_target=top1(training.initial),
        top1_target=top1(training.final),
    )


def mixed_traffic_facts(upstream: dict[str, Path]) -> MixedTrafficCard | None:
    """The measure stage's mixed-traffic groups as a card section; None when it measured none.
    ValueError naming a group file that is not one."""
    groups = read_groups(upstream["measure"]) if "measure" in upstream else []
    if not groups:
        return None
    return MixedTrafficCard(
        decisions=[d.text() for d in decisions(groups)], rule=RULE, summary=markdown(groups)
    )


def calibration_facts(report: CalibrationReport | None) -> CalibrationCard | None:
    """The calibrate stage's held-out report (accuracy, Brier score, ECE against the base rate)."""
    if report is None:
        return None
    return CalibrationCard(draft_length=report.draft_length, heldout=report.heldout)


def languages_of(pair: str | None, pairs: list[str]) -> list[str]:
    """`de-en` -> [de, en]; a generic drafter or head: every language of the run's pairs."""
    chosen = [pair] if pair else pairs
    return list(dict.fromkeys(lang for p in chosen for lang in p.split("-")))
