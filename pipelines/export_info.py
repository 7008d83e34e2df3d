"""What an exported folder says about itself: the facts its card and `results.json` are made of.

Everything here is read from the run's files: the measure stage's `results.jsonl` (rows documented in
`decoding.measure`), the upstream stages' manifests and metrics files, and the recipe the run used. The
model card (`pipelines.cards`) is rendered from the dict built here and nothing else, so no number in a
card is typed by hand and `polydraft publish` can re-render a card for its final repo id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from decoding.metrics import mean_std
from pipelines.manifest import read_manifest
from pipelines.schema import Recipe, SourceConfig
from pipelines.stage import ResolvedTarget

Row = dict[str, Any]

RESULTS_FORMAT = "polydraft-export-results/1"
SUMMARY_METRICS = ("block_efficiency", "speedup", "acceptance_rate", "mean_accepted_length", "token_rate")
"""Per (method, dataset, temperature): mean and std over seeds of these row metrics."""


# ----------------------------------------------------------------------------- the target


def public_target(
    base_model: str | None, target_path: str | None, resolved: ResolvedTarget
) -> dict[str, Any]:
    """The target as a card may name it: a hub id (from `export.base_model` or `target.path` when that is
    not a local folder) or, for a local or bootstrap target, no id at all, so no local path leaks."""
    hub_id = base_model
    if hub_id is None and target_path is not None and not Path(target_path).expanduser().exists():
        hub_id = target_path
    revision = resolved.revision if hub_id is not None and hub_id == target_path else None
    return {
        "id": hub_id,
        "revision": revision,
        "label": hub_id.rsplit("/", 1)[-1] if hub_id else None,
    }


# ----------------------------------------------------------------------------- measurements


def rows_for(rows: list[Row], name: str) -> list[Row]:
    """A drafter's rows plus the `ar` rows of the groups (dataset, temperature, seed) it was measured in."""
    mine = [r for r in rows if r["drafter"] == name]
    groups = {(r["dataset"], r["temperature"], r["seed"]) for r in mine}
    baseline = [
        r for r in rows if r["decoder"] == "ar" and (r["dataset"], r["temperature"], r["seed"]) in groups
    ]
    return baseline + mine


def summarize_rows(rows: list[Row]) -> list[dict[str, Any]]:
    """One entry per (method, dataset, temperature): settings and mean/std over seeds of the main metrics."""
    groups: dict[tuple[str, str, float], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row["method"], row["dataset"], row["temperature"])].append(row)
    out = []
    for (method, dataset, temperature), members in groups.items():
        first = members[0]
        entry: dict[str, Any] = {
            "method": method,
            "decoder": first["decoder"],
            "control": first["control"],
            "draft_length": first["draft_length"],
            "tree": first["tree"],
            "dataset": dataset,
            "temperature": temperature,
            "in_domain": first["in_domain"],
            "seeds": sorted(r["seed"] for r in members),
            "matches_ar": None if temperature != 0 else all(r["matches_ar"] is not False for r in members),
        }
        for metric in SUMMARY_METRICS:
            mean, std = mean_std([r.get(metric) for r in members])
            entry[metric] = {"mean": mean, "std": std}
        out.append(entry)
    return out


