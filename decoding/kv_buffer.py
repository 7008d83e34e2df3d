"""Full-attention KV-cache layers that share one preallocated buffer, so that rolling back costs no tensor
work per layer.

HF's `DynamicLayer` concatenates every forward's new states onto its keys and values (a copy of the layer's
whole cache each forward) and crops with two slices per layer; moving a tree's accepted path into place
costs three ops per moved position, per tensor and per layer. On a small target those hundreds of small
ops are a large share of a decoding round (bench/results/engine_overhead.md). Here the full-attention
layers with one device, dtype and state shape keep their keys in one tensor [layers, batch, heads,
capacity, head_dim] and their values in another: a forward copies only its new states into place, a crop
sets a length (no tensor op) and keeping chosen positions is one gather and one copy per tensor for all
those layers at once.

A layer holds the states of its first forward (a prompt, whose shape is only known then) as they come;
`KVBuffer.pack` then gives every such layer its place in the buffer of its group, sized for the group's
layers exactly, and a group grows (doubling its capacity) when a forward would run past its end. A second
forward or a crop before the pack is refused (`CachedLM` packs after every first forward).
Sliding-window layers stay HF's own (they drop positions as they go).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

FIRST_CAPACITY = 256
"""Positions a new group has room for, at least (a prompt longer than that gets its length, doubled)."""


class BufferLayer(CacheLayerMixin):
    """One full-attention layer's keys and values: its states as they came until it is packed, then a view of
    its group's buffer with a length."""

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        self.is_initialized = False
        self.length = 0
        self.loose: tuple[Tensor, Tensor] | None = None
        """The keys and values of the forwards before packing, [batch, heads, length, head_dim] each."""
        self.slots: tuple[Tensor, Tensor] | None = None
        """Once packed: this layer's keys and values in its group's buffers, the full capacity."""
        self.group: Group | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new states [batch, heads, n, head_dim]; returns every cached position's keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.slots is None:
            if self.loose is not None:
                raise RuntimeError(
                    "a BufferLayer takes one forward before `KVBuffer.pack` gives it its place"
                )
            self.loose = key_states, value_states
            self.length = n
            return self.loose
        if self.length + n > self.slots[0].shape[-2]:
            self.group.grow(self.length + n)
        keys, values = self.slots
        keys.narrow(-2, self.length, n).copy_(key_states)
        values.narrow(-2, self.length, n).copy_(value_states)
        self.length += n
        return keys.narrow(-2, 0, self.length), values.narrow(-2, 0, self.length)

    @property
    def keys(self) -> Tensor | None:
        if self.slots is None:
            return None if self.loose is None else self.loose[0]
        return self.slots[0].narrow(-2, 0, self.length)

    @property
    def values(self) -> Tensor | None:
        if self.slots is None:
            return None if self.loose is None else self.loose[1]
        return self.slots[1].narrow(-2, 0, self.length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (a positive value is, as in HF, the length to keep)."""
        length = (
            min(self.length, tokens_to_remove) if tokens_to_remove > 0 else self.length + tokens_to_remove
        )
        if self.slots is None and self.loose is not None:
            raise RuntimeError("a BufferLayer is cropped only after `KVBuffer.pack` gave it its place")
        self.length = max(0, length)

    def reset(self) -> None:
        raise NotImplementedError("a BufferLayer is not reset: `CachedLM.reset` builds a new cache")


class Group:
    """The buffers of the packed layers that share a device, a dtype and a state shape."""

    def __init__(self, layers: list[BufferLayer], capacity: int) -> None:
        self.layers = layers
        self.buffers = tuple(
            states.new_empty((len(layers), *states.shape[:-2], capacity, states.shape[-1]))
            for states in layers[0].loose
        )
        for slot, layer in enumerate(layers):
            for buffer, states in zip(self.buffers, layer.loose):
                buffer[slot].narrow(-2, 0, layer.length).copy_(states)
            layer.loose = None
            layer.group = self
        self.bind()

    def bind(self) -> None:
        for slot, layer in enumerate(self.layers):
            layer.slots = self.buffers[0][slot], self.buffers[1][slot]

    def grow(self, needed: int) -> None:
        """Room for at least `needed` positions: buffers of twice the capacity (or `needed`), states copied."""
        old = self.buffers
        capacity = max(needed, 2 * old[0].shape[-2])
        length = max(layer.length for layer in self.layers)
        self.buffers = tuple(
            buffer.new_empty((*buffer.shape[:-2], capacity, buffer.shape[-1])) for buffer in old
        )
        for new, buffer in zip(self.buffers, old):
            new.narrow(-2, 0, length).copy_(buffer.narrow(-2, 0, length))
        self.bind()

    def move(self, places: int, sources: list[int]) -> None:
        """Positions `sources` (increasing, each at or after its place) to places, places + 1, ... in every layer.

        All sources are read before any place is written, as the one-by-one moves in increasing order would
        (a source is never a place written before it)."""
        index = torch.tensor(sources, device=self.buffers[0].device)
        for buffer in self.buffers:
            buffer.narrow(-2, places, len(sources)).copy_(buffer.index_select(-2, index))


class KVBuffer:
    """A `DynamicCache` for `config` whose full-attention layers are `BufferLayer`s, and their groups."""

    def __init__(self, config) -> None:
        self.cache = DynamicCache(config=config)
        self.cache.layers = [
            BufferLayer() if type(layer) is DynamicLayer else layer for layer in self.cache.layers
        ]
        self.groups: list[Group] = []
        self.packed = False

    def pack(self) -> None:
        """Give the layers that hold their first states a place in their group's buffers."""
        loose = [
            layer for layer in self.cache.layers if type(layer) is BufferLayer and layer.loose is not None
        ]
        kinds: dict[tuple, list[BufferLayer]] = {}
        for layer in loose:
            keys, values = layer.loose
            kind = (
                keys.device,
                keys.dtype,
                keys.shape[:-2],
                keys.shape[-1],
                values.shape[:-2],
                values.shape[-1],
            )
            kinds.setdefault(kind, []).append(layer)
        for layers in kinds.values():
            length = max(layer.length for layer in layers)
            self.groups.append(Group(layers, max(FIRST_CAPACITY, 2 * length)))
        self.packed = True

    def keep(self, start: int, first: int, indices: list[int]) -> None:
        """In every packed layer, positions start + indices[first:] moved to start + first, ...; the length set
        to start + len(indices)."""
        for group in self.groups:
            group.move(start + first, [start + index for index in indices[first:]])
            for layer in group.layers:
                layer.length = start + len(indices)
