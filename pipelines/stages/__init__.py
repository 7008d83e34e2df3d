"""The stages' entry points, one module each, and the pipeline: this plain ordered list.

Each module's `run(inputs, ctx)` receives the stage's frozen inputs object (`pipelines.schema.inputs`)
and is the only code that sees it: the engines below (`distill/`, `train/`, `decoding/`, `models/`) take
plain arguments. Training stages also hold the `main()` that `accelerate launch` starts on every process.
"""

from __future__ import annotations

from polydraft.pipelines.runtime.contract import Stage
from polydraft.pipelines.schema.inputs import (
    CalibrateInputs,
    DistillInputs,
    Eagle3Inputs,
    EarlyExitInputs,
    ExportInputs,
    FinetuneInputs,
    HeadsInputs,
    MeasureInputs,
    PretrainInputs,
)


def default_stages() -> list[Stage]:
    """distill -> pretrain -> finetune -> heads -> eagle3 -> early_exit -> calibrate -> measure -> export.

    Any order in which every stage follows its upstream ones would do; in this one the stages that read the
    whole target (heads, eagle3) come before early_exit, so that with `runner.parallel_stages` 2 the longest
    of them starts beside pretrain, and the chain pretrain -> finetune -> early_exit -> calibrate runs beside
    it (bench/results/parallel_stages.md)."""
    from polydraft.pipelines.stages import (
        calibrate,
        distill,
        eagle3,
        early_exit,
        export,
        finetune,
        heads,
        measure,
        pretrain,
    )

    return [
        Stage("distill", distill.run, DistillInputs.of),
        Stage("pretrain", pretrain.run, PretrainInputs.of, side_by_side=True),
        Stage(
            "finetune", finetune.run, FinetuneInputs.of, upstream=("distill", "pretrain"), side_by_side=True
        ),
        Stage("heads", heads.run, HeadsInputs.of, upstream=("distill",), side_by_side=True),
        Stage("eagle3", eagle3.run, Eagle3Inputs.of, upstream=("distill",), side_by_side=True),
        Stage("early_exit", early_exit.run, EarlyExitInputs.of, upstream=("distill",), side_by_side=True),
        Stage(
            "calibrate",
            calibrate.run,
            CalibrateInputs.of,
            upstream=("distill", "early_exit", "finetune"),
            side_by_side=True,
        ),
        Stage(
            "measure",
            measure.run,
            MeasureInputs.of,
            upstream=("pretrain", "finetune", "early_exit", "heads", "eagle3", "calibrate"),
        ),
        Stage(
            "export",
            export.run,
            ExportInputs.of,
            upstream=("pretrain", "finetune", "early_exit", "heads", "eagle3", "calibrate", "measure"),
        ),
    ]
