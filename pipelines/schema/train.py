"""Blocks of the training stages: pretrain, finetune, early_exit, calibrate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polydraft.pipelines.schema.common import FieldError, StrictModel, Temperature, UniqueList

DrafterArch = Literal["llama-68m", "vicuna-68m", "gemma-250m", "custom"]


class OptimConfig(StrictModel):
    """AdamW with a warmup + cosine schedule (seed 003 App. F.3). Each stage's block is a subclass that
    sets its own defaults, so a recipe that sets one field keeps the stage's defaults for the others."""

    lr: float = Field(default=3e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = Field(default=1e-8, gt=0)
    warmup_ratio: float = Field(default=0.03, ge=0, le=1)
    """Share of the optimizer steps spent warming the learning rate up from 0."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the decayed learning rate, as a fraction of the peak."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Gradient clipping by global norm; 0 disables it."""

    @model_validator(mode="after")
    def _betas(self) -> OptimConfig:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise FieldError(f"two values in [0, 1) (beta1, beta2), got {self.betas}", "betas")
        return self


class PretrainOptim(OptimConfig):
    """Seed 003 gives no pretraining hyper-parameters; these are the usual ones for small LMs."""

    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)


class FinetuneOptim(OptimConfig):
    """Seed 003 App. F.3."""

    lr: float | None = Field(default=None, gt=0)
    """Unset: 2e-5 for a vicuna-68m drafter, 3e-5 otherwise (seed 003 App. F.3), filled in when the
    recipe is loaded (`polydraft show` prints the value used)."""


class EarlyExitOptim(OptimConfig):
    """Table 9 / App. C of seed 001."""

    lr: float = Field(default=1e-3, gt=0)


class CalibrateOptim(OptimConfig):
    lr: float = Field(default=1e-3, gt=0)
    warmup_ratio: float = Field(default=0.0, ge=0, le=1)


class LoopConfig(StrictModel):
    """The parts of an explicit training loop every trainer shares. Each stage's block is a subclass
    that sets its own defaults (documented on the stage)."""

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


class MemoryLoop(LoopConfig):
    """A loop whose loss goes through an output head over the whole vocabulary."""

    loss_chunk_tokens: int | None = Field(default=256, ge=1)
    """Compute the loss (cross-entropy, and the KL term where there is one) this many loss-carrying
    positions at a time, each chunk recomputed in backward (`train.chunked_loss`), so that the
    [tokens x vocabulary] logits never exist at once: same loss and gradients (to fp32 rounding), one
    more head matmul per chunk. 256 rows of a 256k vocabulary are 0.25 GiB of fp32 logits: the loss
    of 4,096 tokens peaks about 10x lower than with the full logits (bench/results/loss_memory.md;
    1,024 rows: 3.5x). null: the full logits, as before. Under FSDP or DeepSpeed ZeRO-3 the full
    logits are always used (the head's weight is sharded outside the forward)."""


class TargetLayerLoop(MemoryLoop):
    """A loop that trains layers of the target's class."""

    gradient_checkpointing: bool = False
    """Recompute the trained decoder layers' activations in backward instead of keeping them (less
    memory, about one more forward of those layers per step); same loss and gradients."""


class MixRows(StrictModel):
    """A loop over the rows of the distill stage's mix (finetune, early_exit, heads, eagle3), whose lengths
    vary."""

    group_by_length: bool = False
    """Each optimizer step takes rows of similar length (`train.data.length_grouped`: windows of 64 global
    batches of the shuffled epoch sorted by length, their batches shuffled again), so a micro-batch pads
    less; every epoch still sees every row once, and a resumed run the same batches."""


class PretrainLoop(TargetLayerLoop):
    """One pass; `max_length` is the packed sequence length."""

    epochs: float = Field(default=1.0, gt=0)
    per_device_batch_size: int = Field(default=8, ge=1)


class FinetuneLoop(TargetLayerLoop, MixRows):
    """Seed 003 App. F.3: batch 2 per device on 4 devices, max length 2048."""

    epochs: float | None = Field(default=None, gt=0)
    """Unset: 3 epochs after pretraining, 5 without (the seed's F baseline), filled in when the recipe is
    loaded."""


class EarlyExitLoop(TargetLayerLoop, MixRows):
    """Table 9: batch 64 (per device x processes x accumulation), sequence 2k (13B) / 4k (70B) / 16k
    (CodeLlama), 4 epochs (13B) or 6 (70B)."""

    epochs: float = Field(default=4.0, gt=0)
    per_device_batch_size: int = Field(default=8, ge=1)
    grad_accum_steps: int = Field(default=8, ge=1)


