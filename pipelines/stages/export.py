"""Stage `export`: Hugging Face folders with model cards that carry the measured speedups, smoke-checked.

For every drafter the run trained (`finetune/<pair>/`, and the pretrain stage's generic `pretrain/model/`
as `pretrain`), for the early-exit head (`early_exit/head/`) and for the blockwise proposal heads
(`heads/heads/`), one folder `<work_dir>/<name>/`:
- a drafter: its config, `model.safetensors`, the target's tokenizer files and a generation config (whose
  `num_assistant_tokens` is the K that measured best), plus its calibration model when it has one;
- the head: `early_exit.safetensors` + `early_exit.json` (target id and revision, N), loadable with
  `attach_exit_head`, and its calibration model;
- an EAGLE-3 head (`eagle3/<pair>/`): the speculators-format folder vLLM's `eagle3` method loads, its config
  naming the public target and drafting the measured best K (`pipelines.export.eagle3`); its smoke check
  runs polydraft's `eagle3` and vLLM with the folder as the target's `eagle3` draft;
- the proposal heads (seed 000): one folder in two formats (`models.heads`), polydraft's (`heads.json`,
  `heads.safetensors`; `attach_heads`) and vLLM's `medusa` speculative method's (`config.json`, the same
  weights, and for BPD heads `lm_head.safetensors`); their card carries the `bpd`, `medusa` and `+rescore`
  rows, and their smoke check runs vLLM with the folder as the target's `medusa` draft
  (`pipelines.export.smoke_heads`);
- a calibration model (Cali-TS) goes into a `calibration/` sub-folder (`CalibrationModel.load` reads it):
  vLLM loads every top-level `*.safetensors` of a draft model folder as the drafter's weights;
- `results.json` (every fact of the card, machine-readable: the measure rows of this drafter and of the
  `ar` baseline beside it, their summary, training facts, the smoke check), `README.md` (the card,
  `pipelines.export.cards`), and per-drafter `summary.md` and PNG plots from the measure stage's report code.
`export.json` indexes the folders for `polydraft publish`; `routing.json` routes requests by language to
the pair drafters and the pair heads (`pipelines.export.routing`: `load_router(folder).route(text)`).

Each folder is written as `<name>.tmp/` and renamed when complete, so a rerun after a crash redoes only
the unfinished ones. Smoke checks (`pipelines.export.smoke`) run on the staged folder, i.e. on exactly what
would be published; their result goes into the card, `results.json`, `export.json` and the manifest.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polydraft.decoding.measurement.eval_inputs import DrafterSource, discover_drafters
from polydraft.decoding.measurement.results import RESULTS_FILE as MEASURE_RESULTS
from polydraft.decoding.measurement.results import ResultsError, read_rows
from polydraft.pipelines.export.cards import render_card
from polydraft.pipelines.export.eagle3 import eagle3_checks, eagle3_facts, stage_eagle3
from polydraft.pipelines.export.info import (
    calibration_facts,
    early_exit_facts,
    finetune_facts,
    heads_facts,
    hub_datasets,
    languages_of,
    measurements,
    mixed_traffic_facts,
    pair_sources,
    pretrain_facts,
    public_target,
)
from polydraft.pipelines.export.records import (
    CARD_FILE,
    RESULTS_FILE,
    ArchitectureCard,
    ExportResults,
    GitState,
    Measurement,
    PromptExample,
    PublicTarget,
    SmokeCheck,
    SmokeResult,
    TrainingCard,
    stage_metrics,
    write_index,
)
from polydraft.pipelines.export.routing_table import export_routing_table
from polydraft.pipelines.export.smoke import Check, drafter_checks, head_checks, passed
from polydraft.pipelines.export.smoke_heads import heads_checks
from polydraft.pipelines.export.vllm_check import VllmDraft, vllm_generation_checks
from polydraft.pipelines.runtime.contract import PROJECT_ROOT, StageContext, StageFailed, StageResult
from polydraft.pipelines.runtime.manifest import git_state, write_json_atomic
from polydraft.pipelines.runtime.target import copy_devices
from polydraft.pipelines.schema.inputs import ExportInputs
from polydraft.train.stage_metrics import CalibrationReport

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"
FALLBACK_PROMPTS = ("Hello! How are you today?", "Explain speculative decoding in one sentence.")
"""Smoke prompts when the recipe has no `data.eval` sets (any prompt shows whether decoding is lossless)."""


@dataclass
class Item:
    """One folder being exported: where it comes from, where it is staged, what was measured."""

    source: DrafterSource
    staged: Path
    measurement: Measurement
    draft_length: int

    @property
    def kind(self) -> str:
        return self.source.kind if self.source.kind in ("early_exit", "heads", "eagle3") else "drafter"


# ----------------------------------------------------------------------------- staging the files


def copy_files(source: Path, dest: Path, names: list[str] | None = None) -> None:
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and (names is None or path.name in names):
            shutil.copy2(path, dest / path.name)


def stage_drafter(item: Item, tokenizer: Any, threshold: float) -> None:
    """The drafter's Hugging Face folder, its calibration model, and a generation config drafting K."""
    from transformers import GenerationConfig

    from polydraft.pipelines.export.smoke import TOKENIZER_FILES

    copy_files(Path(item.source.path), item.staged)
    if not any((item.staged / name).is_file() for name in TOKENIZER_FILES):
        tokenizer.save_pretrained(item.staged)  # a drafter is used with the target's tokenizer
    stage_calibration(item)
    if item.measurement.best_draft_length is not None and (item.staged / "generation_config.json").is_file():
        # transformers' assisted generation then drafts the measured K per round, as `assisted` measured it
        config = GenerationConfig.from_pretrained(item.staged)
        config.num_assistant_tokens = item.draft_length
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = threshold
        config.save_pretrained(item.staged)


