"""The stage list: the pipeline is this plain ordered list."""

from __future__ import annotations

from pipelines.runner import Stage


def default_stages() -> list[Stage]:
    """distill -> pretrain -> finetune -> early_exit -> calibrate -> measure -> export."""
    from decoding.measure import run as measure
    from distill.stage import run as distill
    from pipelines.export import run as export
    from train.calibrate import run as calibrate
    from train.drafter import run_finetune, run_pretrain
    from train.early_exit import run as early_exit

    return [
        Stage("distill", distill, blocks=("distill",)),
        Stage("pretrain", run_pretrain, blocks=("pretrain", "launch")),
        # finetune reads the pretrain block too: its defaults depend on pretrain.enabled and the arch
        Stage(
            "finetune",
            run_finetune,
            blocks=("pretrain", "finetune", "launch"),
            upstream=("distill", "pretrain"),
        ),
        Stage("early_exit", early_exit, blocks=("early_exit", "launch"), upstream=("distill",)),
        Stage(
            "calibrate",
            calibrate,
            blocks=("calibrate", "launch"),
            upstream=("distill", "early_exit", "finetune"),
        ),
        # measure and export read the distill block: eval prompts are built in its prompt format
        Stage(
            "measure",
            measure,
            blocks=("measure", "distill"),
            upstream=("pretrain", "finetune", "early_exit", "calibrate"),
        ),
        Stage(
            "export",
            export,
            blocks=("export", "distill", "measure"),
            upstream=("pretrain", "finetune", "early_exit", "calibrate", "measure"),
        ),
    ]
