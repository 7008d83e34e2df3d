"""The stage list: the pipeline is this plain ordered list."""

from __future__ import annotations

from pipelines.runner import Stage


def default_stages() -> list[Stage]:
    """distill -> pretrain -> finetune -> early_exit -> calibrate -> measure -> export."""
    from distill.stage import run as distill
    from train.drafter import run_finetune, run_pretrain

    return [
        Stage("distill", distill, blocks=("distill",)),
        Stage("pretrain", run_pretrain, blocks=("pretrain", "launch")),
        # finetune reads the pretrain block too: its defaults depend on pretrain.enabled and the arch
        Stage("finetune", run_finetune, blocks=("pretrain", "finetune", "launch"), upstream=("distill", "pretrain")),
    ]
