"""The measure and export blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.schema.common import StrictModel

Decoder = Literal["ar", "sd", "rsd_c", "rsd_s", "eesd", "assisted"]
Control = Literal["fixed", "beta_ts", "cali_ts"]


class MeasureConfig(StrictModel):
    """Speculative decoders x eval sets x temperatures x seeds for every drafter of the run."""

    enabled: bool = True
    decoders: list[Decoder] = Field(
        default_factory=lambda: ["ar", "sd", "rsd_c", "rsd_s", "eesd", "assisted"]
    )
    """`ar` (the baseline every speedup is measured against, always included), `sd` (chain), `rsd_c`
    and `rsd_s` (draft trees), `eesd` (the early-exit head; needs the early_exit stage) and `assisted`
    (transformers' assisted generation, a reference row)."""
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    """0 is greedy; every decoder's output is then checked against `ar`'s (`matches_ar` in results)."""
    top_p: float = 1.0
    """Nucleus filtering applied identically to drafter and target when sampling."""
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    """One measurement per seed (sampling and Thompson-sampling draws); tables show mean +- std."""
    num_prompts: int = 50
    """Prompts per eval set (the first ones after shuffling with `data.seed`)."""
    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024
    """Longer prompts are skipped (and counted in the log)."""
    draft_length: int = 4
    """K for `sd` and `eesd` with fixed control, and the number of assistant tokens of `assisted`."""
    controls: list[Control] = Field(default_factory=lambda: ["fixed"])
    """Draft-length controls measured for `sd` and `eesd`: fixed K, Beta-TS (seed 001 Alg. 2), Cali-TS
    (Alg. 3; only for drafters the calibrate stage made a calibration model for)."""
    k_sweep: list[int] = Field(default_factory=list)
    """Extra fixed draft lengths for `sd` and `eesd`, for the speedup-vs-K plot (e.g. [1, 2, 6, 8])."""
    max_draft_length: int = 10
    """Cap on the drafts per round under Beta-TS and Cali-TS."""
    beta_prior: list[float] = Field(default_factory=lambda: [1.0, 1.0])
    """Beta-TS prior (alpha_0, beta_0)."""
    cali_sigma_m: float = 0.2
    """Cali-TS sigma_M: the calibration model's assumed prediction error."""
    cali_sigma_s: float = 0.3
    """Cali-TS sigma_S: the standard deviation of a round's mean chi."""
    cali_theta0: float = 0.5
    """Cali-TS theta_hat_0: the prior observed acceptance."""
    branching: list[int] = Field(default_factory=lambda: [2, 2, 1])
    """RSD-C branching factors b (depth = len(b))."""
    beam_width: int = 3
    beam_depth: int = 3
    """RSD-S beamwidth W and depth L."""
    assisted_confidence_threshold: float = 0.0
    """Confidence threshold of `assisted` (0: K tokens every round, like `sd`; transformers' default 0.4)."""
    cross_pairs: bool = True
    """Measure each language-specific drafter on the other pairs' eval sets too (out of domain)."""
    include_pretrained: bool = True
    """Also measure the pretrain stage's generic drafter, when that stage ran."""
    extra_drafters: dict[str, str] = Field(default_factory=dict)
    """Name -> Hugging Face folder or hub id of other drafters to measure (e.g. a published one)."""
    profile: bool = True
    """Attribute time to forward passes (the overhead share); on a GPU this synchronises after each."""

    @model_validator(mode="after")
    def _check(self) -> MeasureConfig:
        if "ar" not in self.decoders:
            raise ValueError("measure.decoders must include `ar`: every speedup is measured against it")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError("measure.temperatures: at least one, all >= 0")
        if not self.seeds:
            raise ValueError("measure.seeds: at least one seed")
        if not 0 < self.top_p <= 1:
            raise ValueError("measure.top_p must be in (0, 1]")
        if min([self.draft_length, self.max_draft_length, *self.k_sweep]) < 1:
            raise ValueError("measure: draft lengths must be >= 1")
        if not self.controls:
            raise ValueError("measure.controls: at least one control")
        if len(self.beta_prior) != 2 or min(self.beta_prior) <= 0:
            raise ValueError("measure.beta_prior: two positive numbers (alpha_0, beta_0)")
        if min(self.cali_sigma_m, self.cali_sigma_s) <= 0:
            raise ValueError("measure.cali_sigma_m and cali_sigma_s must be > 0")
        if not self.branching or min(self.branching) < 1 or min(self.beam_width, self.beam_depth) < 1:
            raise ValueError("measure: branching factors, beam width and depth must be >= 1")
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("measure.num_prompts and max_new_tokens must be >= 1")
        return self


class ExportConfig(StrictModel):
    """Hugging Face folders with model cards carrying the measured speedups, smoke-checked before publishing.

    One folder per trained drafter (`finetune/<pair>/`, and `pretrain/model/` as `pretrain`) and one for
    the early-exit head, each with a `README.md` card and a machine-readable `results.json`.
    """

    enabled: bool = True
    license: str = "apache-2.0"
    """License id written into the cards' metadata (a Hub license id; the target's own license may bind)."""
    base_model: str | None = None
    """Hub id of the target named in the cards (`base_model`) and in the usage snippets. None: `target.path`
    when it is a hub id; a local target folder is then described as local and never written into a card."""
    repo_prefix: str | None = None
    """Default `ORG/` (or `ORG/prefix-`) for `polydraft publish` when it gets neither --repo-id nor
    --repo-prefix; each exported folder becomes the repo `<repo_prefix><target>-drafter-<name>`."""
    include_pretrained: bool = True
    """Also export the pretrain stage's generic drafter (`pretrain`), when that stage ran."""
    smoke_prompts: int = Field(default=3, ge=1)
    """Prompts of the smoke check (taken from `data.eval`, the drafter's own pair first): each is decoded
    greedily by the target alone and with the exported drafter as `assistant_model`; outputs must match."""
    smoke_max_new_tokens: int = Field(default=32, ge=1)
    """New tokens per smoke prompt."""
    vllm_check: Literal["auto", "require", "off"] = "auto"
    """One real vLLM generation with the exported drafter as draft model (`method: draft_model`), in a
    subprocess. `auto`: when vllm is installed and a GPU is present, else recorded as skipped; `require`:
    a missing vllm or GPU fails that check; `off`: never run. The static checks of vLLM's draft-model rules
    (same vocabulary, supported architecture, context length) always run."""
    strict: bool = False
    """Fail the stage when a smoke check fails. Otherwise the failure is recorded in the manifest and the
    card, and `polydraft publish` refuses that folder unless --force."""
