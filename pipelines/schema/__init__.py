"""The typed recipe: one block per stage, plus the shared target, data, launch and tracking blocks."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipelines.schema.common import (
    BootstrapConfig,
    DataConfig,
    LaunchConfig,
    SourceConfig,
    StrictModel,
    TargetConfig,
    TrackingConfig,
)
from pipelines.schema.distill import DistillConfig
from pipelines.schema.measure import ExportConfig, MeasureConfig
from pipelines.schema.train import (
    CalibrateConfig,
    DrafterConfig,
    EarlyExitConfig,
    FinetuneConfig,
    LoopConfig,
    OptimConfig,
    PretrainConfig,
)


class Recipe(StrictModel):
    """A whole run: everything a pipeline run needs, nothing else."""

    target: TargetConfig
    data: DataConfig
    distill: DistillConfig = Field(default_factory=DistillConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    early_exit: EarlyExitConfig = Field(default_factory=EarlyExitConfig)
    calibrate: CalibrateConfig = Field(default_factory=CalibrateConfig)
    measure: MeasureConfig = Field(default_factory=MeasureConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _blocks_agree(self) -> Recipe:
        if self.finetune.enabled and not self.data.pairs:
            raise ValueError(
                "data.pairs is empty, but finetune trains one drafter per language pair: "
                "list the pairs or set finetune.enabled: false"
            )
        return self


__all__ = [
    "BootstrapConfig",
    "CalibrateConfig",
    "DataConfig",
    "DistillConfig",
    "DrafterConfig",
    "EarlyExitConfig",
    "ExportConfig",
    "FinetuneConfig",
    "LaunchConfig",
    "LoopConfig",
    "MeasureConfig",
    "OptimConfig",
    "PretrainConfig",
    "Recipe",
    "SourceConfig",
    "StrictModel",
    "TargetConfig",
    "TrackingConfig",
]
