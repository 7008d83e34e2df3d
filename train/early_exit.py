"""The early-exit trainer (seed 001 §3.1-3.2): exit layer + norm + head on the target's frozen first N layers.

Only the drafter's parts of the target are loaded (`models.early_exit.build_early_exit`): embeddings,
layers 0..N-1, the last layer(s), the final norm and the lm head. The frozen part runs without autograd
and is not handed to accelerate; only the `ExitHead` is prepared (DDP / FSDP / DeepSpeed wrap or shard
just the trainable parameters, each process keeps its own copy of the frozen layers).

Data: the distill stage's mix of every pair (target generations and open-source rows, seed 001 §3.2),
cross-entropy to the next token on the response (or on the whole row, `loss_on: all`), optionally plus
the KL to the full target's distribution (`loss: ce+kl`, which loads the whole target and shares its
first N layers with the drafter). Held out: loss and top-1 agreement with the full target's greedy
tokens, computed once per process by streaming the target layer by layer (`eval_reference.*.pt`).

Runner side: `run` launches this module with `accelerate launch` and returns the metrics it wrote.
Subprocess side: `main`. Outputs in the work dir: `head/` (`early_exit.safetensors`, `early_exit.json`),
`metrics.json`, the per-step log `train_log.jsonl`; checkpoints (`checkpoints/step-N/`) let a killed run
resume with the same data order and RNG states, and are removed once the head is written.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from models.early_exit import (
    EarlyExitDrafter,
    attention_masks,
    build_early_exit,
    from_target,
    run_layers,
    save_exit_head,
)
from models.loading import load_causal_lm, load_tokenizer, resolve_dtype
from models.partial_load import decoder_parts
from pipelines.schema import EarlyExitConfig, Recipe
from pipelines.stage import (
    StageContext,
    StageFailed,
    StageResult,
    StageSpec,
    launch_training,
    run_training_process,
    setup_process_logging,
    tracker_for_spec,
)
from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.data import MixBatches, collate, encode_rows, pad_id_of
from train.losses import IGNORE_INDEX, ce_sum, scale_for_step, topk_kl_sum
from train.metrics import Throughput
from train.runtime import (
    check_finite,
    configure_deepspeed,
    make_accelerator,
    resolve_attn_implementation,
    resolve_mixed_precision,
)
from train.schedule import build_optimizer, build_scheduler
from train.steplog import append_log, mean_loss, truncate_log

log = logging.getLogger(__name__)

HEAD_DIR = "head"
LOG_FILE = "train_log.jsonl"

# ============================================================================ runner side


def run(recipe: Recipe, ctx: StageContext) -> StageResult:
    """Stage `early_exit`: launch the training subprocess, return its headline metrics."""
    if "distill" not in ctx.upstream:
        raise StageFailed("early_exit trains on the distill stage's mix: enable the distill stage")
    return StageResult(metrics=launch_training(recipe, ctx, "train.early_exit"))


# ============================================================================ subprocess side


def main(argv: list[str] | None = None) -> None:
    """`python -m train.early_exit SPEC.json`, started by `accelerate launch` on every process."""
    spec = StageSpec.read((argv or sys.argv[1:])[0])
    setup_process_logging(spec)
    recipe = spec.parsed_recipe
    loop = recipe.early_exit.loop
    cuda = torch.cuda.is_available() and not recipe.launch.cpu
    accelerator = make_accelerator(loop.grad_accum_steps, resolve_mixed_precision(loop.mixed_precision, cuda))
    tracker = tracker_for_spec(spec, accelerator.is_main_process)
    run_training_process(spec, accelerator, tracker, lambda: train_early_exit(spec, accelerator, tracker)[1])


def load_examples(
    distill_dir: Path, tokenizer: Any, split: str, block: EarlyExitConfig
) -> list[dict[str, list[int]]]:
    """Encoded mix rows of every pair; `loss_on: all` puts the labels on the prompt tokens too."""
    from distill.mix import mix_pairs, read_mix

    pairs = mix_pairs(distill_dir)
    if not pairs:
        raise StageFailed(f"early_exit: {distill_dir}/mix holds no pair; did the distill stage write one?")
    rows = []
    for pair in pairs:
        try:
            rows += read_mix(distill_dir, pair, split, block.temperatures)
        except FileNotFoundError as err:
            if split == "train":
                raise StageFailed(f"early_exit: {err}") from err
    examples, dropped = encode_rows(tokenizer, rows, block.loop.max_length)
    if dropped:
        log.info("early_exit: %d %s rows left no response token within max_length", dropped, split)
    if block.loss_on == "all":
        examples = [{**e, "labels": list(e["input_ids"])} for e in examples]
    return examples


def train_early_exit(
    spec: StageSpec, accelerator: Any, tracker: Any
) -> tuple[EarlyExitDrafter, dict[str, Any]]:
    """Build the drafter, train its head, write `head/`; returns the drafter and the final metrics."""
    from accelerate.utils import set_seed

    recipe, target, work_dir = spec.parsed_recipe, spec.resolved_target, Path(spec.work_dir)
    block = recipe.early_exit
    loop, optim = block.loop, block.optim
    device = accelerator.device
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    distill_dir = Path(spec.upstream["distill"])
    train_examples = load_examples(distill_dir, tokenizer, "train", block)
    eval_examples = load_examples(distill_dir, tokenizer, "eval", block)
    batches = MixBatches(
        train_examples, loop.seed, loop.per_device_batch_size, accelerator.process_index,
        accelerator.num_processes, accelerator.gradient_accumulation_steps, pad_id_of(tokenizer),
    )  # fmt: skip
    if batches.steps_per_epoch == 0:
        raise StageFailed(
            f"early_exit: {len(train_examples)} training examples are fewer than one global batch of "
            f"{batches.global_batch} (per_device_batch_size x processes x grad_accum_steps)"
        )
    total_steps = loop.max_steps or max(1, int(loop.epochs * batches.steps_per_epoch))

    attn = resolve_attn_implementation(loop.attn_implementation, device.type == "cuda")
    frozen_dtype = resolve_dtype(target.dtype, device)
    teacher = None
    if block.loss == "ce+kl":  # the whole target, whose first N layers the drafter then shares
        teacher = load_causal_lm(target.path, target.revision, target.dtype, target.trust_remote_code, device)
        teacher.requires_grad_(False)
        drafter = from_target(
            teacher, block.num_shared_layers, block.num_exit_layers, exit_dtype=torch.float32
        )
        drafter.target_path, drafter.target_revision = target.path, target.revision
    else:
        drafter = build_early_exit(
            target.path, block.num_shared_layers, block.num_exit_layers, revision=target.revision,
            dtype=frozen_dtype, exit_dtype=torch.float32, device=device, attn_implementation=attn,
            trust_remote_code=target.trust_remote_code,
        )  # fmt: skip
    evals = eval_set(
        eval_examples, loop.per_device_batch_size, loop.eval_batches, accelerator, pad_id_of(tokenizer)
    )
    references = eval_reference(
        work_dir, target, [b["input_ids"] for b in evals], accelerator, frozen_dtype, attn
    )

    head = drafter.exit
    if loop.compile:
        head.compile()
    optimizer = build_optimizer(head, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps)
    scheduler = build_scheduler(
        optimizer, total_steps, optim.warmup_ratio, optim.schedule, optim.min_lr_ratio
    )
    configure_deepspeed(accelerator, loop.per_device_batch_size, optim.max_grad_norm)
    prepared, optimizer = accelerator.prepare(head, optimizer)
    prepared.train()
    metrics = fit(
        accelerator, drafter, prepared, optimizer, scheduler, batches, evals, references, tracker,
        block=block, total_steps=total_steps, work_dir=work_dir, quiet=spec.quiet, teacher=teacher,
    )  # fmt: skip

    state = accelerator.get_state_dict(prepared)  # every process: FSDP / ZeRO-3 gather the shards
    if accelerator.is_main_process:
        out, partial = work_dir / HEAD_DIR, work_dir / f"{HEAD_DIR}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_exit_head(drafter, partial, extra={"training": metrics}, state=state)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        shutil.rmtree(work_dir / "checkpoints", ignore_errors=True)  # the head is written: nothing to resume
    accelerator.wait_for_everyone()
    return drafter, metrics


def eval_set(
    examples: list[dict[str, list[int]]], per_device: int, max_batches: int, accelerator: Any, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """This process's held-out batches: every `world`-th batch, `max_batches` at most (0: all), padded
    with masked copies so that every process runs the same number of forward passes."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if max_batches:
        examples = examples[: max_batches * per_device * world]
    chunks = [examples[i : i + per_device] for i in range(0, len(examples), per_device)]
    mine = [collate(chunk, pad_id) for chunk in chunks[rank::world]]
    if chunks and len(mine) < -(-len(chunks) // world):
        dummy = collate(chunks[0][:1], pad_id)
        dummy["labels"].fill_(IGNORE_INDEX)
        mine.append(dummy)
    return mine


def eval_reference(
    work_dir: Path,
    target: Any,
    sequences: list[torch.Tensor],
    accelerator: Any,
    dtype: torch.dtype,
    attn: str,
) -> list[torch.Tensor]:
    """The full target's greedy tokens on this process's held-out batches, streamed once and cached."""
    from models.target_stream import streamed_greedy_tokens

    if not sequences:
        return []
    path = work_dir / f"eval_reference.{accelerator.process_index}-of-{accelerator.num_processes}.pt"
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if [c.shape for c in cached] == [s.shape for s in sequences]:
            return cached
    tokens = streamed_greedy_tokens(
        target.path, sequences, revision=target.revision, dtype=dtype, device=accelerator.device,
        attn_implementation=attn, trust_remote_code=target.trust_remote_code,
    )  # fmt: skip
    torch.save(tokens, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return tokens


def head_forward(
    drafter: EarlyExitDrafter, head: torch.nn.Module, input_ids: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """Logits of the (prepared) exit head on the frozen part's layer-N states; right padding needs no mask."""
    state = drafter.forward_shared(input_ids)
    hidden = state.hidden.to(next(head.parameters()).dtype)
    masks = drafter.exit_masks(state) if drafter.num_exit_layers else None
    logits, _ = head(hidden, state.position_embeddings, masks, None, state.position_ids)
    return logits, state


@torch.no_grad()
def teacher_logits(teacher: torch.nn.Module, drafter: EarlyExitDrafter, state: Any) -> torch.Tensor:
    """The full target's logits, continuing the shared layer-N states through its layers N..L-1."""
    parts = decoder_parts(teacher)
    n = drafter.num_shared_layers
    slots = list(range(n, drafter.num_hidden_layers))
    types = drafter.layer_types[n:]
    masks = attention_masks(teacher.config, state.hidden, None, None, state.position_ids, slots, types)
    hidden = run_layers(
        parts.layers[n:], state.hidden, state.position_embeddings, masks, None, state.position_ids, types
    )
    return parts.lm_head(parts.norm(hidden))


@torch.no_grad()
def evaluate(
    accelerator: Any,
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    evals: list[dict[str, torch.Tensor]],
    references: list[torch.Tensor],
) -> dict[str, float]:
    """Held-out `eval_loss`, `top1_target` (agreement with the full target's greedy tokens), `top1_labels`
    (with the data) and `target_top1_labels` (the target's own agreement with the data)."""
    head.eval()
    device = accelerator.device
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for batch, reference in zip(evals, references, strict=True):
        logits, _ = head_forward(drafter, head, batch["input_ids"].to(device))
        labels = batch["labels"].to(device)
        loss, count = ce_sum(logits, labels)
        predicted, next_labels = logits.argmax(-1)[:, :-1], labels[:, 1:]  # position t predicts t + 1
        reference = reference.to(device)[:, :-1]
        mask = next_labels != IGNORE_INDEX
        sums += torch.stack(
            [
                loss.double(),
                count.double(),
                ((predicted == reference) & mask).sum().double(),
                ((predicted == next_labels) & mask).sum().double(),
                ((reference == next_labels) & mask).sum().double(),
            ]
        )
    loss, count, agree, hits, target_hits = accelerator.reduce(sums, "sum").tolist()
    head.train()
    count = max(count, 1.0)
    return {
        "eval_loss": loss / count,
        "top1_target": agree / count,
        "top1_labels": hits / count,
        "target_top1_labels": target_hits / count,
    }


def fit(
    accelerator: Any,
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    batches: MixBatches,
    evals: list[dict[str, torch.Tensor]],
    references: list[torch.Tensor],
    tracker: Any,
    *,
    block: EarlyExitConfig,
    total_steps: int,
    work_dir: Path,
    quiet: bool,
    teacher: torch.nn.Module | None,
) -> dict[str, Any]:
    """The explicit loop: resume, steps with exact token-mean losses, logs, evals, checkpoints."""
    from tqdm.auto import tqdm

    loop, device = block.loop, accelerator.device
    world, accum, main_process = (
        accelerator.num_processes,
        accelerator.gradient_accumulation_steps,
        accelerator.is_main_process,
    )
    checkpoints, log_path = work_dir / "checkpoints", work_dir / LOG_FILE
    step, last_checkpoint = 0, latest_checkpoint(checkpoints)
    initial: dict[str, float] = {}
    if last_checkpoint is not None:
        state = load_checkpoint(accelerator, last_checkpoint, {"scheduler": scheduler})
        step, initial = state["step"], state["initial_eval"]
        log.info("early_exit: resuming from %s (step %d of %d)", last_checkpoint, step, total_steps)
    elif evals:  # the head as initialised from the target's last layer: the baseline training must beat
        initial = evaluate(accelerator, drafter, head, evals, references)
        if main_process:
            tracker.log({f"eval/{k}": v for k, v in initial.items()}, step=0)
    if main_process:
        truncate_log(log_path, step)
    max_grad_norm = block.optim.max_grad_norm or float("inf")  # 0 disables clipping; the norm is logged
    throughput, window = Throughput(), []
    progress = tqdm(total=total_steps, initial=step, desc="early_exit", disable=quiet or not main_process)
    while step < total_steps:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in batches.micro_batches(step)]
        local = torch.tensor(
            [
                sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ],
            device=device,
        )
        loss_tokens, input_tokens = accelerator.reduce(local, "sum").tolist()
        scale = scale_for_step(loss_tokens, world, accum)
        loss_sum, grad_norm = torch.zeros((), device=device), None
        for batch in micro_batches:
            with accelerator.accumulate(head):
                logits, state = head_forward(drafter, head, batch["input_ids"])
                loss, _ = ce_sum(logits, batch["labels"])
                if teacher is not None:
                    kl = topk_kl_sum(
                        logits, teacher_logits(teacher, drafter, state), batch["labels"], block.kl_top_k
                    )
                    loss = loss + block.kl_weight * kl
                accelerator.backward(loss * scale)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(head.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        step_loss = accelerator.reduce(loss_sum, "sum").item() / max(loss_tokens, 1)
        check_finite(step_loss, step + 1, str(last_checkpoint) if last_checkpoint else None)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1
        throughput.add(input_tokens)
        window.append(step_loss)
        grad_norm_value = float(grad_norm) if grad_norm is not None else float("nan")
        if main_process:
            append_log(log_path, {"step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm_value})
        if step % loop.log_every == 0 or step == total_steps:
            if main_process:
                tracker.log(
                    {
                        "train/loss": sum(window) / len(window),
                        "train/lr": lr,
                        "train/grad_norm": grad_norm_value,
                        "train/tokens_per_s": throughput.rate(),
                    },
                    step=step,
                )
            window = []
        if evals and loop.eval_every and step % loop.eval_every == 0 and step < total_steps:
            metrics = evaluate(accelerator, drafter, head, evals, references)
            if main_process:
                tracker.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        if step % loop.checkpoint_every == 0 or step == total_steps:
            last_checkpoint = save_checkpoint(
                accelerator,
                checkpoints,
                step,
                {"initial_eval": initial},
                loop.keep_checkpoints,
                {"scheduler": scheduler},
            )
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
    progress.close()
    final: dict[str, Any] = {"steps": step, "train_loss": mean_loss(log_path, loop.log_every)}
    final.update({f"initial_{k}": v for k, v in initial.items()})
    if evals:
        metrics = evaluate(accelerator, drafter, head, evals, references)
        if main_process:
            tracker.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        final.update(metrics)
    if device.type == "cuda":
        final["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return final


if __name__ == "__main__":
    main()
