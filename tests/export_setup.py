"""A run whose upstream stages left real artifacts, for the export and publish tests.

Tiny drafters (`models.drafters`), an early-exit head and a calibration model on the tiny target, and a
hand-written `results.jsonl` of typed rows (`decoding.measurement.results.ResultRow`). The upstream
stages are stand-ins that copy these prepared folders; the export stage itself is the real one, run by
the real runner (`run_pipeline`), so manifests are written exactly as in a pipeline run.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from polydraft.decoding.measurement.results import ResultRow
from polydraft.pipelines.run.runner import run_pipeline
from polydraft.pipelines.runtime.contract import Stage, StageResult
from polydraft.pipelines.schema import ResolvedTarget

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
DATASETS = ("de-en", "fr-en")
TEMPERATURES = (0.0, 1.0)
SEEDS = (0, 1)
LAUNCHED = {"distributed_type": "NO", "num_processes": 1}
HEAD_EVAL = {"eval_loss": 4.0, "top1_labels": 0.5, "target_top1_labels": 0.75}
TRAINING = {  # what the trainers' manifests report (typed metrics, `train.stage_metrics`)
    "pretrain": {"drafter": {"steps": 6, "tokens": 1536, "train_loss": 5.125}, **LAUNCHED},
    "finetune": {
        "pairs": {
            "de-en": {"steps": 6, "tokens": 4321, "train_loss": 3.5,
                      "eval": {"de-en": {"eval_loss": 3.25, "top1_agreement": 0.25}}},
            "fr-en": {"steps": 6, "tokens": 4567, "train_loss": 3.75,
                      "eval": {"fr-en": {"eval_loss": 3.5, "top1_agreement": 0.125}}},
        },
        **LAUNCHED,
    },
    "early_exit": {
        "steps": 4, "train_loss": 4.5, "initial": {**HEAD_EVAL, "top1_target": 0.5},
        "final": {**HEAD_EVAL, "top1_target": 0.625}, **LAUNCHED,
    },
}  # fmt: skip


def save_drafter(
    folder: Path, tokenizer: Any, vocab_size: int | None = None, seed: int = 0, shape: dict | None = None
) -> Path:
    from polydraft.models.drafters import build_drafter, export_drafter

    model = build_drafter(
        "custom", vocab_size or len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed, **(shape or TINY),
    )  # fmt: skip
    return export_drafter(model, tokenizer, folder)


def save_head(folder: Path, target_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from polydraft.models.early_exit import from_target, save_exit_head

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = from_target(target, 2, 1)
    head.target_path = str(target_dir)
    return save_exit_head(head, folder, extra={"training": TRAINING["early_exit"]})


def save_calibration(folder: Path, drafter: Path, draft_hidden: int) -> Path:
    """A calibration model for the drafter in `drafter` (named by its local path, as the calibrate stage does)."""
    from polydraft.models.calibration import CalibrationModel

    model = CalibrationModel(64, draft_hidden, 10)
    head = str(drafter)
    model.save(folder, extra={"drafter": folder.name, "drafter_path": head, "draft_length": 4})
    heldout = {
        "accuracy": 0.75,
        "base_rate_accuracy": 0.625,
        "brier": 0.1875,
        "base_rate_brier": 0.234375,
        "ece": 0.0625,
        "base_rate": 0.375,
        "count": 80,
    }
    report = {
        "drafter": folder.name,
        "drafter_path": head,
        "draft_length": 4,
        "positions": {"train": 800, "heldout": 80},
        "heldout": heldout,
        "train": heldout,
        "heldout_base_rate_by_step": [0.5, 0.375, 0.25, 0.125],
    }
    (folder / "report.json").write_text(json.dumps(report), encoding="utf-8")
    return folder


def _row(
    rng: random.Random, method: dict[str, Any], dataset: str, temperature: float, seed: int, n: int
) -> dict:
    ar = method["decoder"] == "ar"
    pair = method.get("pair")
    efficiency = 1.0 if ar else round(rng.uniform(1.2, 3.0), 4)
    speedup = 1.0 if ar else round(rng.uniform(0.8, 2.0), 4)
    return {
        "engine": "polydraft",
        "engine_detail": None,
        "decoder": method["decoder"],
        "method": method["method"],
        "drafter": method.get("drafter"),
        "drafter_kind": method.get("kind"),
        "drafter_pair": pair,
        "dataset": dataset,
        "dataset_pair": dataset,
        "in_domain": (pair == dataset) if pair else None,
        "temperature": temperature,
        "top_p": 1.0,
        "seed": seed,
        "draft_length": method.get("k"),
        "control": method.get("control"),
        "tree": method.get("tree"),
        "max_new_tokens": 64,
        "size_ratio": None if ar else 0.05,
        "prompts": 4,
        "new_tokens": 200,
        "target_calls": round(200 / efficiency),
        "draft_calls": 0 if ar else 300,
        "block_efficiency": efficiency,
        "mean_accepted_length": None if ar else round(efficiency - 1, 4),
        "mean_draft_length": None if ar else float(method.get("k") or 3),
        "acceptance_rate": None if ar else round(rng.uniform(0.2, 0.9), 4),
        "acceptance_per_position": None if ar else [round(rng.uniform(0.2, 0.9), 4)],
        "draft_proportion": None if ar else round(rng.uniform(0.2, 0.9), 4),
        "hm": None if ar else round(rng.uniform(0.2, 0.9), 4),
        "mbsu": round(efficiency / 1.2, 4),
        "token_rate": round(100 * speedup, 4),
        "wall_seconds": 2.0,
        "target_seconds": 1.5,
        "draft_seconds": 0.0 if ar else 0.3,
        "overhead_share": 0.1,
        "eos_stops": 1,
        "speedup": speedup,
        "batch_rates": None,
        "matches_ar": True if temperature == 0 else None,
        "target": "/home/someone/.cache/polydraft/bootstrap/abc123",
        "device": "cpu",
        "hardware": "Test CPU (2 cores)",
        "date": f"2026-11-2{seed}T10:00:00+00:00",
        "torch": "2.13.0",
        "transformers": "5.23.0",
        "group_rows": n,
    }


METHODS = [
    {"decoder": "ar", "method": "ar"},
    {"decoder": "sd", "method": "sd[de-en] K=2", "drafter": "de-en", "kind": "finetune", "pair": "de-en", "k": 2, "control": "fixed"},
    {"decoder": "sd", "method": "sd[de-en] K=4", "drafter": "de-en", "kind": "finetune", "pair": "de-en", "k": 4, "control": "fixed"},
    {"decoder": "rsd_c", "method": "rsd_c[de-en] 2-2-1", "drafter": "de-en", "kind": "finetune", "pair": "de-en", "tree": "2-2-1"},
    {"decoder": "assisted", "method": "assisted[de-en] K=4", "drafter": "de-en", "kind": "finetune", "pair": "de-en", "k": 4, "control": "fixed"},
    {"decoder": "sd", "method": "sd[fr-en] K=4", "drafter": "fr-en", "kind": "finetune", "pair": "fr-en", "k": 4, "control": "fixed"},
    {"decoder": "eesd", "method": "eesd K=4", "drafter": "early_exit", "kind": "early_exit", "k": 4, "control": "fixed"},
]  # fmt: skip
"""Measured methods; the pretrain stage's generic drafter is left unmeasured on purpose."""


