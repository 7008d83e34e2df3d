"""The drafter trainer's engine: pretrain (P) and finetune (F) of small drafters on the target's vocabulary.

Seed 003 §2.3: a drafter pretrained on generic text (C4, ShareGPT) and then finetuned on the target's
own answers for one language pair drafts far better than one only finetuned. One explicit accelerate
loop (`train_drafter`) serves both; they differ only in where the batches come from (packed generic
documents with loss on every token, or a pair's distilled mix with loss on the responses). The stage
entry points are `pipelines.stages.pretrain` and `pipelines.stages.finetune`.

A job's checkpoints (`<job>.checkpoints/`) and per-step log (`<job>.train_log.jsonl`) sit beside its
exported folder; a rerun resumes from the last checkpoint with the same data order and RNG states, so it
continues with the same losses as a run that was never interrupted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from polydraft.models.drafters import build_drafter, export_drafter, load_drafter
from polydraft.train.chunked_loss import Teacher, chunked_loss, model_head
from polydraft.train.data import MixBatches, PackedBatches
from polydraft.train.evaluation import eval_log, evaluate
from polydraft.train.loop import LoopSettings, TrainingLoop, TrainJob
from polydraft.train.losses import ce_sum, loss_window, topk_kl_sum
from polydraft.train.runtime import loss_chunking, prepare_for_training, unwrap
from polydraft.train.stage_metrics import DrafterMetrics
from polydraft.train.step import OptimSettings, StepLog, StepStats, train_step
from polydraft.train.stream import corpus_tokens
from polydraft.train.throughput import matmul_params, peak_flops, train_flops_per_token

log = logging.getLogger(__name__)


def gathered(state: dict[str, Any], accelerator: Any) -> list[dict[str, Any]]:
    """Every process's data position, in rank order (a collective: every process calls it). A position
    is each process's own: it reads its own share of the pretraining documents."""
    from accelerate.utils import gather_object

    return gather_object([state]) if accelerator.num_processes > 1 else [state]


def rank_state(saved: Any, accelerator: Any) -> dict[str, Any]:
    """This process's data position from a checkpoint's; ValueError when the checkpoint was written by
    another number of processes (each one's share of the documents would differ)."""
    if isinstance(saved, dict):  # one position for every process: a checkpoint of an older version
        saved = [saved] * accelerator.num_processes
    if len(saved) != accelerator.num_processes:
        raise ValueError(
            f"the checkpoint holds the data positions of {len(saved)} processes and this run has "
            f"{accelerator.num_processes}: resume with launch.num_processes as it was, or start over"
        )
    return saved[accelerator.process_index]


def initial_drafter(
    arch: str,
    shape: dict[str, int | None],
    init: str | None,
    revision: str | None,
    *,
    vocab_size: int,
    tokenizer: Any,
    pad_id: int,
    max_length: int,
    attn_implementation: str,
    seed: int,
    target_name: str,
) -> torch.nn.Module:
    """The drafter a job starts from: architecture `arch` (with `shape`'s fields replacing the named ones)
    built on the target's vocabulary, or the checkpoint `init` (at `revision`), checked before any weight
    is read to have the target's vocabulary and tokenizer."""
    if init is None:
        return build_drafter(
            arch,
            vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_id,
            max_position_embeddings=max(2048, max_length),
            attn_implementation=attn_implementation,
            seed=seed,
            **shape,
        )
    return load_drafter(
        init,
        revision,
        target_vocab_size=vocab_size,
        target_tokenizer=tokenizer,
        target_name=target_name,
        attn_implementation=attn_implementation,
    )


