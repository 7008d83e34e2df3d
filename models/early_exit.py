"""The early-exit drafter of seed 001 (EESD, §3.1, eq. 1), built from the target's own modules.

    p(y_t) = softmax(W^T RMSNorm(Transformer^e(H_t^N)))

`H_t^N` comes from the target's embeddings and first N decoder layers (frozen, shared with the target at
decoding time); `Transformer^e` is `num_exit_layers` trainable decoder layers of the target's own class,
then the final norm and the lm head, all three initialised from the target (the exit layer(s) from its
LAST layer(s), the norm from its final norm, the head from its lm head). `num_exit_layers=0` is the
head-only ablation of Table 4 (norm + head on H^N).

Attributes (the decoding engine and the trainers use them directly):
- `config`: the target's config (the one its modules read, e.g. `_attn_implementation`)
- `embed_tokens`, `rotary_emb`: the target's embeddings and rotary position embedding
- `shared_layers`: the first N decoder layers (`num_shared_layers`); after `attach_exit_head` these ARE
  the target's modules, and they write the target's KV cache slots 0..N-1
- `exit`: an `ExitHead` holding `layers` (also `exit_layers`), `norm` and `lm_head` (the trainable part)
- `exit_cache_slots`: the KV-cache layer index of each exit layer, `num_hidden_layers + j`. An exit layer
  is a copy of the target's last layer, whose attention `layer_idx` would otherwise collide with the
  target's last layer in a shared cache; `new_cache()` returns a cache with room for these extra slots.
- `layer_types`: the attention type (`full_attention` / `sliding_attention`) of each target layer

Self-speculative decoding on one cache: draft by running `forward_shared` (slots 0..N-1) then
`exit(...)` (slots `exit_cache_slots`); verify by continuing the same layer-N hidden states through the
target's `layers[N:]` (slots N..L-1) with `models.decoder_layers.run_layers`, the target's norm and
lm head.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polydraft.models.decoder_layers import (
    RotaryEmbeddings,
    attention_masks,
    checkpoint_layers,
    rotary_embeddings,
    run_layers,
    target_layer_types,
)
from polydraft.models.partial_load import (
    DecoderParts,
    decoder_parts,
    materialise,
    meta_causal_lm,
    open_checkpoint,
)
from polydraft.models.placement import execution_device

WEIGHTS_FILE = "early_exit.safetensors"
CONFIG_FILE = "early_exit.json"
FORMAT = "polydraft-early-exit/1"


class ExitHead(nn.Module):
    """The trainable part: exit layers, final norm, lm head. Input: layer-N hidden states."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, lm_head: nn.Module, layer_types: list[str]):
        super().__init__()
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.layer_types = layer_types

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: RotaryEmbeddings,
        attention_mask: torch.Tensor | dict[str, torch.Tensor | None] | None = None,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        project: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits, hidden) of the last `logits_to_keep` positions (0: all): `hidden` is the final-norm
        output, the input of the lm head. `project=False` skips the lm head (logits None): a trainer
        that computes the loss chunk by chunk (`train.chunked_loss`) projects the rows itself."""
        hidden = run_layers(
            self.layers, hidden, position_embeddings, attention_mask, cache, position_ids, self.layer_types
        )
        hidden = self.norm(hidden[:, -logits_to_keep:])
        return (self.lm_head(hidden) if project else None), hidden

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each exit layer's activations in backward instead of keeping them (training only)."""
        checkpoint_layers(self.layers)


@dataclass
class SharedState:
    """Layer-N hidden states and the position information the layers after them need."""

    hidden: torch.Tensor
    position_ids: torch.Tensor
    position_embeddings: RotaryEmbeddings
    """(cos, sin), or one pair per attention type (`models.decoder_layers.rotary_embeddings`)."""