def result_row(**fields: Any) -> ResultRow:
    """A complete result row (an `sd` row of the de-en drafter) with `fields` replacing its values."""
    method = {"decoder": "sd", "method": "sd[de-en] K=4", "drafter": "de-en", "kind": "finetune", "pair": "de-en", "k": 4, "control": "fixed"}  # fmt: skip
    return ResultRow.model_validate({**_row(random.Random(0), method, "de-en", 0.0, 0, 1), **fields})


def measure_rows(seed: int = 0) -> list[ResultRow]:
    rng = random.Random(seed)
    return [
        ResultRow.model_validate(_row(rng, method, dataset, temperature, s, len(METHODS)))
        for dataset in DATASETS
        for temperature in TEMPERATURES
        for s in SEEDS
        for method in METHODS
    ]


def build_templates(root: Path, tokenizer: Any, target_dir: Path, fr_vocab: int | None = None) -> Path:
    """Prepared stage outputs under `root/<stage>/`; `fr_vocab` breaks the fr-en drafter's vocabulary."""
    save_drafter(root / "pretrain" / "model", tokenizer, seed=1)
    save_drafter(root / "finetune" / "de-en", tokenizer, seed=2)
    save_drafter(root / "finetune" / "fr-en", tokenizer, vocab_size=fr_vocab, seed=3)
    save_head(root / "early_exit" / "head", target_dir)
    save_calibration(root / "calibrate" / "early_exit", root / "early_exit" / "head", 64)
    save_calibration(root / "calibrate" / "de-en", root / "finetune" / "de-en", TINY["hidden_size"])
    (root / "measure").mkdir(parents=True)
    rows = measure_rows()
    (root / "measure" / "results.jsonl").write_text(
        "".join(r.model_dump_json() + "\n" for r in rows), encoding="utf-8"
    )
    return root


