"""What each stage reads: one frozen, typed inputs object per stage, built from the loaded recipe.

The runner builds a stage's inputs with its `of(recipe, target)`, hashes exactly that object (plus the
manifests of the upstream stages it consumes) to decide whether the stage is up to date, records it in
the stage's manifest and wandb config, and hands it to the stage's `run`. So a recipe field a stage does
not read cannot rerun it, and a field it reads always does. Shared pieces are included only when the stage
uses them (the offline corpus options only for offline sources, data.open only when something is mixed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from polydraft.pipelines.schema import Recipe
from polydraft.pipelines.schema.common import (
    LanguagePair,
    LaunchConfig,
    OfflineCorpusConfig,
    ResolvedTarget,
    SourceConfig,
    StrictModel,
    reader_args,
)
from polydraft.pipelines.schema.distill import DistillConfig
from polydraft.pipelines.schema.eagle3 import Eagle3Config
from polydraft.pipelines.schema.measure import ExportConfig, MeasureConfig
from polydraft.pipelines.schema.train import (
    CalibrateConfig,
    DrafterArch,
    EarlyExitConfig,
    FinetuneConfig,
    HeadsConfig,
    PretrainConfig,
)

if TYPE_CHECKING:
    from polydraft.decoding.measurement.eval_inputs import EvalSet

PromptFormat = Literal["vicuna", "chat_template", "raw"]
SINGLE_PROCESS = "recipes/accelerate/single.yaml"


def offline_options(recipe: Recipe, sources: list[SourceConfig]) -> OfflineCorpusConfig | None:
    """The offline corpus options when one of `sources` reads the offline corpus, else None."""
    return recipe.data.offline if any(s.kind == "offline" for s in sources) else None


class DistillInputs(StrictModel):
    distill: DistillConfig
    sources: list[SourceConfig]
    """data.distill: the prompts the target answers."""
    open_sources: list[SourceConfig]
    """data.open, when `distill.open_fraction` mixes some of their rows in (else empty)."""
    data_seed: int
    offline: OfflineCorpusConfig | None
    target: ResolvedTarget

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> DistillInputs:
        data = recipe.data
        open_sources = list(data.open) if recipe.distill.open_fraction > 0 else []
        return cls(
            distill=recipe.distill,
            sources=list(data.distill),
            open_sources=open_sources,
            data_seed=data.seed,
            offline=offline_options(recipe, [*data.distill, *open_sources]),
            target=target,
        )


class PretrainInputs(StrictModel):
    pretrain: PretrainConfig
    corpora: list[SourceConfig]
    """data.pretrain: the generic text."""
    data_seed: int
    offline: OfflineCorpusConfig | None
    target: ResolvedTarget
    launch: LaunchConfig

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> PretrainInputs:
        corpora = list(recipe.data.pretrain)
        return cls(
            pretrain=recipe.pretrain,
            corpora=corpora,
            data_seed=recipe.data.seed,
            offline=offline_options(recipe, corpora),
            target=target,
            launch=recipe.launch,
        )


class FinetuneInputs(StrictModel):
    finetune: FinetuneConfig
    """`finetune.drafter` is where training starts only without a pretrain stage (else the pretrained
    drafter, which the stage finds upstream)."""
    pairs: list[LanguagePair]
    data_seed: int
    target: ResolvedTarget
    launch: LaunchConfig
    done: list[str] = []
    """Drafters (pairs, `multilingual`) an earlier, interrupted run finished: the training process skips
    them. Set by the stage when it launches that process, never by the recipe (empty in the manifest)."""

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> FinetuneInputs:
        return cls(
            finetune=recipe.finetune,
            pairs=list(recipe.data.pairs),
            data_seed=recipe.data.seed,
            target=target,
            launch=recipe.launch,
        )


class EarlyExitInputs(StrictModel):
    early_exit: EarlyExitConfig
    target: ResolvedTarget
    launch: LaunchConfig

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> EarlyExitInputs:
        return cls(early_exit=recipe.early_exit, target=target, launch=recipe.launch)


class HeadsInputs(StrictModel):
    heads: HeadsConfig
    target: ResolvedTarget
    launch: LaunchConfig

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> HeadsInputs:
        return cls(heads=recipe.heads, target=target, launch=recipe.launch)


class Eagle3Inputs(StrictModel):
    eagle3: Eagle3Config
    pairs: list[LanguagePair]
    data_seed: int
    """Orders the balanced union of the multilingual head, as finetune's."""
    target: ResolvedTarget
    launch: LaunchConfig
    done: list[str] = []
    """Heads (pairs, `multilingual`) an earlier, interrupted run finished: the training process skips them.
    Set by the stage when it launches that process, never by the recipe (empty in the manifest)."""

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> Eagle3Inputs:
        return cls(
            eagle3=recipe.eagle3,
            pairs=list(recipe.data.pairs),
            data_seed=recipe.data.seed,
            target=target,
            launch=recipe.launch,
        )


class CalibrateInputs(StrictModel):
    calibrate: CalibrateConfig
    target: ResolvedTarget
    launch: LaunchConfig
    """Always one process (`single.yaml`): labelling needs the whole target, which is spread over the
    visible GPUs; only `cpu` and `env` of the recipe's launch block apply."""

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> CalibrateInputs:
        launch = recipe.launch.model_copy(update={"accelerate_config": SINGLE_PROCESS, "num_processes": None})
        return cls(calibrate=recipe.calibrate, target=target, launch=launch)


