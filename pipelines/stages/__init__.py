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
    """distill -> pretrain -> finetune -> early_exit -> heads -> eagle3 -> calibrate -> measure -> export."""
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
        Stage("pretrain", pretrain.run, PretrainInputs.of),
        Stage("finetune", finetune.run, FinetuneInputs.of, upstream=("distill", "pretrain")),
        Stage("early_exit", early_exit.run, EarlyExitInputs.of, upstream=("distill",)),
        Stage("heads", heads.run, HeadsInputs.of, upstream=("distill",)),
        Stage("eagle3", eagle3.run, Eagle3Inputs.of, upstream=("distill",)),
        Stage(
            "calibrate",
            calibrate.run,
            CalibrateInputs.of,
            upstream=("distill", "early_exit", "finetune"),
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