def stage_head(item: Item, target: PublicTarget) -> dict[str, Any]:
    """The head's weights and config (naming the public target, never a local path), its calibration."""
    from polydraft.models.early_exit import CONFIG_FILE, WEIGHTS_FILE, read_head_config

    config = read_head_config(item.source.path)
    config["target"] = {"path": target.id, "revision": target.revision}
    shutil.copy2(Path(item.source.path) / WEIGHTS_FILE, item.staged / WEIGHTS_FILE)
    (item.staged / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    stage_calibration(item)
    return config


def stage_heads(item: Item, target: PublicTarget) -> dict[str, Any]:
    """The heads folder, both formats (`models.heads`): `heads.json` naming the public target, the weights,
    vLLM's medusa `config.json` and, for BPD heads, the copy of the target's lm head vLLM loads."""
    from polydraft.models.heads import (
        CONFIG_FILE,
        VLLM_CONFIG_FILE,
        VLLM_LM_HEAD_FILE,
        WEIGHTS_FILE,
        read_heads_config,
    )

    config = read_heads_config(item.source.path)
    config["target"] = {"path": target.id, "revision": target.revision}
    for name in (WEIGHTS_FILE, VLLM_CONFIG_FILE, VLLM_LM_HEAD_FILE):
        if (Path(item.source.path) / name).is_file():  # a missing one fails the smoke check, by name
            shutil.copy2(Path(item.source.path) / name, item.staged / name)
    (item.staged / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def stage_calibration(item: Item) -> None:
    """The calibration model and its report, which name the drafter they belong to by its local path:
    in the export that drafter is the enclosing folder, `..`."""
    if item.source.calibration is None:
        return
    folder = item.staged / CALIBRATION_DIR
    folder.mkdir()
    copy_files(item.source.calibration, folder, ["calibration.safetensors"])
    for name in ("calibration.json", "report.json"):
        path = item.source.calibration / name
        if path.is_file():
            content = json.loads(path.read_text(encoding="utf-8"))
            if "drafter_path" in content:
                content["drafter_path"] = ".."
            (folder / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def parameter_count(folder: Path) -> int:
    """Parameters in a folder's safetensors files, read from their headers."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                count = 1
                for size in handle.get_slice(key).get_shape():
                    count *= size
                total += count
    return total


# ----------------------------------------------------------------------------- prompts


def smoke_prompts(inputs: ExportInputs, tokenizer: Any, count: int) -> dict[str | None, list[Any]]:
    """Token-id prompts by pair (None: any): the first `count` of each `data.eval` set, built as the
    measure stage builds them; generic prompts when the recipe has no eval sets."""
    import torch

    from polydraft.data.prompts import build_prompt, encode_prompt

    if not inputs.eval.sources:
        texts = [
            build_prompt([{"role": "user", "content": t}], inputs.eval.prompt_format, tokenizer)
            for t in FALLBACK_PROMPTS
        ]
        return {None: [torch.tensor(encode_prompt(tokenizer, t)) for t in texts][:count]}
    prompts: dict[str | None, list[Any]] = {None: []}
    try:
        eval_sets = inputs.eval.load(count, inputs.max_prompt_tokens, tokenizer)
    except ValueError as err:
        raise StageFailed(f"export: smoke prompts: {err}") from err
    for eval_set in eval_sets:
        prompts.setdefault(eval_set.pair, []).extend(eval_set.prompts)
        prompts[None].extend(eval_set.prompts)
    return prompts


def prompts_for(prompts: dict[str | None, list[Any]], pair: str | None, count: int) -> list[Any]:
    return (prompts.get(pair, []) + prompts[None])[:count] if pair else prompts[None][:count]


def prompt_example(prompt_format: str, tokenizer: Any, pair: str | None) -> PromptExample:
    """The prompt format the drafter was trained on, with a placeholder, for the card's usage snippet."""
    from polydraft.data.prompts import build_prompt, translation_messages

    messages = translation_messages(pair, "{text}") if pair else [{"role": "user", "content": "{question}"}]
    example = build_prompt(messages, prompt_format, tokenizer)
    bos = tokenizer.bos_token
    return PromptExample(
        format=prompt_format, example=example, add_special_tokens=not (bos and example.startswith(bos))
    )


# ----------------------------------------------------------------------------- the stage


def build_info(
    item: Item,
    inputs: ExportInputs,
    ctx: StageContext,
    target: PublicTarget,
    checks: list[Check],
    extra: dict[str, Any],
    tokenizer: Any,
) -> ExportResults:
    """Everything the card says, as written to `results.json`."""
    source, cfg = item.source, inputs.export
    sources = []
    if inputs.finetune is not None:
        finetune = inputs.finetune
        sources = [
            *pair_sources(finetune.distill_sources, source.pair),
            *pair_sources(finetune.open_sources, source.pair),
        ]
    if source.kind in ("pretrain", "finetune") and inputs.pretrain is not None and "pretrain" in ctx.upstream:
        sources += inputs.pretrain.corpora
    calibration = None
    if source.calibration is not None:
        report = source.calibration / "report.json"
        calibration = calibration_facts(
            CalibrationReport.model_validate_json(report.read_text(encoding="utf-8"))
            if report.is_file()
            else None
        )
    trained = source.kind in ("pretrain", "finetune")
    training = TrainingCard(
        pretrain=pretrain_facts(inputs.pretrain, ctx.upstream) if trained else None,
        finetune=finetune_facts(inputs.finetune, ctx.upstream, source.pair, inputs.eval.prompt_format)
        if source.kind == "finetune"
        else None,
    )
    info = ExportResults(
        name=source.name,
        kind=item.kind,
        source=source.kind,
        pair=source.pair,
        repo_name=repo_name(target, ctx.run_dir.name, item),
        target=target,
        license=cfg.license,
        languages=languages_of(source.pair, list(inputs.pairs)),
        datasets=hub_datasets(sources),
        training=training,
        calibration=calibration,
        prompt=prompt_example(inputs.eval.prompt_format, tokenizer, source.pair),
        measurement=item.measurement,
        draft_length_default=inputs.draft_length,
        smoke=SmokeResult(
            passed=passed(checks),
            checks=[SmokeCheck(name=c.name, status=c.status, detail=c.detail) for c in checks],
        ),
        plots=sorted(p.name for p in item.staged.glob("*.png")),
        mixed_traffic=mixed_traffic_facts(ctx.upstream) if source.kind in ("finetune", "eagle3") else None,
        polydraft=GitState(**git_state(PROJECT_ROOT)),
        **extra,
    )
    files = [p.relative_to(item.staged).as_posix() for p in item.staged.rglob("*") if p.is_file()]
    return info.model_copy(update={"files": sorted([*files, RESULTS_FILE, CARD_FILE])})


def repo_name(target: PublicTarget, run_name: str, item: Item) -> str:
    """`<target>-drafter-<name>` / `<target>-eesd-head` / `<target>-heads`; a local target is named after
    the run."""
    prefix = target.label or run_name
    if item.kind == "heads":
        return f"{prefix}-heads"
    if item.kind == "eagle3":
        return f"{prefix}-eagle3-{item.source.pair or item.source.name.removeprefix('eagle3-')}"
    return f"{prefix}-eesd-head" if item.kind == "early_exit" else f"{prefix}-drafter-{item.source.name}"


def run(inputs: ExportInputs, ctx: StageContext) -> StageResult:
    """One smoke-checked Hugging Face folder with a card per drafter and head."""
    from polydraft.models.loading import load_tokenizer

    cfg, resolved = inputs.export, inputs.target
    try:
        sources = discover_drafters(ctx.upstream, {}, cfg.include_pretrained)
        rows = read_rows(ctx.upstream["measure"] / MEASURE_RESULTS) if "measure" in ctx.upstream else []
        mixed_traffic_facts(ctx.upstream)  # a broken group file fails here, before any folder is written
    except (ValueError, ResultsError) as err:
        raise StageFailed(f"export: {err}") from err
    if not sources:
        log.warning(
            "export: no drafter or early-exit head upstream (finetune, pretrain, early_exit): nothing to export"
        )
    target = public_target(cfg.base_model, inputs.target_path, resolved)
    tokenizer = load_tokenizer(resolved.path, resolved.revision, resolved.trust_remote_code)
    items = []
    for source in sources:
        if (ctx.work_dir / source.name / RESULTS_FILE).is_file():
            continue  # finished by an earlier, interrupted run of this same config
        decoder = {"early_exit": "eesd", "heads": "bpd", "eagle3": "eagle3"}.get(source.kind, "sd")
        measured = measurements(rows, source.name, decoder, target.id)
        staged = ctx.work_dir / f"{source.name}.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        default = inputs.eagle3_draft_length if source.kind == "eagle3" else inputs.draft_length
        items.append(Item(source, staged, measured, measured.best_draft_length or default))
    if items:
        finish_items(items, inputs, ctx, target, tokenizer)
    index = write_index(ctx.work_dir, [s.name for s in sources], target)
    try:
        table = export_routing_table(ctx.work_dir, index, cfg.routing_threshold)
    except ValueError as err:
        raise StageFailed(f"export: routing table: {err}") from err
    for entry in index.items:
        info = ExportResults.model_validate_json(
            (ctx.work_dir / entry.folder / RESULTS_FILE).read_text("utf-8")
        )
        ctx.tracker.log_table(f"export/{entry.name}", flat_summary(info.measurement))
        metadata = {
            "kind": entry.kind,
            "pair": entry.pair,
            "target": target.id,
            "smoke_passed": entry.smoke_passed,
        }
        metadata["headline"] = entry.headline.model_dump() if entry.headline else None
        ctx.tracker.log_artifact(entry.repo_name, ctx.work_dir / entry.folder, metadata)
    return StageResult(metrics=stage_metrics(index, table))


def finish_items(
    items: list[Item], inputs: ExportInputs, ctx: StageContext, target: PublicTarget, tokenizer: Any
) -> None:
    """Stage each folder's files, smoke-check them, write results.json and the card, rename into place."""
    from polydraft.decoding.measurement.groups import eos_ids_of
    from polydraft.decoding.measurement.tables import write_report
    from polydraft.models.placement import load_target

    cfg, resolved = inputs.export, inputs.target
    extras: dict[str, dict[str, Any]] = {}
    for item in ctx.track(items, "staged and checked", "folder"):
        if item.kind == "early_exit":
            extras[item.source.name] = {"head": early_exit_facts(stage_head(item, target), ctx.upstream)}
        elif item.kind == "heads":
            extras[item.source.name] = {"heads": heads_facts(stage_heads(item, target), ctx.upstream)}
        elif item.kind == "eagle3":
            config = stage_eagle3(Path(item.source.path), item.staged, target, item.draft_length)
            extras[item.source.name] = {"eagle3": eagle3_facts(config, item.staged, item.draft_length)}
        else:
            stage_drafter(item, tokenizer, inputs.assisted_confidence_threshold)
            config = json.loads((item.staged / "config.json").read_text(encoding="utf-8"))
            extras[item.source.name] = {"architecture": architecture_facts(config, item.staged)}
        if item.measurement.measured:
            write_report(item.measurement.rows, item.staged)  # this drafter's summary.md and plots

    prompts = smoke_prompts(inputs, tokenizer, cfg.smoke_prompts)
    # vLLM first, in subprocesses, while this process holds no model on the GPU
    in_vllm = [item for item in items if item.kind in ("drafter", "heads", "eagle3")]
    drafts = [
        VllmDraft(
            str(item.staged),
            {"heads": "medusa", "eagle3": "eagle3"}.get(item.kind, "draft_model"),
            extras[item.source.name]["heads"].num_heads if item.kind == "heads" else item.draft_length,
            [p.tolist() for p in prompts_for(prompts, item.source.pair, cfg.smoke_prompts)],
        )
        for item in in_vllm
    ]
    target_spec = {"path": resolved.path, "revision": resolved.revision, "trust_remote_code": resolved.trust_remote_code}  # fmt: skip
    devices = copy_devices(resolved)  # the folders dealt over the copies of the target this node holds
    found = vllm_generation_checks(cfg.vllm_check, target_spec, drafts, cfg.smoke_max_new_tokens, devices)
    vllm_checks = {item.source.name: check for item, check in zip(in_vllm, found, strict=True)}
    model = load_target(
        resolved.path,
        resolved.revision,
        resolved.dtype,
        resolved.trust_remote_code,
        resolved.max_memory_per_gpu_gib,
    )
    eos_ids = eos_ids_of(model, tokenizer)
    # drafters first: attaching the head builds exit modules beside the target's
    for item in sorted(items, key=lambda i: i.kind == "early_exit"):
        name, chosen = item.source.name, prompts_for(prompts, item.source.pair, cfg.smoke_prompts)
        if item.kind == "early_exit":
            checks = head_checks(
                item.staged, model, chosen, cfg.smoke_max_new_tokens, eos_ids, item.draft_length
            )
        elif item.kind == "heads":
            checks = heads_checks(item.staged, model, chosen, cfg.smoke_max_new_tokens, eos_ids)
            checks.append(vllm_checks[name])
        elif item.kind == "eagle3":
            checks = eagle3_checks(
                item.staged, model, chosen, cfg.smoke_max_new_tokens, eos_ids, item.draft_length
            )
            checks.append(vllm_checks[name])
        else:
            checks = drafter_checks(item.staged, model, tokenizer, chosen, cfg.smoke_max_new_tokens, eos_ids)
            checks.append(vllm_checks[name])
        info = build_info(item, inputs, ctx, target, checks, extras[name], tokenizer)
        write_json_atomic(item.staged / RESULTS_FILE, info.model_dump(mode="json", by_alias=True))
        card = render_card(info, default_repo_id(cfg.repo_prefix, info))
        (item.staged / CARD_FILE).write_text(card, encoding="utf-8")
        failed = "; ".join(f"{c.name}: {c.detail}" for c in checks if c.status == "fail")
        if failed:
            log.error("export: %s failed its smoke check: %s", name, failed)
            if cfg.strict:  # the folder stays staged (`.tmp`): a rerun checks it again
                raise StageFailed(
                    f"export: {name} failed its smoke check ({failed}); see {item.staged / CARD_FILE}"
                )
        final = ctx.work_dir / name
        shutil.rmtree(final, ignore_errors=True)
        item.staged.rename(final)


def architecture_facts(config: dict[str, Any], folder: Path) -> ArchitectureCard:
    """A drafter's shape, read from its `config.json` (a file of another library: keys may be absent)."""
    text = config.get("text_config", config)
    return ArchitectureCard.model_validate(
        {
            "class": (config.get("architectures") or [config.get("model_type")])[0],
            "model_type": config.get("model_type"),
            "hidden_size": text.get("hidden_size"),
            "num_hidden_layers": text.get("num_hidden_layers"),
            "vocab_size": text.get("vocab_size"),
            "max_position_embeddings": text.get("max_position_embeddings"),
            "parameters": parameter_count(folder),
        }
    )


def default_repo_id(repo_prefix: str | None, info: ExportResults) -> str:
    """The repo id the card's snippets name before `polydraft publish` picks the real one."""
    return f"{repo_prefix or 'ORG/'}{info.repo_name}"


def flat_summary(measurement: Measurement) -> list[dict[str, Any]]:
    """Summary entries as flat rows (one column per metric mean and std) for a wandb Table."""
    out = []
    for entry in measurement.summary:
        row: dict[str, Any] = {}
        for key, value in entry.model_dump().items():
            if isinstance(value, dict):
                row[f"{key}_mean"], row[f"{key}_std"] = value["mean"], value["std"]
            elif not isinstance(value, list):
                row[key] = value
        out.append(row)
    return out
