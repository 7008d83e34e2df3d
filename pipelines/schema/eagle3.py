"""Block of the `eagle3` stage: per-language EAGLE-3 heads on the target's features."""

from __future__ import annotations

from pydantic import Field, model_validator

from polydraft.pipelines.schema.common import FieldError, StrictModel, Temperature, UniqueList
from polydraft.pipelines.schema.train import MemoryLoop, MixRows, OptimConfig


class Eagle3Optim(OptimConfig):
    """SpecForge's EAGLE-3 examples (Llama 3.1 8B, Qwen3 8B): lr 1e-4, cosine schedule."""

    lr: float = Field(default=1e-4, gt=0)


class Eagle3Loop(MemoryLoop, MixRows):
    """SpecForge's EAGLE-3 examples: 4 rows per GPU, sequences of 2,048 tokens, 6 epochs (Qwen3 8B)."""

    epochs: float = Field(default=6.0, gt=0)
    per_device_batch_size: int = Field(default=4, ge=1)


class Eagle3Config(StrictModel):
    """EAGLE-3 heads (arXiv 2503.01840): the target's states at three layers, fused by a linear layer, feed
    one decoder layer whose other input is the next token's embedding; a norm and an lm head over a
    draft vocabulary of the pair's own most frequent answer tokens. One head per language pair of
    `data.pairs`, trained on that pair's mix by training-time test with the frozen target computing its
    features on the fly (nothing stored). Output per pair: `<pair>/`, a speculators-format folder that
    vLLM's `eagle3` method loads (`config.json`, `model.safetensors` with `d2t` / `t2d`) plus polydraft's
    `eagle3.json` (pair, draft vocabulary and its coverage, training metrics).

    Off by default: it loads the whole target in every training process and runs it over the pair's mix
    each epoch (`polydraft plan` counts both).
    """

    enabled: bool = False
    multilingual: bool = False
    """Also train one head on the union of every pair's mix, balanced by pair as `finetune.multilingual`'s
    union is, into `multilingual/`: its draft vocabulary is chosen from every pair's answers, each pair's
    token frequencies weighted equally."""
    aux_layers: UniqueList[int] | None = Field(default=None, min_length=1)
    """The target layers whose input states the head reads (vLLM's `eagle_aux_hidden_state_layer_ids`: id
    i is the stream entering layer i). Unset: vLLM's and the reference's default (2, L // 2, L - 3) for a
    target of L layers. Strictly increasing: vLLM concatenates them in sorted order."""
    draft_vocab_size: int = Field(default=32000, ge=1)
    """Tokens the head predicts over (the reference's 32k for Llama 3's 128k vocabulary); the target's
    whole vocabulary when it is smaller. Always holds the special and byte tokens."""
    intermediate_size: int | None = Field(default=None, ge=1)
    """The decoder layer's MLP width. Unset: the target's."""
    ttt_steps: int = Field(default=3, ge=1)
    """Draft steps unrolled in training (training-time test; the reference uses 7)."""
    step_decay: float = Field(default=0.8, gt=0)
    """Step j's loss weight is step_decay ** j (the reference's 0.8)."""
    temperatures: UniqueList[Temperature] | None = Field(default=None, min_length=1)
    """Keep only distilled rows of these temperatures. Unset: every `distill.temperatures` value, filled in
    when the recipe is loaded."""
    open_rows: bool = False
    """Also train on the mix's open-source rows (`data.open`). Off: the target's own answers only, as the
    reference trains EAGLE-3 on answers the target regenerated: at inference the head drafts after the
    target's text, and a full target forward per row is this stage's cost."""
    feature_cache_gib: float = Field(default=0.0, ge=0)
    """Keep the frozen target's outputs of each training and held-out row in CPU memory, up to this many GiB
    per process, so that a later head on the same rows (the multilingual head reads every pair's) does not
    run the target on them again. A row costs its length x (len(aux_layers) + 1) x hidden size values (the
    values in the target's dtype). 0: off, the target runs on every batch of every head."""
    optim: Eagle3Optim = Field(default_factory=Eagle3Optim)
    loop: Eagle3Loop = Field(default_factory=Eagle3Loop)

    @model_validator(mode="after")
    def _sorted_layers(self) -> Eagle3Config:
        layers = self.aux_layers
        if layers is not None and (layers != sorted(layers) or layers[0] < 0):
            raise FieldError(
                f"feature layers {layers} must be non-negative and increasing: vLLM concatenates the "
                "states in sorted order, so another order would serve a head another input",
                "aux_layers",
            )
        return self