class EarlyExitDrafter(nn.Module):
    """Embeddings + first N target layers (frozen) + ExitHead. See the module docstring."""

    def __init__(
        self,
        config,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module,
        shared_layers: nn.ModuleList,
        exit: ExitHead,
        exit_init_layers: list[int],
    ):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.shared_layers = shared_layers
        self.exit = exit
        self.layer_types = target_layer_types(config)
        self.num_hidden_layers = len(self.layer_types)
        self.num_shared_layers = len(shared_layers)
        self.exit_init_layers = exit_init_layers
        """Target layer each exit layer was initialised from (the last `num_exit_layers` layers)."""
        self.exit_cache_slots = [self.num_hidden_layers + j for j in range(len(exit.layers))]
        self.target_path: str | None = None
        self.target_revision: str | None = None
        self.loaded_keys: list[str] = []
        """Checkpoint tensors read by `build_early_exit` (empty when built from a loaded target)."""

    @property
    def exit_layers(self) -> nn.ModuleList:
        return self.exit.layers

    @property
    def norm(self) -> nn.Module:
        return self.exit.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.exit.lm_head

    @property
    def num_exit_layers(self) -> int:
        return len(self.exit.layers)

    def frozen_modules(self) -> list[nn.Module]:
        return [self.embed_tokens, self.rotary_emb, self.shared_layers]

    def freeze_shared(self) -> None:
        """Embeddings and the first N layers never train (seed 001 §3.1); the exit head does."""
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()
        self.exit.requires_grad_(True)

    def train(self, mode: bool = True) -> EarlyExitDrafter:
        """Only the exit head changes mode: the frozen target modules stay in eval (no dropout)."""
        self.training = mode
        self.exit.train(mode)
        return self

    def new_cache(self):
        """A DynamicCache with one slot per target layer plus the exit slots (same kinds as the last layer's)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.layers.extend(copy.deepcopy(cache.layers[src]) for src in self.exit_init_layers)
        return cache

    def positions(
        self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None, cache: Any = None
    ) -> tuple[torch.Tensor, RotaryEmbeddings]:
        """Position ids (continuing the cache when none are given) and the rotary embeddings for them."""
        if position_ids is None:
            past = cache.get_seq_length(0) if cache is not None else 0
            position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        return position_ids, self.rotary(hidden, position_ids)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> RotaryEmbeddings:
        """The target's rotary embeddings at `position_ids`, for every attention type of its layers."""
        return rotary_embeddings(self.rotary_emb, hidden, position_ids, self.layer_types)

    def causal_mask(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | dict | None,
        cache: Any,
        position_ids: torch.Tensor,
        slots: list[int],
    ) -> dict[str, torch.Tensor | None]:
        """Masks by attention type for the layers writing cache `slots` (see `attention_masks`)."""
        types = [self.slot_type(slot) for slot in slots]
        return attention_masks(self.config, hidden, attention_mask, cache, position_ids, slots, types)

    def slot_type(self, slot: int) -> str:
        if slot >= self.num_hidden_layers:
            return self.layer_types[self.exit_init_layers[slot - self.num_hidden_layers]]
        return self.layer_types[slot]

    def forward_shared(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | dict | None = None,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
    ) -> SharedState:
        """Embeddings and the first N layers (no autograd graph while they are frozen)."""
        # checked only when autograd is on: decoding calls this once per draft step
        grad = torch.is_grad_enabled() and any(
            p.requires_grad for m in self.frozen_modules() for p in m.parameters()
        )
        with torch.set_grad_enabled(grad):
            hidden = self.embed_tokens(input_ids)
            position_ids, position_embeddings = self.positions(hidden, position_ids, cache)
            slots = list(range(self.num_shared_layers))
            masks = self.causal_mask(hidden, attention_mask, cache, position_ids, slots)
            hidden = run_layers(
                self.shared_layers,
                hidden,
                position_embeddings,
                masks,
                cache,
                position_ids,
                [self.slot_type(s) for s in slots],
            )
        return SharedState(hidden, position_ids, position_embeddings)

    def exit_masks(
        self, state: SharedState, attention_mask: torch.Tensor | dict | None = None, cache: Any = None
    ) -> dict[str, torch.Tensor | None]:
        """Masks for the exit layers (sized against their own cache slots)."""
        return self.causal_mask(
            state.hidden, attention_mask, cache, state.position_ids, self.exit_cache_slots
        )

    def forward_exit(
        self,
        state: SharedState,
        attention_mask: torch.Tensor | dict | None = None,
        cache: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden) of the exit head on layer-N hidden states; exit layers write `exit_cache_slots`."""
        masks = self.exit_masks(state, attention_mask, cache) if self.exit_cache_slots else None
        return self.exit(state.hidden, state.position_embeddings, masks, cache, state.position_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids -> (logits, hidden), hidden being the final-norm output (the input of the lm head)."""
        state = self.forward_shared(input_ids, attention_mask, cache, position_ids)
        return self.forward_exit(state, attention_mask, cache)