def _provider(template: Path, metrics: dict[str, Any]):
    def run(inputs, ctx):
        shutil.copytree(template, ctx.work_dir, dirs_exist_ok=True)
        return StageResult(metrics=metrics)

    return run


def export_stages(templates: Path, real_measure: bool = False) -> list[Stage]:
    """Stand-ins for the upstream stages (copying the templates) and the real export stage; with
    `real_measure`, the real measure stage measures the stand-ins' drafters instead of the
    hand-written rows."""
    from polydraft.pipelines.stages import default_stages

    real = {s.name: s for s in default_stages()}

    def provide(name: str, metrics: dict[str, Any]) -> Stage:
        return Stage(name, _provider(templates / name, metrics), real[name].inputs, real[name].upstream)

    measure = real["measure"] if real_measure else provide("measure", {})
    return [
        provide("pretrain", TRAINING["pretrain"]),
        Stage(
            "finetune",
            _provider(templates / "finetune", TRAINING["finetune"]),
            real["finetune"].inputs,
            ("pretrain",),
        ),
        provide("early_exit", TRAINING["early_exit"]),
        Stage("calibrate", _provider(templates / "calibrate", {}), real["calibrate"].inputs, ("early_exit",)),
        measure,
        real["export"],
    ]


def run_export(recipe, run_dir: Path, templates: Path, target_dir: Path, real_measure: bool = False):
    """Run the stand-ins and the export stage with the real runner; returns the outcomes."""
    target = ResolvedTarget(path=str(target_dir), revision=None, dtype="float32", trust_remote_code=False)
    stages = export_stages(templates, real_measure)
    return run_pipeline(recipe, run_dir, stages, target, command="test", quiet=True)


def export_recipe(target_dir: Path, export: dict[str, Any] | None = None, **blocks: Any):
    """The tiny recipe with offline eval sets (the smoke prompts) and a short smoke check."""
    from tests.drafter_setup import tiny_recipe

    return tiny_recipe(
        target_dir,
        data={
            "eval": [
                {"kind": "offline", "split": "test", "pair": "de-en"},
                {"kind": "offline", "split": "test", "pair": "fr-en"},
            ]
        },
        **{
            "distill": {"enabled": False},
            "measure": {"draft_length": 3},
            **blocks,
            "export": {"smoke_prompts": 2, "smoke_max_new_tokens": 8, **(export or {})},
        },
    )