class CalibrateLoop(LoopConfig):
    """`per_device_batch_size` counts labelled draft steps; `max_length` caps the prefix + drafts; `seed`
    also seeds the position sampling."""

    per_device_batch_size: int = Field(default=64, ge=1)
    checkpoint_every: int = Field(default=200, ge=1)


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
    hidden_size: int | None = Field(default=None, ge=1)
    """custom: hidden size (also overrides a named arch when set)."""
    num_layers: int | None = Field(default=None, ge=1)
    num_heads: int | None = Field(default=None, ge=1)
    num_kv_heads: int | None = Field(default=None, ge=1)
    intermediate_size: int | None = Field(default=None, ge=1)

    def shape(self) -> dict[str, int | None]:
        """The shape fields, which replace the named architecture's when set."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }

    @model_validator(mode="after")
    def _custom_complete(self) -> DrafterConfig:
        if self.arch == "custom" and None in (
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            self.intermediate_size,
        ):
            raise FieldError(
                "arch `custom` needs hidden_size, num_layers, num_heads and intermediate_size", "arch"
            )
        if self.hidden_size and self.num_heads and self.hidden_size % self.num_heads:
            raise FieldError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}",
                "hidden_size",
            )
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise FieldError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}",
                "num_kv_heads",
            )
        return self


class PretrainConfig(StrictModel):
    """P: causal LM training of the drafter on generic corpora (data.pretrain)."""

    enabled: bool = True
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    token_budget: int = Field(default=1_000_000_000, ge=1)
    """Tokens of packed generic text to train on (the loop stops when it is spent, or earlier after
    `loop.epochs` passes over corpora that are not streamed)."""
    optim: PretrainOptim = Field(default_factory=PretrainOptim)
    loop: PretrainLoop = Field(default_factory=PretrainLoop)
    data_workers: int = Field(default=1, ge=0)
    """DataLoader worker processes per training process that read and tokenize the corpora ahead of the
    training loop (`train/stream.py`); 0 does it in the training process, between steps. Every worker of
    every process reads a disjoint share of the rows (of a streaming `hf` source, its share of the files);
    a resume needs the same number of processes and workers."""


class FinetuneConfig(StrictModel):
    """F: the drafter trained on the distilled records of each language pair (seed 003 App. F.3)."""

    enabled: bool = True
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    """Used as is when pretrain is disabled (the seed's F-only baseline); else the pretrained drafter."""
    temperatures: UniqueList[Temperature] | None = Field(default=None, min_length=1)
    """Keep only records distilled at these temperatures. Unset: every `distill.temperatures` value,
    filled in when the recipe is loaded."""
    loss: Literal["ce", "kd"] = "ce"
    """`ce`: hard-label cross-entropy on the assistant tokens; `kd`: that cross-entropy plus `kd_weight`
    times the forward KL from the target's distribution (the target is loaded beside the drafter)."""
    kd_top_k: int = Field(default=64, ge=1)
    """`kd` compares the two distributions on the target's k most likely tokens plus one bucket for all
    the others (a true KL of (k+1)-way distributions, far cheaper than the full vocabulary)."""
    kd_weight: float = Field(default=1.0, ge=0)
    multilingual: bool = False
    """Also train one drafter on the union of every pair's mix, from the same starting drafter, into
    `finetune/multilingual/` beside the per-pair ones (the alternative to routing each request to its
    language's drafter). The union is balanced by pair: every pair gives as many rows per epoch as the
    largest pair has (a smaller pair's rows repeat, in a seeded order), so no pair outweighs another; the
    counts are recorded in the stage's metrics. Same loop settings as the per-pair drafters."""
    optim: FinetuneOptim = Field(default_factory=FinetuneOptim)
    loop: FinetuneLoop = Field(default_factory=FinetuneLoop)


class EarlyExitConfig(StrictModel):
    """EESD: a trainable exit layer + norm + head on the target's frozen first N layers (seed 001).

    Only the embeddings, the first N layers, the last `num_exit_layers` layers, the final norm and the lm
    head are read from the target's checkpoint (unless `loss` is `ce+kl`). Output: `head/` with
    `early_exit.safetensors` and `early_exit.json`.
    """

    enabled: bool = True
    num_shared_layers: int = Field(default=3, ge=1)
    """N: frozen first layers of the target (seed: 3 for 13B, 5 for 70B, 5%-10% of the layers)."""
    num_exit_layers: int = Field(default=1, ge=0)
    """Trainable transformer layers after the first N, initialised from the target's last layers; 0 trains
    the norm and head only (Table 4 ablation "w/o Early-exiting Layer")."""
    loss: Literal["ce", "ce+kl"] = "ce"
    """`ce`: cross-entropy to the next token of the mixed data (seed 001 §3.2); `ce+kl`: plus `kl_weight`
    times the forward KL to the full target's top-`kl_top_k` distribution. `ce+kl` loads the whole target
    (its first N layers are then shared with the drafter, not loaded twice)."""
    kl_weight: float = Field(default=1.0, ge=0)
    kl_top_k: int = Field(default=64, ge=1)
    """Target tokens kept per position for the KL term (renormalised; the rest is dropped)."""
    loss_on: Literal["response", "all"] = "response"
    """Which tokens of a mix row carry loss. `response`: the answer only (what the drafter will draft;
    plain-text rows with an empty prompt, like SlimPajama, are trained whole either way); `all`: the
    prompt too, as seed 001 trains on whole ShareGPT sequences (the prompt's fixed system text then
    weighs in the loss and the top-1 agreement)."""
    temperatures: UniqueList[Temperature] | None = Field(default=None, min_length=1)
    """Keep only distilled rows of these temperatures (open-source rows always stay). Unset: every
    `distill.temperatures` value, filled in when the recipe is loaded."""
    optim: EarlyExitOptim = Field(default_factory=EarlyExitOptim)
    loop: EarlyExitLoop = Field(default_factory=EarlyExitLoop)
    """The held-out top-1 agreement is against the full target's greedy tokens, computed once by
    streaming the target layer by layer (`eval_reference.pt`)."""


class CalibrateConfig(StrictModel):
    """The calibration model of seed 001 eq. 5, predicting draft acceptance for Cali-TS.

    Labels: from positions sampled in the distill mix, the drafter drafts `draft_length` tokens greedily;
    one target forward over prefix + drafts gives the target's greedy token at each of them; chi_i = 1
    while they agree. Output per drafter: `<name>/` with the model, `calibration.json` and `report.json`.
    The stage runs as one process whatever `launch` says: the whole target is loaded and spread over the
    visible GPUs (a 70B target fits no single one).
    """

    enabled: bool = True
    drafters: Literal["early_exit", "all"] = "early_exit"
    """Which drafters get a calibration model: the early-exit head only, or also every finetuned drafter
    (`finetune/<pair>/`, using that drafter's own last hidden state and its pair's rows)."""
    draft_length: int = Field(default=10, ge=1)
    """K tokens drafted from each sampled position to build labels."""
    max_steps: int = Field(default=10, ge=1)
    """Number of step matrices W^i; later steps use the last one (seed: i = min(i, 10))."""
    num_positions: int = Field(default=2000, ge=1)
    """Positions sampled to build training labels (each gives `draft_length` labelled steps)."""
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Extra positions, as a fraction of `num_positions`, sampled from the mix's held-out `eval` split to
    report accuracy, Brier score, calibration error and the base rate."""
    optim: CalibrateOptim = Field(default_factory=CalibrateOptim)
    loop: CalibrateLoop = Field(default_factory=CalibrateLoop)


class HeadsOptim(OptimConfig):
    """Medusa-1's training command (FasterDecoding/Medusa README): lr 1e-3, no weight decay, warmup ratio
    0.1, cosine schedule."""

    lr: float = Field(default=1e-3, gt=0)
    warmup_ratio: float = Field(default=0.1, ge=0, le=1)


class HeadsLoop(MemoryLoop, MixRows):
    """Medusa-1: 2 epochs, 8 rows per device with 4 accumulation steps (128 rows a step on 4 GPUs)."""

    epochs: float = Field(default=2.0, gt=0)
    per_device_batch_size: int = Field(default=8, ge=1)
    grad_accum_steps: int = Field(default=4, ge=1)


class HeadsConfig(StrictModel):
    """Blockwise proposal heads on the frozen target's last hidden state (seed 000): Medusa-1 heads (a
    residual SiLU block and an lm head initialised from the target's, each) or BPD heads (residual blocks
    on the target's own lm head, shared and frozen). Head i at position t learns token t+2+i, on the
    response tokens of the distill stage's mix. Output: `heads/` (`heads.safetensors`, `heads.json`, and
    vLLM's medusa `config.json`, so that the same folder is a vLLM `medusa` draft).

    Off by default: a recipe that measures `bpd` / `medusa` (and their `+rescore` variants) enables it.
    """

    enabled: bool = False
    kind: Literal["medusa", "bpd"] = "medusa"
    num_heads: int = Field(default=5, ge=1)
    """Medusa-1: 5 heads."""
    num_layers: int = Field(default=1, ge=1)
    """Residual SiLU layers per head (Medusa-1: 1)."""
    loss_decay: float = Field(default=0.8, gt=0)
    """Head i's loss weight is loss_decay**i (Medusa-1: 0.8^i)."""
    temperatures: UniqueList[Temperature] | None = Field(default=None, min_length=1)
    """Keep only distilled rows of these temperatures (open-source rows always stay). Unset: every
    `distill.temperatures` value, filled in when the recipe is loaded."""
    optim: HeadsOptim = Field(default_factory=HeadsOptim)
    loop: HeadsLoop = Field(default_factory=HeadsLoop)