# ----------------------------------------------------------------------------- building


def _check_sizes(num_layers: int, num_shared_layers: int, num_exit_layers: int) -> None:
    if not 1 <= num_shared_layers < num_layers:
        raise ValueError(
            f"num_shared_layers must be in [1, {num_layers - 1}] for a {num_layers}-layer target"
        )
    if not 0 <= num_exit_layers <= num_layers:
        raise ValueError(f"num_exit_layers must be in [0, {num_layers}] for a {num_layers}-layer target")


def _assemble(
    parts: DecoderParts, exit_parts: DecoderParts, num_shared_layers: int, num_exit_layers: int
) -> EarlyExitDrafter:
    """A drafter whose shared modules are `parts`' own and whose exit modules are copies from `exit_parts`."""
    num_layers = len(parts.layers)
    _check_sizes(num_layers, num_shared_layers, num_exit_layers)
    init_layers = list(range(num_layers - num_exit_layers, num_layers))
    exit_layers = nn.ModuleList()
    for j, src in enumerate(init_layers):
        layer = copy.deepcopy(exit_parts.layers[src])
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = num_layers + j  # its own cache slot, see the module docstring
        exit_layers.append(layer)
    types = target_layer_types(parts.model.config)
    head = ExitHead(
        exit_layers,
        copy.deepcopy(exit_parts.norm),
        copy.deepcopy(exit_parts.lm_head),
        [types[src] for src in init_layers],
    )
    shared = nn.ModuleList(parts.layers[:num_shared_layers])
    return EarlyExitDrafter(
        parts.model.config, parts.embed_tokens, parts.rotary_emb, shared, head, init_layers
    )


