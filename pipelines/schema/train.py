"""Blocks of the training stages: pretrain, finetune, early_exit, calibrate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.schema.common import StrictModel

DrafterArch = Literal["llama-68m", "vicuna-68m", "gemma-250m", "custom"]


class OptimConfig(StrictModel):
    """AdamW with a warmup + cosine schedule (seed 003 App. F.3)."""

    lr: float | None = None
    """Peak learning rate. None: the stage's own default (documented on the stage)."""
    weight_decay: float = 0.0
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_ratio: float = 0.03
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0
    """Floor of the decayed learning rate, as a fraction of the peak."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""


class LoopConfig(StrictModel):
    """The parts of an explicit training loop every trainer shares."""

    epochs: float = Field(default=3.0, gt=0)
    """Passes over the training data (fractions allowed). `max_steps` wins when set."""
    max_steps: int | None = Field(default=None, ge=1)
    per_device_batch_size: int = Field(default=2, ge=1)
    grad_accum_steps: int = Field(default=1, ge=1)
    max_length: int = Field(default=2048, ge=2)
    """Maximum sequence length in tokens (packed length for pretraining)."""
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """`auto`: bf16 on a GPU that supports it, fp32 on a CPU."""
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    """`auto`: flash attention 2 when installed on a GPU, else SDPA."""
    compile: bool = False
    """torch.compile the model (GPU)."""
    log_every: int = Field(default=10, ge=1)
    eval_every: int = Field(default=200, ge=0)
    """Steps between held-out evaluations (loss and top-1 agreement with the target); 0: only at the end."""
    eval_batches: int = Field(default=20, ge=0)
    """Held-out micro-batches (of `per_device_batch_size` rows) per process and evaluation; 0: the whole
    held-out split."""
    checkpoint_every: int = Field(default=500, ge=1)
    """Steps between checkpoints; a final one is always written."""
    keep_checkpoints: int = Field(default=2, ge=1)


class DrafterConfig(StrictModel):
    """The drafter architecture and where its weights start."""

    arch: DrafterArch = "llama-68m"
    """Named shapes: llama-68m and vicuna-68m (Llama, hidden 768, 2 layers, 12 heads, intermediate 3072);
    gemma-250m (seed 003 Table 4); custom (the fields below)."""
    init: str | None = None
    """None: random init (or the pretrain stage's output for finetune); else a local folder or hub id.
    Its vocabulary size (and tokenizer, when it ships one) must be the target's, or training stops."""
    revision: str | None = None
    """Hub revision of `init`."""
    hidden_size: int | None = None
    """custom: hidden size (also overrides a named arch when set)."""
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None

    @model_validator(mode="after")
    def _custom_complete(self) -> DrafterConfig:
        if self.arch == "custom" and None in (
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            self.intermediate_size,
        ):
            raise ValueError("arch `custom` needs hidden_size, num_layers, num_heads and intermediate_size")
        return self


class PretrainConfig(StrictModel):
    """P: causal LM training of the drafter on generic corpora (data.pretrain)."""

    enabled: bool = True
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    token_budget: int = 1_000_000_000
    """Tokens of packed generic text to train on (the loop stops when it is spent, or earlier after
    `loop.epochs` passes over corpora that are not streamed)."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=3e-4, weight_decay=0.01))
    """Seed 003 gives no pretraining hyper-parameters; these are the usual ones for small LMs."""
    loop: LoopConfig = Field(default_factory=lambda: LoopConfig(epochs=1.0, per_device_batch_size=8))
    """`max_length` is the packed sequence length."""


class FinetuneConfig(StrictModel):
    """F: the drafter trained on the distilled records of each language pair (seed 003 App. F.3)."""

    enabled: bool = True
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    """Used as is when pretrain is disabled (the seed's F-only baseline); else the pretrained drafter."""
    temperatures: list[float] | None = None
    """Keep only records distilled at these temperatures; None keeps all."""
    loss: Literal["ce", "kd"] = "ce"
    """`ce`: hard-label cross-entropy on the assistant tokens; `kd`: that cross-entropy plus `kd_weight`
    times the forward KL from the target's distribution (the target is loaded beside the drafter)."""
    kd_top_k: int = 64
    """`kd` compares the two distributions on the target's k most likely tokens plus one bucket for all
    the others (a true KL of (k+1)-way distributions, far cheaper than the full vocabulary)."""
    kd_weight: float = 1.0
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """lr None: 2e-5 for vicuna-68m, 3e-5 otherwise (seed 003 App. F.3)."""
    loop: LoopConfig = Field(default_factory=LoopConfig)
    """Seed 003 App. F.3: batch 2 per device on 4 devices, max length 2048, 3 epochs after pretraining.
    When pretrain is disabled and `epochs` is not set in the recipe, 5 epochs (the seed's F baseline)."""

    @model_validator(mode="after")
    def _kd_options(self) -> FinetuneConfig:
        if self.kd_top_k < 1:
            raise ValueError("kd_top_k must be at least 1")
        return self


class EarlyExitConfig(StrictModel):
    """EESD: a trainable exit layer + norm + head on the target's frozen first N layers (seed 001)."""

    enabled: bool = True
    num_shared_layers: int = 3
    """N: frozen first layers of the target (seed: 3 for 13B, 5 for 70B, 5%-10% of the layers)."""
    num_exit_layers: int = 1
    """Trainable transformer layers after the first N; 0 trains the head only (Table 4 ablation)."""
    loss: Literal["ce", "ce+kl"] = "ce"
    kl_weight: float = 1.0
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    loop: LoopConfig = Field(default_factory=lambda: LoopConfig(epochs=4.0, per_device_batch_size=8))
    """Table 9: lr 1e-3, batch 64 (8 x 8 GPUs or accumulation), sequence 2k/4k, 4-6 epochs."""


class CalibrateConfig(StrictModel):
    """The calibration model of seed 001 eq. 5, predicting draft acceptance for Cali-TS."""

    enabled: bool = True
    drafters: Literal["early_exit", "all"] = "early_exit"
    """Which drafters get a calibration model: the early-exit head only, or every trained drafter too."""
    draft_length: int = 10
    """K tokens drafted from each sampled position to build labels (W^i capped at 10)."""
    num_positions: int = 2000
    """Positions sampled from the training data to build labels."""
    heldout_fraction: float = 0.1
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    loop: LoopConfig = Field(default_factory=lambda: LoopConfig(epochs=3.0, per_device_batch_size=64))
