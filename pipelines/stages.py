"""The stage list: the pipeline is this plain ordered list."""

from __future__ import annotations

from pipelines.runner import Stage


def default_stages() -> list[Stage]:
    """distill -> pretrain -> finetune -> early_exit -> calibrate -> measure -> export."""
    return []
