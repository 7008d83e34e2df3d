"""A causal LM with its own KV cache, called the lean way: the decoder stack, then the head on the needed rows.

`CachedLM` wraps any Hugging Face causal LM. `forward` runs the model's decoder (`model.base_model`,
e.g. `LlamaModel`) on new tokens against a `DynamicCache` it owns (its full-attention layers sharing one
buffer: `decoding.kv_buffer`), then applies the output head only to
the last `num_logits` positions: a drafter step needs one row, a verification K+1, never the prompt.
It returns those logits and the matching hidden states (the input of the head, i.e. the final-norm
output), which Cali-TS feeds to the calibration model.

Tree attention goes through the model's own attention mask: a 4D additive mask [1, 1, new, cached+new]
plus explicit position ids (`decoding.tree`), so no modeling file is copied. After verification,
`crop` drops rejected positions at the end of the cache and `keep` keeps a prefix plus chosen positions
(the accepted path of a tree).

With `aux_layers` (an EAGLE-3 head's feature layers) each forward also keeps the concatenated states of
those layers for every new position in `features` [n, len(aux_layers) * H], from the same pass.

Forward time is accumulated (`seconds`, `calls`) so that the engine's own overhead, everything outside
the models' forward passes, can be reported. On a GPU `profile=True` synchronises after each forward
so that the time is attributed to it; on a CPU the ops are synchronous and timing costs nothing.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from polydraft.decoding.kv_buffer import BufferLayer, KVBuffer
from polydraft.models.decoder_layers import cache_kwargs
from polydraft.models.eagle3 import feature_capture
from polydraft.models.placement import input_device


class CachedLM:
    """A causal LM plus its KV cache for one sequence (batch size 1)."""

    def __init__(
        self, model: PreTrainedModel, profile: bool = True, aux_layers: list[int] | None = None
    ) -> None:
        self.model = model
        self.aux_layers = aux_layers
        self.features: Tensor | None = None
        """With `aux_layers`: the feature-layer states [n, len(aux_layers) * H] of the last forward's n
        new positions (captured by `models.eagle3.feature_capture`)."""
        self.decoder = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
        text_config = model.config.get_text_config()
        # models that post-process the head's output (Gemma 2/3) do it here, exactly as their forward does
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        # a target spread over devices takes token ids on its embeddings' device and ends on its head's:
        # the logits and hidden states come back to the first, where the decoders keep everything
        self.device = input_device(model)
        self.dtype = model.dtype
        self.sync = profile and self.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        """An empty cache and zeroed counters, for a new sequence."""
        self.kv = KVBuffer(self.model.config)
        self.cache = self.kv.cache
        # sliding-window layers must keep the states they would evict until rejected drafts are cropped
        self.cache.activate_past_recording()
        self.seconds = 0.0
        self.calls = 0

    @property
    def window(self) -> int | None:
        """The smallest sliding window among the cache layers (None without sliding-window attention)."""
        windows = [
            layer.sliding_window for layer in self.cache.layers if type(layer) is DynamicSlidingWindowLayer
        ]
        return min(windows) if windows else None

    @property
    def length(self) -> int:
        """Positions held in the cache."""
        return self.cache.get_seq_length()

    def forward(
        self,
        input_ids: Tensor,
        num_logits: int = 1,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run new tokens input_ids [1, n] through the model and extend the cache.

        Returns (logits [num_logits, V] float, hidden [num_logits, H]) of the last num_logits positions.
        `position_ids` [1, n] and `attention_mask` [1, 1, n, cached + n] (additive, 0 = attend) are given
        for tree inputs; chained inputs need neither.
        """
        start = time.perf_counter()
        with feature_capture(self.model, self.aux_layers or []) as states:
            out = self.decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **cache_kwargs(self.decoder, self.cache),
            )
        if not self.kv.packed:
            self.kv.pack()
        if self.aux_layers:
            self.features = torch.cat(states, dim=-1)[0].to(self.device)
        hidden = out.last_hidden_state[0, -num_logits:]
        logits = self.head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits, hidden = logits.to(self.device), hidden.to(self.device)
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logits, hidden

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions (sliding-window layers then drop what they no longer need)."""
        self.cache.crop(-max(0, self.length - length))

    def keep(self, start: int, indices: list[int]) -> None:
        """Keep cached positions [0, start) plus start + indices (sorted), dropping the rest.

        Used after tree verification: the tree's nodes were appended after position `start` and only
        the accepted path stays.
        """
        if indices == list(range(len(indices))):
            self.crop(start + len(indices))
            return
        # positions before the first one that moves stay where they are; the full-attention layers move the
        # later ones together (`KVBuffer.keep`), any other layer one by one (a path is a few positions: two
        # views and a copy cost less than a gather)
        first = next(place for place, index in enumerate(indices) if index != place)
        kept = start + len(indices)
        self.kv.keep(start, first, indices)
        for layer in self.cache.layers:
            if type(layer) is BufferLayer:
                continue
            # a sliding layer that has not filled its window holds every position, like a full one
            sliding = type(layer) is DynamicSlidingWindowLayer
            if not (
                type(layer) is DynamicLayer or (sliding and layer.cumulative_length < layer.sliding_window)
            ):
                raise NotImplementedError(
                    f"tree decoding needs cache layers that hold every position, not {type(layer).__name__}"
                )
            # the chosen positions move down in place, in increasing order (each moves to a place at or
            # before its own, after every position that lands there has been read), the tail is dropped
            for states in (layer.keys, layer.values):
                for place in range(first, len(indices)):
                    states.narrow(-2, start + place, 1).copy_(states.narrow(-2, start + indices[place], 1))
            layer.keys = layer.keys.narrow(-2, 0, kept)
            layer.values = layer.values.narrow(-2, 0, kept)
            if sliding:
                layer.cumulative_length = kept


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean [q, kv] attention pattern as the 4D additive mask [1, 1, q, kv] HF attention accepts."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters, counting tied weights once (`parameters()` yields each tensor once): MBSU's size ratio."""
    return sum(p.numel() for p in model.parameters())
