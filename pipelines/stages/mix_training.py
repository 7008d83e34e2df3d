"""What the stages that train on the distill stage's mix share. `sized_batches` cuts encoded mix rows into
this process's batches and sizes the run (finetune, early_exit, heads). The `early_exit` and `heads`
stages both train a small part (an exit head, proposal heads) on a frozen target over the mix of every
pair: `mix_data` reads it, `train.runtime.prepare_for_training` builds the optimizer and schedule and hands the trainable
part to accelerate, `write_output` writes the output folder atomically and drops the checkpoints it makes
useless.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from polydraft.pipelines.stage import StageFailed
from polydraft.train.data import MixBatches, pad_id_of
from polydraft.train.mix_cache import load_examples

log = logging.getLogger(__name__)

MIX_CACHE = "mix_cache"
"""The folder, in a stage's work dir, of its tokenized mix (`train.mix_cache`)."""


def mix_data(
    stage: str, distill_dir: Path, work_dir: Path, tokenizer: Any, loop: Any, accelerator: Any, **options: Any
) -> tuple[MixBatches, list[dict[str, list[int]]], int]:
    """(training batches of this process, held-out examples, total optimizer steps). The mix of every
    pair is tokenized once, into `<work_dir>/mix_cache` (`train.mix_cache`). `options`: `load_examples`'
    (temperatures, loss_on, max_length). StageFailed when the mix is missing or holds less than one
    global batch."""
    cache = {"cache_dir": work_dir / MIX_CACHE, "main_process_first": accelerator.main_process_first}
    splits = {}
    try:
        for split in ("train", "eval"):
            splits[split] = load_examples(distill_dir, tokenizer, split, **options, **cache)
    except (FileNotFoundError, ValueError) as err:
        raise StageFailed(f"{stage}: {err}") from err
    for split, mix in splits.items():
        if mix.dropped:
            log.info("%s: %d %s rows left no response token within max_length", stage, mix.dropped, split)
    batches, total_steps = sized_batches(
        stage, splits["train"].examples, loop.seed, loop, accelerator, pad_id_of(tokenizer)
    )
    # the held-out split is small: eval batches are cut from a list
    return batches, splits["eval"].examples.to_list(), total_steps


def sized_batches(
    stage: str, examples: Sequence[dict[str, list[int]]], seed: int, loop: Any, accelerator: Any, pad_id: int
) -> tuple[MixBatches, int]:
    """(this process's batches of `examples`, total optimizer steps: `loop.max_steps`, else `loop.epochs`
    passes). StageFailed when the examples do not fill one global batch."""
    batches = MixBatches(
        examples, seed, loop.per_device_batch_size, accelerator.process_index, accelerator.num_processes,
        accelerator.gradient_accumulation_steps, pad_id, loop.group_by_length,
    )  # fmt: skip
    if batches.steps_per_epoch == 0:
        raise StageFailed(
            f"{stage}: {len(examples)} training examples are fewer than one global batch of "
            f"{batches.global_batch} (per_device_batch_size x processes x grad_accum_steps)"
        )
    return batches, loop.max_steps or max(1, int(loop.epochs * batches.steps_per_epoch))


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def write_output(
    accelerator: Any,
    work_dir: Path,
    name: str,
    save: Callable[[Path], None],
    checkpoints: str = "checkpoints",
) -> None:
    """`save(folder)` into `<work_dir>/<name>.partial` on the main process, renamed to `<name>` when
    complete; its checkpoints (`<work_dir>/<checkpoints>`) go then (nothing is left to resume). Every
    process calls this."""
    if accelerator.is_main_process:
        out, partial = work_dir / name, work_dir / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save(partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        shutil.rmtree(work_dir / checkpoints, ignore_errors=True)
    accelerator.wait_for_everyone()
