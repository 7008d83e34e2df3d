"""The measure and export blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.schema.common import StrictModel

Decoder = Literal["ar", "sd", "rsd_c", "rsd_s", "eesd", "assisted"]


class MeasureConfig(StrictModel):
    """Speculative decoders x eval sets x temperatures x seeds for every drafter of the run."""

    enabled: bool = True
    decoders: list[Decoder] = Field(
        default_factory=lambda: ["ar", "sd", "rsd_c", "rsd_s", "eesd", "assisted"]
    )
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    num_prompts: int = 50
    max_new_tokens: int = 128
    draft_length: int = 4
    """K for `sd` with fixed control."""
    control: Literal["fixed", "beta_ts", "cali_ts"] = "fixed"
    branching: list[int] = Field(default_factory=lambda: [2, 2, 1])
    """RSD-C branching factors b (depth = len(b))."""
    beam_width: int = 3
    beam_depth: int = 3
    """RSD-S beamwidth W and depth L."""


class ExportConfig(StrictModel):
    """Hugging Face folders with model cards carrying the measured speedups."""

    enabled: bool = True
    license: str = "apache-2.0"
    repo_prefix: str | None = None
    """Default `ORG/` prefix for `polydraft publish`."""
