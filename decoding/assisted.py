"""The reference row: transformers' own assisted generation, `target.generate(..., assistant_model=drafter)`.

Run on the same target, drafter and prompts as polydraft's decoders, it shows what the lean engine
buys. The drafter drafts `num_assistant_tokens` tokens per round (schedule `constant`) and stops
early when its confidence falls below `confidence_threshold` (0 disables this; transformers' own
defaults are 20 tokens and 0.4). Forward hooks count and time both models' calls, so the same
block efficiency, token rate and overhead share are reported as for the engine's decoders; which
drafts were accepted is internal to transformers, so acceptance metrics stay empty.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor
from transformers import PreTrainedModel

from polydraft.decoding.engine import Generation
from polydraft.decoding.sampling import Sampling
from polydraft.models.placement import input_device


class _CallClock:
    """Counts and times the forward calls of a module through hooks."""

    def __init__(self, module: torch.nn.Module, sync: bool) -> None:
        self.calls, self.seconds, self.sync, self._start = 0, 0.0, sync, 0.0
        self.handles = [
            module.register_forward_pre_hook(self._before),
            module.register_forward_hook(self._after),
        ]

    def _before(self, module, args) -> None:
        self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.inference_mode()
def assisted(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    num_assistant_tokens: int,
    confidence_threshold: float,
    seed: int,
    eos_ids: set[int],
    profile: bool = True,
) -> Generation:
    """Decode one prompt with transformers' assisted generation; sampling is seeded with `seed`."""
    device = input_device(target)
    input_ids = prompt.view(1, -1).to(device)
    saved = drafter.generation_config
    drafter.generation_config = copy.deepcopy(saved)
    drafter.generation_config.num_assistant_tokens = num_assistant_tokens
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = confidence_threshold
    options = (
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if sampling.greedy
        else {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
    )
    sync = profile and device.type == "cuda"
    clocks = (_CallClock(target, sync), _CallClock(drafter, sync))
    eos = sorted(eos_ids) or None
    try:
        cuda = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda"
            else []
        )
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            start = time.perf_counter()
            output = target.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=drafter,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else target.config.pad_token_id,
                **options,
            )
            wall = time.perf_counter() - start
    finally:
        for clock in clocks:
            clock.remove()
        drafter.generation_config = saved
    tokens = output[0, input_ids.shape[1] :].tolist()
    return Generation(
        tokens=tokens,
        stop="eos" if tokens and tokens[-1] in eos_ids else "length",
        target_calls=clocks[0].calls,
        draft_calls=clocks[1].calls,
        wall_seconds=wall,
        target_seconds=clocks[0].seconds,
        draft_seconds=clocks[1].seconds,
    )