def build_early_exit(
    target_path: str,
    num_shared_layers: int,
    num_exit_layers: int = 1,
    *,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    exit_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> EarlyExitDrafter:
    """The drafter from a target checkpoint (local folder or hub id), reading only the tensors it needs.

    Embeddings, layers 0..N-1, the last `num_exit_layers` layers, the final norm and the lm head are read;
    every other layer stays on the meta device and is dropped. `exit_dtype` (default `dtype`) lets the
    trainable head keep fp32 master weights while the frozen part is bf16.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path, revision=revision, trust_remote_code=trust_remote_code)
    reader = open_checkpoint(target_path, revision)
    skeleton = meta_causal_lm(config, dtype, attn_implementation, trust_remote_code)
    parts = decoder_parts(skeleton)
    drafter = _assemble(parts, parts, num_shared_layers, num_exit_layers)
    layers = parts.names["layers"]
    sources = [
        (drafter.embed_tokens, parts.names["embed_tokens"]),
        (drafter.rotary_emb, parts.names["rotary_emb"]),
        *((layer, f"{layers}.{i}") for i, layer in enumerate(drafter.shared_layers)),
        *(
            (layer, f"{layers}.{src}")
            for layer, src in zip(drafter.exit_layers, drafter.exit_init_layers, strict=True)
        ),
        (drafter.exit.norm, parts.names["norm"]),
        (drafter.exit.lm_head, parts.names["lm_head"]),
    ]
    drafter.loaded_keys = materialise(sources, skeleton, reader, device)
    del skeleton, parts  # the unused layers were never given storage; drop their meta shells too
    if exit_dtype is not None:
        drafter.exit.to(exit_dtype)
    drafter.freeze_shared()
    drafter.target_path, drafter.target_revision = target_path, revision
    return drafter


def from_target(
    target: nn.Module,
    num_shared_layers: int,
    num_exit_layers: int = 1,
    *,
    init_exit: bool = True,
    exit_dtype: torch.dtype | None = None,
) -> EarlyExitDrafter:
    """A drafter on a fully loaded target, SHARING its embeddings, rotary embedding and first N layers.

    The exit head gets new storage on the device of layer N-1 (so the hidden states need no transfer);
    with `init_exit` it is copied from the target's last layer(s), final norm and lm head (eq. 1).
    """
    parts = decoder_parts(target)
    reference = next(parts.layers[num_shared_layers - 1].parameters())  # its dtype (`meta` when offloaded)
    remote = bool(getattr(target.config, "auto_map", None))  # a target built from hub code needs it again
    skeleton = meta_causal_lm(
        target.config, exit_dtype or reference.dtype, target.config._attn_implementation, remote
    )
    drafter = _assemble(parts, decoder_parts(skeleton), num_shared_layers, num_exit_layers)
    head = drafter.exit
    head.to_empty(device=execution_device(parts.layers[num_shared_layers - 1]))
    with torch.no_grad():
        for module in head.modules():
            skeleton._init_weights(module)  # non-persistent buffers; weights are overwritten below
        if init_exit:
            for layer, src in zip(head.layers, drafter.exit_init_layers, strict=True):
                layer.load_state_dict(parts.layers[src].state_dict())
            head.norm.load_state_dict(parts.norm.state_dict())
            head.lm_head.load_state_dict(parts.lm_head.state_dict())
    drafter.freeze_shared()
    drafter.target_path = getattr(target.config, "_name_or_path", None) or None
    return drafter


# ----------------------------------------------------------------------------- saving and attaching


def head_config(drafter: EarlyExitDrafter, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    config = drafter.config
    text = config.get_text_config(decoder=True)
    return {
        "format": FORMAT,
        "target": {"path": drafter.target_path, "revision": drafter.target_revision},
        "architecture": (config.architectures or [type(config).__name__])[0],
        "model_type": config.model_type,
        "num_hidden_layers": drafter.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "num_shared_layers": drafter.num_shared_layers,
        "num_exit_layers": drafter.num_exit_layers,
        "exit_init_layers": drafter.exit_init_layers,
        "exit_cache_slots": drafter.exit_cache_slots,
        "dtype": str(next(drafter.exit.parameters()).dtype).removeprefix("torch."),
        **(extra or {}),
    }


def save_exit_head(
    drafter: EarlyExitDrafter,
    folder: str | Path,
    extra: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the exit layer(s), norm and head (`early_exit.safetensors`) and `early_exit.json`.

    `state`: the head's state dict when it lives elsewhere (gathered from FSDP / ZeRO-3 shards).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in (state or drafter.exit.state_dict()).items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
    text = json.dumps(head_config(drafter, extra), indent=2)
    (folder / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
    return folder


def read_head_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; is this an early_exit stage output (`head/`)?")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("format") != FORMAT:
        raise ValueError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    return config


def attach_exit_head(target: nn.Module, folder: str | Path) -> EarlyExitDrafter:
    """Attach a saved head to a fully loaded target for self-speculative decoding.

    The drafter's embeddings and first N layers ARE the target's modules (no copies); the head is cast to
    the target's dtype. A head trained for a different target shape is refused.
    """
    from safetensors.torch import load_file

    saved = read_head_config(folder)
    text = target.config.get_text_config(decoder=True)
    ours = {
        "num_hidden_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
    }
    wrong = {k: (saved[k], v) for k, v in ours.items() if saved[k] != v}
    if wrong:
        shown = ", ".join(f"{k} {a} (head) vs {b} (target)" for k, (a, b) in wrong.items())
        raise ValueError(
            f"{folder}: this head was trained for another target ({saved['target']['path']}): {shown}"
        )
    drafter = from_target(target, saved["num_shared_layers"], saved["num_exit_layers"], init_exit=False)
    state = load_file(str(Path(folder) / WEIGHTS_FILE), device=str(next(drafter.exit.parameters()).device))
    drafter.exit.load_state_dict(state)
    drafter.target_path, drafter.target_revision = saved["target"]["path"], saved["target"]["revision"]
    return drafter
