"""`eesd`: self-speculative decoding with the early-exit drafter, sharing the first N layers (seed 001 §3.1).

The drafter (`models.early_exit.EarlyExitDrafter`, attached to the loaded target) is the target's own
embeddings and first N layers plus trainable exit layer(s), norm and head. One KV cache serves both:
slots 0..N-1 (the shared layers), N..L-1 (the target's later layers) and the exit layers' own slots.

- Drafting runs a token through the shared layers, writing the target's slots 0..N-1, then the
  layer-N hidden state through the exit layers (their slots) and the exit head.
- Verification does not recompute the first N layers: the layer-N hidden states of the pending
  committed token(s) and of the drafts, computed while drafting (the last draft gets its shared
  pass here), continue through the target's layers N..L-1 in ONE pass for the K+1 positions, then
  the target's norm and head on those rows.
- Rejected positions are cropped from every slot group; layer-N hidden states that a slot group has
  not consumed yet (the last accepted draft for the exit layers) are kept in a small buffer.
The rounds, acceptance (greedy or rejection sampling) and draft-length control are `decoding.chain`'s.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from polydraft.decoding.chain import ControlledDrafting, chain_decode, draft_tokens
from polydraft.decoding.engine import Generation, Output
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import Controller


class SelfSpeculative:
    """The target and its early-exit drafter on one cache, for one sequence at a time."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module, profile: bool = True) -> None:
        from polydraft.models.decoder_layers import run_layers
        from polydraft.models.partial_load import decoder_parts
        from polydraft.models.placement import input_device

        parts = decoder_parts(target)
        self.run_layers = run_layers
        self.drafter = drafter
        self.shared_slots = list(range(drafter.num_shared_layers))
        self.deep_slots = list(range(drafter.num_shared_layers, drafter.num_hidden_layers))
        self.exit_slots = list(drafter.exit_cache_slots)
        self.deep_layers = parts.layers[drafter.num_shared_layers :]
        self.deep_types = [drafter.slot_type(s) for s in self.deep_slots]
        self.norm, self.head = parts.norm, parts.lm_head
        # the target's logits as its own forward post-processes them (Gemma 2's soft-capping), as `CachedLM`'s
        self.softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        self.device = input_device(target)  # token ids, positions and the returned logits live here
        self.sync = profile and self.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()
        # sliding-window layers must keep the states they would evict until rejected drafts are cropped
        self.cache.activate_past_recording()
        self.buffer: Tensor | None = None
        """Layer-N hidden states [1, n, H] of positions buffer_start.. that a slot group still needs."""
        self.buffer_start = 0
        self.draft_seconds = self.target_seconds = 0.0
        self.draft_calls = self.target_calls = 0

    def length(self, slots: list[int]) -> int:
        """Positions cached by a slot group (all its slots hold the same positions)."""
        return self.cache.layers[slots[0]].get_seq_length() if slots else 0

    def _clock(self, start: float) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def shared(self, input_ids: Tensor) -> float:
        """Embeddings and layers 0..N-1 for new tokens; their layer-N states join the buffer."""
        start = time.perf_counter()
        state = self.drafter.forward_shared(input_ids, cache=self.cache)
        self.buffer = state.hidden if self.buffer is None else torch.cat([self.buffer, state.hidden], dim=1)
        return self._clock(start)

    def _layers(self, layers, slots: list[int], types: list[str], first: int) -> Tensor:
        """Buffered layer-N states from position `first` on through `layers`, writing `slots`."""
        assert self.buffer is not None
        hidden = self.buffer[:, first - self.buffer_start :]
        positions = torch.arange(first, first + hidden.shape[1], device=self.device).view(1, -1)
        embeddings = self.drafter.rotary(hidden, positions)
        masks = self.drafter.causal_mask(hidden, None, self.cache, positions, slots)
        return self.run_layers(layers, hidden, embeddings, masks, self.cache, positions, types)

    def draft_step(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Draft one token: (logits [V], hidden [H]) of the exit head after `input_ids`."""
        seconds = self.shared(input_ids)
        start = time.perf_counter()
        exit_head = self.drafter.exit
        if self.exit_slots:
            first = self.length(self.exit_slots)
            last = self._layers(exit_head.layers, self.exit_slots, exit_head.layer_types, first)[0, -1]
        else:  # head-only exit (num_exit_layers = 0): norm and head on the newest layer-N state
            assert self.buffer is not None
            last = self.buffer[0, -1]
        hidden = exit_head.norm(last)
        logits, hidden = exit_head.lm_head(hidden).float().to(self.device), hidden.to(self.device)
        self.draft_seconds += seconds + self._clock(start)
        self.draft_calls += 1
        return logits, hidden

    def verify(self, pending: Tensor, num_logits: int) -> tuple[Tensor, Tensor]:
        """Shared pass for `pending` (the last draft, or the committed tokens when nothing was drafted),
        then layers N..L-1 on every position they have not processed: (logits, hidden) of the last rows."""
        seconds = self.shared(pending) if pending.numel() else 0.0
        start = time.perf_counter()
        out = self._layers(self.deep_layers, self.deep_slots, self.deep_types, self.length(self.deep_slots))
        hidden = self.norm(out[0, -num_logits:])
        logits = self.head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits, hidden = logits.to(self.device), hidden.to(self.device)
        self.target_seconds += seconds + self._clock(start)
        self.target_calls += 1
        return logits, hidden

    def crop(self, shared_and_deep: int, exit_length: int) -> None:
        """Drop rejected positions from every slot group and buffered states no group needs."""
        for slot in self.shared_slots + self.deep_slots:
            self._crop(slot, shared_and_deep)
        for slot in self.exit_slots:
            self._crop(slot, exit_length)
        keep_from = min(exit_length, shared_and_deep) if self.exit_slots else shared_and_deep
        assert self.buffer is not None
        self.buffer = self.buffer[:, keep_from - self.buffer_start : shared_and_deep - self.buffer_start]
        self.buffer_start = keep_from

    def _crop(self, slot: int, length: int) -> None:
        layer = self.cache.layers[slot]
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
        elif getattr(layer, "is_sliding", False) and layer.is_initialized:
            # nothing rejected: a sliding-window layer still drops what its window no longer needs
            layer.crop(0)


class SelfProposer(ControlledDrafting):
    """The early-exit drafter of `model` drafting for the target it shares its first layers with
    (`decoding.chain.Proposer`)."""

    def __init__(
        self, model: SelfSpeculative, control: Controller, sampling: Sampling, generator: torch.Generator
    ) -> None:
        super().__init__(control)
        self.model, self.sampling, self.generator = model, sampling, generator

    def draft(self, out: Output, budget: int) -> tuple[Tensor, Tensor | None]:
        budget = self.draft_budget(out, budget)
        if not budget:
            return out.ids[:0], None
        self.control.begin_round(self.target_hidden)
        first = out.pending(self.model.length(self.model.shared_slots))
        return draft_tokens(self.model.draft_step, first, budget, self.control, self.sampling, self.generator)

    def verify(self, out: Output, drafts: Tensor) -> tuple[Tensor, Tensor]:
        k = drafts.shape[0]
        pending = drafts[-1].view(1, 1) if k else out.pending(self.model.length(self.model.shared_slots))
        extra = self.state_rows(drafts)
        logits, hidden = self.model.verify(pending, k + 1 + extra)
        return self.settled(logits, hidden, drafts, extra)

    def keep(self, n: int, accepted: int, drafts: int, hidden: Tensor) -> None:
        # the exit layers saw the pending tokens and all drafts but the last; without drafts, nothing new
        exit_length = n + min(accepted, drafts - 1) if drafts else self.model.length(self.model.exit_slots)
        self.model.crop(n + accepted, exit_length)
        self.controlled(drafts, accepted, hidden)


@torch.inference_mode()
def self_speculative(
    model: SelfSpeculative,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    control: Controller,
    generator: torch.Generator,
    eos_ids: set[int],
) -> Generation:
    """Decode one prompt with `eesd`; at temperature 0 the output is the target's greedy output."""
    start = time.perf_counter()
    model.reset()
    control.start()
    out = Output(prompt.to(model.device), max_new_tokens, eos_ids, slack=control.max_length + 1)
    rounds = chain_decode(SelfProposer(model, control, sampling, generator), out, sampling, generator)
    return Generation(
        tokens=out.new,
        stop=out.stop,
        rounds=rounds,
        target_calls=model.target_calls,
        draft_calls=model.draft_calls,
        wall_seconds=time.perf_counter() - start,
        target_seconds=model.target_seconds,
        draft_seconds=model.draft_seconds,
    )