def step_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    teacher: Any | None,
    kd_top_k: int,
    kd_weight: float,
    chunk_tokens: int | None = None,
    bare: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch, plus the weighted top-k forward KL to the target (kd).

    Logits are computed from `loss_window` on (transformers' causal LMs take `logits_to_keep`): the loss
    is that of the full logits, without the head's work on the prompts. With `chunk_tokens`, the model
    (`model`, maybe wrapped by DDP: its forward still runs) returns its final hidden states with no
    logits and the loss is computed from them and the head of `bare` (the unwrapped `model`)
    `train.chunked_loss`'s way.
    """
    first = loss_window(batch["labels"])
    keep = batch["labels"].size(1) - first
    labels = batch["labels"][:, first:]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if chunk_tokens is not None:
        none = torch.empty(0, dtype=torch.long, device=labels.device)  # logits for no position
        out = model(**inputs, logits_to_keep=none, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, first:]  # the final-norm states (the last one is tied to them)
        bare = bare or model
        kd = None
        if teacher is not None:
            with torch.no_grad():
                target_hidden = teacher.base_model(**inputs).last_hidden_state[:, first:]
            target_head = model_head(teacher.get_output_embeddings(), teacher.config)
            kd = Teacher(target_hidden, target_head, kd_top_k, kd_weight)
        head = model_head(bare.get_output_embeddings(), bare.config)
        return chunked_loss(hidden, labels, head, chunk_tokens, kd)
    logits = model(**inputs, logits_to_keep=keep).logits
    loss, _ = ce_sum(logits, labels)
    if teacher is not None:
        with torch.no_grad():
            target_logits = teacher(**inputs, logits_to_keep=keep).logits
        loss = loss + kd_weight * topk_kl_sum(logits, target_logits, labels, kd_top_k)
    return loss


def train_drafter(
    accelerator: Any,
    model: torch.nn.Module,
    data: MixBatches | PackedBatches,
    evals: dict[str, list[dict]],
    optim: OptimSettings,
    loop: LoopSettings,
    job: TrainJob,
    pad_id: int,
    kd: tuple[Any, int, float] | None = None,
) -> tuple[torch.nn.Module, DrafterMetrics]:
    """Train `model` for `loop.total_steps` optimizer steps, resuming from the last checkpoint under
    `job.checkpoints`; returns the prepared model and its metrics. `kd`: (the target, top-k, weight) of
    the KL term (`finetune.loss: ce+kd`)."""
    teacher, kd_top_k, kd_weight = kd or (None, 0, 0.0)
    main_process, device = accelerator.is_main_process, accelerator.device
    config = model.config
    flops_per_token = train_flops_per_token(
        matmul_params(model), config.num_hidden_layers, config.hidden_size, loop.max_length
    )
    model.to(device)
    if loop.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, optimizer, scheduler = prepare_for_training(
        model, optim, loop.total_steps, loop.per_device_batch_size, accelerator, loop.compile
    )
    chunk_tokens, bare = loss_chunking(accelerator, loop.loss_chunk_tokens), unwrap(accelerator, model)

    training = TrainingLoop(
        accelerator, loop.plan, label=job.label, checkpoints=job.checkpoints, log_path=job.log_path,
        scheduler=scheduler, quiet=job.quiet,
    )  # fmt: skip
    saved = training.resume()
    if saved is not None:
        data.restore(rank_state(saved["data"], accelerator))
    steplog = StepLog(
        job.tracker,
        job.log_path,
        prefix=job.prefix,
        log_every=loop.log_every,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None,
        world=accelerator.num_processes,
        main_process=main_process,
        step_offset=job.step_offset,
    )

    def one_step(step: int) -> StepStats:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in data.micro_batches(step)]
        return train_step(
            accelerator,
            model,
            optimizer,
            scheduler,
            micro_batches,
            lambda batch: step_loss(model, batch, teacher, kd_top_k, kd_weight, chunk_tokens, bare),
            optim.max_grad_norm,
        )

    def periodic_eval(step: int) -> None:
        metrics = evaluate(accelerator, model, evals, loop.per_device_batch_size, loop.eval_batches, pad_id)
        if main_process:
            job.tracker.log(eval_log(metrics), step=job.step_offset + step)

    result = training.run(
        one_step,
        steplog,
        evaluate=periodic_eval if evals else None,
        state=lambda: {"data": gathered(data.state(), accelerator)},
        epoch=data.epoch,
    )
    final = {}
    if evals:
        final = evaluate(accelerator, model, evals, loop.per_device_batch_size, loop.eval_batches, pad_id)
    metrics = DrafterMetrics(
        steps=result.steps, tokens=result.tokens, train_loss=result.train_loss, eval=final
    )
    return model, metrics


def export(accelerator: Any, model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """Write the trained drafter as a Hugging Face folder, atomically (`<out>.partial`, then rename)."""
    state_dict = accelerator.get_state_dict(model)  # every process: FSDP / ZeRO-3 gather the shards
    if accelerator.is_main_process:
        partial = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        export_drafter(unwrap(accelerator, model), tokenizer, partial, state_dict)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
    accelerator.wait_for_everyone()


def pretrain_steps(
    tokenizer: Any,
    sources: list[dict[str, Any]],
    seed: int,
    *,
    max_steps: int | None,
    epochs: float,
    max_length: int,
    token_budget: int,
    global_batch: int,
) -> int:
    """Optimizer steps of pretraining: `max_steps`, else the token budget, capped by `epochs` passes over
    the corpus when no source streams (a stream's length is unknown; it cycles when it ends). `sources`:
    `read_source` arguments. ValueError when not even one step fits."""
    if max_steps is not None:
        return max_steps
    steps = token_budget // (global_batch * max_length)
    if not any(s["kind"] == "hf" and s["streaming"] for s in sources):
        tokens = corpus_tokens(tokenizer, sources, seed)
        steps = min(steps, int(epochs * tokens / max_length) // global_batch)
    if steps < 1:
        raise ValueError(
            f"the token budget ({token_budget}) or corpus is smaller than one global batch of "
            f"{global_batch} sequences of {max_length} tokens; raise pretrain.token_budget or lower "
            "the batch size or max_length"
        )
    return steps
