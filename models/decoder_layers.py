"""A slice of a target's decoder layers run on given hidden states: the attention masks of each layer type
(full and sliding-window), the rotary position embeddings (one pair, or one per layer type where the model's
rotary embedding differs by type, as Gemma 3's local and global frequencies do) and the layers in order,
each writing its own KV-cache slot.

The early-exit drafter (`models.early_exit`), its trainer's teacher pass, the target streamed layer by
layer (`models.target_stream`) and self-speculative verification (`decoding.eesd`) all run parts of a
target this way, with transformers' own layer modules and mask functions (no copy of model code).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from polydraft.models.partial_load import TargetLayoutError
from polydraft.models.placement import execution_device


def cache_kwargs(function: Any, cache: Any) -> dict[str, Any]:
    """The KV cache as the keyword `function` (a transformers forward or mask function, or a module) takes:
    `cache` from the releases that renamed it (5.2x: `past_key_values` there is deprecated, to be removed
    in 5.40), `past_key_values` before."""
    return {_cache_keyword(function.forward if isinstance(function, nn.Module) else function): cache}


@functools.cache
def _cache_keyword(function: Any) -> str:
    """Asked once per function: decoding runs layers on every draft step."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def _mask_functions() -> dict[str, Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def target_layer_types(config) -> list[str]:
    """Attention type of each decoder layer: `config.layer_types` when the model has them, else one type."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    if types is None:
        sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
        types = ["sliding_attention" if sliding else "full_attention"] * text.num_hidden_layers
    unsupported = sorted(set(types) - set(_mask_functions()))
    if unsupported:
        raise TargetLayoutError(f"{config.model_type}: unsupported attention layer types {unsupported}")
    return list(types)


def attention_masks(
    config,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    cache: Any,
    position_ids: torch.Tensor,
    slots: list[int],
    types: list[str],
) -> dict[str, torch.Tensor | None]:
    """Masks by attention type for layers writing cache `slots` of attention `types`, each type's mask
    sized against the first of its slots in the cache.

    `attention_mask`: a 2D padding mask, None, a prepared 4D mask (tree attention: returned as is by
    transformers' mask functions), or a dict type -> mask (returned unchanged).
    """
    if isinstance(attention_mask, dict):
        return attention_mask
    functions = _mask_functions()
    return {
        kind: functions[kind](
            config=config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            layer_idx=slots[types.index(kind)],
            **cache_kwargs(functions[kind], cache),
        )
        for kind in dict.fromkeys(types)
    }


RotaryEmbeddings = tuple[torch.Tensor, torch.Tensor] | dict[str, tuple[torch.Tensor, torch.Tensor]]
"""(cos, sin) for every layer, or a dict attention type -> (cos, sin) (`rotary_embeddings`)."""


def rotary_embeddings(
    rotary_emb: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, types: list[str]
) -> RotaryEmbeddings:
    """The rotary position embeddings for layers of attention `types`, as the model's own forward computes
    them: one (cos, sin) pair, or, when its rotary embedding takes the layer type (Gemma 3: local and
    global base frequencies), a dict attention type -> (cos, sin)."""
    if _takes_layer_type(type(rotary_emb)):
        return {kind: rotary_emb(hidden, position_ids, kind) for kind in dict.fromkeys(types)}
    return rotary_emb(hidden, position_ids=position_ids)


@functools.cache
def _takes_layer_type(rotary_class: type) -> bool:
    """Whether a rotary embedding class's forward takes the layer type (asked once per class: decoding
    calls `rotary_embeddings` on every draft step)."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def run_layers(
    layers: nn.ModuleList | list[nn.Module],
    hidden: torch.Tensor,
    position_embeddings: RotaryEmbeddings,
    attention_mask: torch.Tensor | dict[str, torch.Tensor | None] | None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    layer_types: list[str] | None = None,
) -> torch.Tensor:
    """Run decoder layers of the target's class in order; each writes its own cache slot (`layer_idx`).

    `attention_mask` is what the layers take (a prepared 4D mask, or None for plain causal attention with
    SDPA), or a dict attention type -> mask together with `layer_types` (one per layer); so are the
    `position_embeddings` (`rotary_embeddings`).
    """
    for i, layer in enumerate(layers):
        mask = attention_mask[layer_types[i]] if isinstance(attention_mask, dict) else attention_mask
        rope = position_embeddings
        if isinstance(rope, dict):
            rope = rope[layer_types[i]]
        device = execution_device(layer)
        if hidden.device != device:  # a target spread over devices: this layer's inputs go where it computes
            hidden, mask, rope = _to(hidden, device), _to(mask, device), _to(rope, device)
            position_ids = _to(position_ids, device)
        out = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            position_embeddings=rope,
            **cache_kwargs(layer, cache),
        )
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _to(value: Any, device: torch.device) -> Any:
    """A tensor, a tuple of tensors (cos, sin) or None on `device`."""
    if isinstance(value, tuple):
        return tuple(t.to(device) for t in value)
    return value.to(device) if value is not None else None


def checkpoint_layers(layers: nn.ModuleList | list[nn.Module]) -> None:
    """Make decoder layers recompute their activations in backward instead of keeping them (in training
    mode only), through transformers' own switch on its decoder layers (`GradientCheckpointingLayer`,
    what `gradient_checkpointing_enable` sets), with PyTorch's non-reentrant checkpoint."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in layers:
        if not isinstance(layer, GradientCheckpointingLayer):
            raise ValueError(
                f"{type(layer).__name__} has no gradient checkpointing switch in transformers; set "
                "loop.gradient_checkpointing to false"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