class EvalPrompts(StrictModel):
    """The evaluation sets and how their prompts are built (as the distill stage builds its prompts)."""

    sources: list[SourceConfig]
    """data.eval."""
    prompt_format: PromptFormat
    text_prompt_tokens: int
    data_seed: int
    offline: OfflineCorpusConfig | None

    @classmethod
    def of(cls, recipe: Recipe) -> EvalPrompts:
        return cls(
            sources=list(recipe.data.eval),
            prompt_format=recipe.distill.prompt_format,
            text_prompt_tokens=recipe.distill.text_prompt_tokens,
            data_seed=recipe.data.seed,
            offline=offline_options(recipe, list(recipe.data.eval)),
        )

    def load(self, num_prompts: int, max_prompt_tokens: int, tokenizer: Any) -> list[EvalSet]:
        """The eval sets, tokenized as the distill stage builds prompts (measure's and the export's)."""
        from polydraft.decoding.measurement.eval_inputs import load_eval_sets

        sources = [reader_args(s, self.data_seed, self.offline) for s in self.sources]
        return load_eval_sets(
            sources, self.prompt_format, self.text_prompt_tokens, num_prompts, max_prompt_tokens, tokenizer
        )


class MeasureInputs(StrictModel):
    measure: MeasureConfig
    eval: EvalPrompts
    target: ResolvedTarget
    extra_drafter_manifests: dict[str, str] = {}
    """Name -> sha256 of the manifest of the stage folder holding a local `measure.extra_drafters` entry
    (another run's `finetune/<pair>` or `pretrain/model`), so that this stage's key changes when that
    drafter is trained again; entries that are no stage output (a hub id, a plain folder) have none."""

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> MeasureInputs:
        return cls(
            measure=recipe.measure, eval=EvalPrompts.of(recipe), target=target,
            extra_drafter_manifests=stage_manifests(recipe.measure.extra_drafters),
        )  # fmt: skip


def stage_manifests(drafters: dict[str, str]) -> dict[str, str]:
    """The sha256 of `manifest.json` in the folder above each local drafter folder, where there is one."""
    found = {}
    for name, path in drafters.items():
        manifest = Path(path).parent / "manifest.json"
        if Path(path).is_dir() and manifest.is_file():
            found[name] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    return found


class PretrainFacts(StrictModel):
    """What a model card says about the pretraining of a drafter."""

    arch: DrafterArch
    corpora: list[SourceConfig]
    token_budget: int


class FinetuneFacts(StrictModel):
    """What a model card says about the finetuning of a language drafter."""

    init: str | None
    """`finetune.drafter.init` (used without pretraining)."""
    distill_sources: list[SourceConfig]
    open_sources: list[SourceConfig]
    distilled_temperatures: list[float]
    temperatures: list[float]
    loss: Literal["ce", "kd"]


class ExportInputs(StrictModel):
    export: ExportConfig
    eval: EvalPrompts
    """Smoke prompts are the first of each eval set, built as the measure stage builds them."""
    max_prompt_tokens: int
    """measure.max_prompt_tokens."""
    draft_length: int
    """measure.draft_length: K of a drafter whose best K was not measured."""
    eagle3_draft_length: int
    """measure's K for `eagle3`: that of an EAGLE-3 head whose best K was not measured."""
    assisted_confidence_threshold: float
    """measure.assisted_confidence_threshold, written into the drafters' generation configs."""
    target: ResolvedTarget
    target_path: str | None
    """target.path as written in the recipe (a hub id can be named in cards; a local path never is)."""
    pairs: list[LanguagePair]
    pretrain: PretrainFacts | None
    finetune: FinetuneFacts | None

    @classmethod
    def of(cls, recipe: Recipe, target: ResolvedTarget) -> ExportInputs:
        data, measure = recipe.data, recipe.measure
        pretrain = None
        if recipe.pretrain.enabled:
            pretrain = PretrainFacts(
                arch=recipe.pretrain.drafter.arch,
                corpora=list(data.pretrain),
                token_budget=recipe.pretrain.token_budget,
            )
        finetune = None
        if recipe.finetune.enabled:
            finetune = FinetuneFacts(
                init=recipe.finetune.drafter.init,
                distill_sources=list(data.distill),
                open_sources=list(data.open) if recipe.distill.open_fraction > 0 else [],
                distilled_temperatures=list(recipe.distill.temperatures),
                temperatures=list(recipe.finetune.temperatures or recipe.distill.temperatures),
                loss=recipe.finetune.loss,
            )
        return cls(
            export=recipe.export,
            eval=EvalPrompts.of(recipe),
            max_prompt_tokens=measure.max_prompt_tokens,
            draft_length=measure.draft_length,
            eagle3_draft_length=measure.eagle3_k,
            assisted_confidence_threshold=measure.assisted_confidence_threshold,
            target=target,
            target_path=recipe.target.path,
            pairs=list(data.pairs),
            pretrain=pretrain,
            finetune=finetune,
        )
