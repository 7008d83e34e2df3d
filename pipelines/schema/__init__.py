"""The typed recipe: one block per stage, plus the shared target, data, launch and tracking blocks."""

from __future__ import annotations

from pydantic import Field, model_validator

from polydraft.pipelines.schema.common import (
    BootstrapConfig,
    DataConfig,
    FieldError,
    LaunchConfig,
    ResolvedTarget,
    RunnerConfig,
    SourceConfig,
    StrictModel,
    TargetConfig,
    TrackingConfig,
)
from polydraft.pipelines.schema.distill import DistillConfig
from polydraft.pipelines.schema.eagle3 import Eagle3Config
from polydraft.pipelines.schema.measure import ExportConfig, MeasureConfig
from polydraft.pipelines.schema.train import (
    CalibrateConfig,
    DrafterConfig,
    EarlyExitConfig,
    FinetuneConfig,
    HeadsConfig,
    LoopConfig,
    MemoryLoop,
    OptimConfig,
    PretrainConfig,
    TargetLayerLoop,
)


class Recipe(StrictModel):
    """A whole run: everything a pipeline run needs, nothing else."""

    target: TargetConfig
    data: DataConfig
    distill: DistillConfig = Field(default_factory=DistillConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    early_exit: EarlyExitConfig = Field(default_factory=EarlyExitConfig)
    heads: HeadsConfig = Field(default_factory=HeadsConfig)
    eagle3: Eagle3Config = Field(default_factory=Eagle3Config)
    calibrate: CalibrateConfig = Field(default_factory=CalibrateConfig)
    measure: MeasureConfig = Field(default_factory=MeasureConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)

    @model_validator(mode="after")
    def _resolve(self) -> Recipe:
        """Fill the defaults that depend on other blocks, so that every value a stage uses is in the
        loaded recipe (and in `polydraft show`, the manifests and the wandb config)."""
        finetune = self.finetune
        if self.pretrain.enabled and finetune.drafter != DrafterConfig():
            raise FieldError(
                "finetune.drafter is only used without pretraining; with pretrain.enabled the finetune "
                "starts from the pretrained drafter (set pretrain.drafter instead, or pretrain.enabled: false)",
                "finetune.drafter",
                "pretrain.enabled",
            )
        distilled = self.distill.temperatures
        for block in ("finetune", "early_exit", "heads", "eagle3"):
            chosen = getattr(self, block)
            never = [t for t in chosen.temperatures or () if t not in distilled]
            if chosen.enabled and never:
                raise FieldError(
                    f"{block}.temperatures {never} were never distilled, so no distilled row would be "
                    f"kept: choose among distill.temperatures {distilled}, or add them there",
                    f"{block}.temperatures",
                    "distill.temperatures",
                )
        # seed 003 App. F.3: lr 2e-5 for vicuna-68m, 3e-5 otherwise; 3 epochs after P, 5 without (F)
        arch = self.pretrain.drafter.arch if self.pretrain.enabled else finetune.drafter.arch
        optim, loop = finetune.optim, finetune.loop
        if optim.lr is None:
            optim = optim.model_copy(update={"lr": 2e-5 if arch == "vicuna-68m" else 3e-5})
        if loop.epochs is None:
            loop = loop.model_copy(update={"epochs": 3.0 if self.pretrain.enabled else 5.0})
        temperatures = list(self.distill.temperatures)  # the trainers' filter; unset: every distilled one
        finetune = finetune.model_copy(
            update={"optim": optim, "loop": loop, "temperatures": finetune.temperatures or temperatures}
        )
        early_exit = self.early_exit.model_copy(
            update={"temperatures": self.early_exit.temperatures or temperatures}
        )
        heads = self.heads.model_copy(update={"temperatures": self.heads.temperatures or temperatures})
        eagle3 = self.eagle3.model_copy(update={"temperatures": self.eagle3.temperatures or temperatures})
        # set on the frozen model once, while it is being validated (a validator must return `self`)
        object.__setattr__(self, "finetune", finetune)
        object.__setattr__(self, "early_exit", early_exit)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "eagle3", eagle3)
        return self

    @model_validator(mode="after")
    def _blocks_agree(self) -> Recipe:
        boot = self.target.bootstrap
        if boot is not None and boot.pairs is not None:
            missing = [p for p in self.data.pairs if p not in boot.pairs]
            if missing:
                raise FieldError(
                    f"data.pairs {missing} are not among target.bootstrap.pairs {boot.pairs}: the bootstrap "
                    "target would not know how to answer them; add them there",
                    "data.pairs",
                    "target.bootstrap.pairs",
                )
        for block, what in (("finetune", "drafter"), ("eagle3", "EAGLE-3 head")):
            if getattr(self, block).enabled and not self.data.pairs:
                raise FieldError(
                    f"data.pairs is empty, but {block} trains one {what} per language pair: "
                    f"list the pairs or set {block}.enabled: false",
                    "data.pairs",
                    f"{block}.enabled",
                )
        for block in ("distill", "open", "eval"):
            for index, source in enumerate(getattr(self.data, block)):
                if source.pair is not None and source.pair not in self.data.pairs:
                    raise FieldError(
                        f"data.{block}[{index}] ({source.path or source.kind}) serves pair {source.pair}, "
                        f"which is not in data.pairs {self.data.pairs}: add it there or drop the source",
                        f"data.{block}.{index}.pair",
                        "data.pairs",
                    )
        measure, calibrate = self.measure, self.calibrate
        cali_ts = measure.enabled and "cali_ts" in measure.controls and calibrate.enabled
        if cali_ts and calibrate.draft_length < measure.max_draft_length:
            raise FieldError(
                f"calibrate.draft_length {calibrate.draft_length} labels draft steps 1..{calibrate.draft_length}, "
                f"but Cali-TS may draft measure.max_draft_length = {measure.max_draft_length} tokens a round: "
                "the calibration model must be trained on every step it is asked about. Raise "
                "calibrate.draft_length or lower measure.max_draft_length",
                "calibrate.draft_length",
                "measure.max_draft_length",
            )
        eval_pairs = {source.pair for source in self.data.eval if source.pair is not None}
        if measure.enabled and measure.mixed and len(eval_pairs) < 2:
            raise FieldError(
                f"measure.mixed interleaves the eval sets of several language pairs, but data.eval has "
                f"{len(eval_pairs)} pair(s) {sorted(eval_pairs)}: add another pair's eval set or set "
                "measure.mixed: false",
                "measure.mixed",
                "data.eval",
            )
        # a raw prompt is the text itself: a translation would lose its task prefix and a conversation
        # its turns, so such sources need a chat format
        for block in ("distill", "open", "eval") if self.distill.prompt_format == "raw" else ():
            for index, source in enumerate(getattr(self.data, block)):
                if source.format in ("translation", "chat"):
                    raise FieldError(
                        f"distill.prompt_format `raw` sends a text as it is, for `text` and `prompts` "
                        f"sources only, but data.{block}[{index}] ({source.path or source.kind}) is a "
                        f"`{source.format}` source: use prompt_format vicuna or chat_template for "
                        f"translation and chat data",
                        f"data.{block}.{index}.format",
                        "distill.prompt_format",
                    )
        return self


__all__ = [
    "BootstrapConfig",
    "CalibrateConfig",
    "DataConfig",
    "DistillConfig",
    "DrafterConfig",
    "Eagle3Config",
    "EarlyExitConfig",
    "FieldError",
    "ExportConfig",
    "FinetuneConfig",
    "HeadsConfig",
    "LaunchConfig",
    "LoopConfig",
    "MemoryLoop",
    "TargetLayerLoop",
    "MeasureConfig",
    "OptimConfig",
    "PretrainConfig",
    "Recipe",
    "ResolvedTarget",
    "RunnerConfig",
    "SourceConfig",
    "StrictModel",
    "TargetConfig",
    "TrackingConfig",
]