def best_draft_length(rows: list[Row], decoder: str) -> int | None:
    """The fixed K of `decoder` with the highest mean speedup over the rows that are not out of domain
    (ties: the smaller K); None when that decoder was not measured with a fixed K."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if (
            row["decoder"] == decoder
            and row["control"] == "fixed"
            and row["in_domain"] is not False
            and row["speedup"] is not None
        ):
            by_k[row["draft_length"]].append(row["speedup"])
    if not by_k:
        return None
    return max(sorted(by_k), key=lambda k: sum(by_k[k]) / len(by_k[k]))


def headline(summary: list[dict[str, Any]], decoder: str, k: int | None) -> dict[str, Any] | None:
    """The entry of `decoder` at K=k on the lowest temperature measured, best speedup among the
    datasets that are not out of domain: the one-line result shown in commit messages and the demo."""
    candidates = [
        s
        for s in summary
        if s["decoder"] == decoder
        and s["control"] == "fixed"
        and s["draft_length"] == k
        and s["in_domain"] is not False
        and s["speedup"]["mean"] is not None
    ]
    if not candidates:
        return None
    coldest = min(s["temperature"] for s in candidates)
    return max((s for s in candidates if s["temperature"] == coldest), key=lambda s: s["speedup"]["mean"])


def measurement_context(rows: list[Row]) -> dict[str, Any]:
    """Where and when the rows were measured (every distinct value, so mixed runs show as such)."""

    def distinct(key: str) -> list[Any]:
        return sorted({r[key] for r in rows if r.get(key) is not None})

    dates = distinct("date")
    return {
        "hardware": distinct("hardware"),
        "device": distinct("device"),
        "dates": [dates[0], dates[-1]] if dates else [],
        "torch": distinct("torch"),
        "transformers": distinct("transformers"),
        "seeds": distinct("seed"),
        "prompts": distinct("prompts"),
        "max_new_tokens": distinct("max_new_tokens"),
        "top_p": distinct("top_p"),
    }


def measurements(rows: list[Row], name: str, decoder: str, target_id: str | None) -> dict[str, Any]:
    """The measured part of `results.json` for one drafter (`decoder`: `sd`, or `eesd` for the head).

    The rows' `target` (the path the measure stage loaded, a local folder for a bootstrap target) is
    replaced by the target's hub id, or `local`, so that no local path is published.
    """
    mine = [{**row, "target": target_id or "local"} for row in rows_for(rows, name)]
    measured = any(r["drafter"] == name for r in mine)
    summary = summarize_rows(mine) if measured else []
    k, best = None, None
    # the chain decoder's fixed K; else the K transformers' assisted generation was measured with
    for candidate in (decoder, "assisted") if measured else ():
        k = best_draft_length(mine, candidate)
        if k is not None:
            best = headline(summary, candidate, k)
            break
    return {
        "measured": measured,
        "decoder": decoder,
        "best_draft_length": k,
        "headline": best,
        "context": measurement_context(mine) if measured else {},
        "summary": summary,
        "rows": mine,
    }


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


def _metrics(stage_dir: Path | None) -> dict[str, Any]:
    manifest = read_manifest(stage_dir) if stage_dir is not None else None
    return (manifest or {}).get("metrics", {})


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


def pretrain_facts(recipe: Recipe, upstream: dict[str, Path]) -> dict[str, Any] | None:
    """P: the generic corpora and what the pretrain stage's manifest reports (tokens, steps, loss)."""
    if "pretrain" not in upstream:
        return None
    metrics = _metrics(upstream["pretrain"])
    return {
        "arch": recipe.pretrain.drafter.arch,
        "sources": [describe_source(s) for s in recipe.data.pretrain],
        "token_budget": recipe.pretrain.token_budget,
        "tokens": metrics.get("tokens"),
        "steps": metrics.get("steps"),
        "train_loss": _finite(metrics.get("train_loss")),
    }


def finetune_facts(recipe: Recipe, upstream: dict[str, Path], pair: str) -> dict[str, Any] | None:
    """F: the pair's distilled data (temperatures kept) and what the finetune manifest reports for it."""
    if "finetune" not in upstream:
        return None
    metrics = _metrics(upstream["finetune"])
    if "pretrain" in upstream:
        start = "the pretrained drafter (P-F)"
    elif recipe.finetune.drafter.init:
        start = f"`{recipe.finetune.drafter.init}` (F only, no pretraining)"
    else:
        start = "random initialisation (F only, no pretraining)"
    return {
        "pair": pair,
        "start": start,
        "distill_sources": [describe_source(s) for s in pair_sources(recipe.data.distill, pair)],
        "open_sources": [describe_source(s) for s in pair_sources(recipe.data.open, pair)],
        "prompt_format": recipe.distill.prompt_format,
        "distilled_temperatures": list(recipe.distill.temperatures),
        "temperatures": list(recipe.finetune.temperatures or recipe.distill.temperatures),
        "loss": recipe.finetune.loss,
        "tokens": metrics.get(f"{pair}/tokens"),
        "steps": metrics.get(f"{pair}/steps"),
        "train_loss": _finite(metrics.get(f"{pair}/train_loss")),
        "eval_loss": _finite(metrics.get(f"{pair}/eval_loss")),
        "top1_agreement": _finite(metrics.get(f"{pair}/top1_agreement")),
    }


def early_exit_facts(head_config: dict[str, Any], upstream: dict[str, Path]) -> dict[str, Any]:
    """The head's shape (N, exit layers) and the early_exit stage's training metrics."""
    training = head_config.get("training") or _metrics(upstream.get("early_exit"))
    return {
        "num_hidden_layers": head_config["num_hidden_layers"],
        "num_shared_layers": head_config["num_shared_layers"],
        "num_exit_layers": head_config["num_exit_layers"],
        "steps": training.get("steps"),
        "train_loss": _finite(training.get("train_loss")),
        "initial_top1_target": _finite(training.get("initial_top1_target")),
        "top1_target": _finite(training.get("top1_target")),
    }


def calibration_facts(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The calibrate stage's held-out report (accuracy, Brier score, ECE against the base rate)."""
    if report is None:
        return None
    keys = ("accuracy", "base_rate_accuracy", "brier", "base_rate_brier", "ece", "base_rate", "count")
    return {
        "draft_length": report.get("draft_length"),
        "heldout": {k: report["heldout"].get(k) for k in keys},
    }


def languages_of(pair: str | None, pairs: list[str]) -> list[str]:
    """`de-en` -> [de, en]; a generic drafter or head: every language of the run's pairs."""
    chosen = [pair] if pair else pairs
    return list(dict.fromkeys(lang for p in chosen for lang in p.split("-")))
