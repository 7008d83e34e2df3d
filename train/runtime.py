"""Setting up a training process: precision, attention kernel, the Accelerator, DeepSpeed's batch values.

Shared by every trainer so that they make the same choices the same way.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from polydraft.train.step import OptimSettings


class NonFiniteLoss(RuntimeError):
    """A NaN or infinite loss: training stops instead of writing a poisoned checkpoint."""


def check_finite(loss: float, step: int, last_checkpoint: str | None) -> None:
    """Raise NonFiniteLoss naming the step and the last good checkpoint when `loss` is NaN or inf."""
    if not math.isfinite(loss):
        kept = (
            f"the last good checkpoint is kept at {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written yet"
        )
        raise NonFiniteLoss(
            f"loss is {loss} at step {step}; {kept}. Lower the learning rate (optim.lr), check the "
            "data, or train in fp32 (loop.mixed_precision: no)."
        )


CORES_FILE_ENV = "POLYDRAFT_CORES_FILE"
"""Names the file through which the runner changes the CPU cores of a training process while it runs
(`pipelines.run.side_by_side`): a stage that ran beside it ended, or one started."""


class CoreShare:
    """The CPU cores a training process may use, as the runner's cores file (`CORES_FILE_ENV`) says: the
    runner writes the stage's share of the node's cores into it while stages run side by side
    (`runner.parallel_stages`), and again when the stages beside it change. `follow()` runs once a step:
    when the file changed, torch's threads become this process's part of the share (the share divided among
    the node's training processes). Without the file (one stage at a time, or OMP_NUM_THREADS set by the
    user), it does nothing."""

    def __init__(self, path: Path | None, processes: int) -> None:
        self.path, self.processes = path, max(1, processes)
        self.seen: tuple[int, int, int] | None = None

    @classmethod
    def from_env(cls) -> CoreShare:
        path = os.environ.get(CORES_FILE_ENV)
        return cls(Path(path) if path else None, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def follow(self) -> int | None:
        """The new number of threads when the file changed to another share (torch set to it), else None."""
        if self.path is None:
            return None
        try:
            info = self.path.stat()
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
            if stamp == self.seen:
                return None
            self.seen = stamp
            cores = int(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not there (yet), or being replaced: the next step looks again
            return None
        threads = max(1, cores // self.processes)
        if threads == torch.get_num_threads():
            return None
        torch.set_num_threads(threads)
        return threads


def resolve_mixed_precision(choice: str, cuda: bool) -> str:
    """`auto` -> bf16 on a GPU that supports it, else no (fp32); other choices pass through.

    On a CPU training stays fp32: bf16 autocast there is slow and changes results for no benefit.
    """
    if choice != "auto":
        if choice in ("bf16", "fp16") and not cuda:
            raise ValueError(f"mixed_precision {choice!r} needs a GPU; use `auto` or `no` on a CPU")
        return choice
    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"


def resolve_attn_implementation(choice: str, cuda: bool) -> str:
    """`auto` -> flash_attention_2 on a GPU with `flash_attn` installed, else PyTorch SDPA."""
    if choice != "auto":
        if choice == "flash_attention_2" and not (cuda and importlib.util.find_spec("flash_attn")):
            raise ValueError("attn_implementation flash_attention_2 needs a GPU and the flash-attn package")
        return choice
    return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"


def make_accelerator(
    grad_accum_steps: int, mixed_precision: str, collective_timeout_s: float | None = None
) -> Any:
    """An Accelerator whose LR scheduler is stepped by the trainer itself, once per optimizer step, and
    whose process group waits `collective_timeout_s` for a collective (None: torch's default).

    `step_scheduler_with_optimizer=False` stops accelerate from stepping a prepared scheduler once per
    *process* per step; trainers register their scheduler for checkpointing and step it themselves.
    """
    import datetime

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    if collective_timeout_s is not None:
        handlers.append(InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=collective_timeout_s)))
    return Accelerator(
        gradient_accumulation_steps=grad_accum_steps,
        mixed_precision=mixed_precision,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=handlers,
    )


def configure_deepspeed(accelerator: Any, micro_batch_size: int, max_grad_norm: float) -> None:
    """Fill DeepSpeed's `auto` batch size and clipping, which accelerate takes from prepared dataloaders.

    Trainers here feed batches themselves (exact, resumable data positions), so accelerate cannot infer
    the micro-batch size; without it DeepSpeed refuses to start. Clipping moves into DeepSpeed's config
    because DeepSpeed clips inside its own step. A no-op for other backends.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = max_grad_norm


def prepare_for_training(
    model: torch.nn.Module,
    optim: OptimSettings,
    total_steps: int,
    micro_batch_size: int,
    accelerator: Any,
    compile: bool = False,
) -> tuple[torch.nn.Module, Any, Any]:
    """(the prepared model in train mode, its optimizer, the LR scheduler): AdamW over the trainable
    parameters and its schedule (`train.schedule`), DeepSpeed's batch and clipping filled in, then
    `accelerator.prepare`. Every trainer starts this way."""
    from polydraft.train.schedule import build_optimizer, build_scheduler

    if compile:
        model.compile()
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, optim.betas, optim.eps)
    scheduler = build_scheduler(
        optimizer, total_steps, optim.warmup_ratio, optim.schedule, optim.min_lr_ratio
    )
    configure_deepspeed(accelerator, micro_batch_size, optim.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    return model, optimizer, scheduler


def unwrap(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP/FSDP/DeepSpeed/compile wrappers."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def loss_chunking(accelerator: Any, chunk_tokens: int | None) -> int | None:
    """The chunk size of `train.chunked_loss` to use: `chunk_tokens`, or None (the full logits) where the
    backend shards the parameters outside the forward (FSDP, DeepSpeed ZeRO-3), so that the lm head's
    weight is not whole where the chunked loss reads it."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    sharded = kind == DistributedType.FSDP or (
        kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    return None if sharded else chunk_tokens
