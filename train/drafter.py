"""The drafter trainer: pretrain (P) and finetune (F) of small drafters on the target's vocabulary.

Seed 003 §2.3: a drafter pretrained on generic text (C4, ShareGPT) and then finetuned on the target's
own answers for one language pair drafts far better than one only finetuned. One explicit accelerate
loop serves both stages; they differ only in where the batches come from:
- pretrain: the documents of `data.pretrain` packed into `max_length` sequences, loss on every token,
  until `pretrain.token_budget` tokens are spent (or `loop.epochs` passes over a finite corpus);
- finetune: the distill stage's mix of each pair in `data.pairs`, one drafter per pair, loss on the
  response tokens only, starting from the pretrained drafter (or `finetune.drafter` without pretrain).

Runner side: `run_pretrain` / `run_finetune` launch this module with `accelerate launch` and the
recipe's accelerate config, then read back `metrics.json`. Subprocess side: `main()` trains.

Everything goes into the stage's work dir, which survives a kill: checkpoints (`<job>.checkpoints/`),
the per-step log (`<job>.train_log.jsonl`) and the exported Hugging Face folders (`model/` for pretrain,
`<pair>/` for finetune). A rerun resumes from the last checkpoint with the same data order and RNG
states, so it continues with the same losses as a run that was never interrupted.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from models.drafters import (
    DrafterMismatch,
    build_drafter,
    check_drafter_compatible,
    drafter_tokenizer,
    export_drafter,
    load_drafter,
    target_vocab_size,
)
from models.loading import load_causal_lm, load_tokenizer
from pipelines.schema import DrafterConfig, LoopConfig, OptimConfig, Recipe
from pipelines.stage import (
    ResolvedTarget,
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
from train.data import MixBatches, PackedBatches, encode_rows, pad_id_of, tokenized_documents
from train.evaluation import evaluate, read_eval_sets
from train.losses import IGNORE_INDEX, ce_sum, scale_for_step, topk_kl_sum
from train.metrics import Throughput, matmul_params, mfu, peak_flops, train_flops_per_token
from train.runtime import (
    check_finite,
    configure_deepspeed,
    make_accelerator,
    resolve_attn_implementation,
    resolve_mixed_precision,
    unwrap,
)
from train.schedule import build_optimizer, build_scheduler
from train.steplog import append_log, mean_loss, truncate_log

log = logging.getLogger(__name__)


# ============================================================================ runner side


def run_pretrain(recipe: Recipe, ctx: StageContext) -> StageResult:
    """Stage `pretrain`: launch the training subprocess, return its headline metrics."""
    _preflight(recipe.pretrain.drafter.init, recipe.pretrain.drafter.revision, ctx)
    return _launch(recipe, ctx)


def run_finetune(recipe: Recipe, ctx: StageContext) -> StageResult:
    """Stage `finetune`: one drafter per language pair, launched as one training subprocess.

    Pairs already exported by an earlier, interrupted run are not trained again: only the others are
    launched, and the metrics of all pairs are returned.
    """
    recipe = finetune_defaults(recipe)
    pending = [pair for pair in recipe.data.pairs if not pair_metrics_path(ctx.work_dir, pair).is_file()]
    metrics: dict[str, Any] = {}
    if pending:
        if "pretrain" not in ctx.upstream:
            _preflight(recipe.finetune.drafter.init, recipe.finetune.drafter.revision, ctx)
        update = {"data": recipe.data.model_copy(update={"pairs": pending})}
        launched = _launch(recipe.model_copy(update=update), ctx).metrics
        metrics |= {k: launched[k] for k in ("distributed_type", "num_processes")}
    for pair in recipe.data.pairs:
        metrics.update(json.loads(pair_metrics_path(ctx.work_dir, pair).read_text(encoding="utf-8")))
    return StageResult(metrics=metrics)


def pair_metrics_path(work_dir: Path, pair: str) -> Path:
    """`<pair>.metrics.json`, written once the pair's drafter is exported: the pair is done."""
    return Path(work_dir) / f"{pair}.metrics.json"


def finetune_defaults(recipe: Recipe) -> Recipe:
    """Fill what seed 003 App. F.3 prescribes and the recipe left unset: the learning rate by drafter
    (2e-5 for vicuna-68m, 3e-5 otherwise) and 5 epochs when there is no pretraining (the F baseline)."""
    block = recipe.finetune
    arch = recipe.pretrain.drafter.arch if recipe.pretrain.enabled else block.drafter.arch
    optim, loop = block.optim, block.loop
    if optim.lr is None:
        optim = optim.model_copy(update={"lr": 2e-5 if arch == "vicuna-68m" else 3e-5})
    if not recipe.pretrain.enabled and "epochs" not in loop.model_fields_set:
        loop = loop.model_copy(update={"epochs": 5.0})
    return recipe.model_copy(update={"finetune": block.model_copy(update={"optim": optim, "loop": loop})})


def _preflight(init: str | None, revision: str | None, ctx: StageContext) -> None:
    """A drafter checkpoint with another vocabulary fails here, before any process is launched."""
    if init is not None:
        try:
            check_drafter_init(
                init,
                revision,
                ctx.target,
                load_tokenizer(ctx.target.path, ctx.target.revision, ctx.target.trust_remote_code),
            )
        except DrafterMismatch as err:
            raise StageFailed(f"{ctx.name}: {err}") from err


def _launch(recipe: Recipe, ctx: StageContext) -> StageResult:
    return StageResult(metrics=launch_training(recipe, ctx, "train.drafter"))


# ============================================================================ subprocess side


def main(argv: list[str] | None = None) -> None:
    """`python -m train.drafter SPEC.json`, started by `accelerate launch` on every process."""
    spec = StageSpec.read((argv or sys.argv[1:])[0])
    setup_process_logging(spec)
    if spec.stage not in ("pretrain", "finetune"):
        raise SystemExit(f"train.drafter trains the `pretrain` and `finetune` stages, not {spec.stage!r}")
    recipe = spec.parsed_recipe
    loop = recipe.pretrain.loop if spec.stage == "pretrain" else recipe.finetune.loop
    cuda = torch.cuda.is_available() and not recipe.launch.cpu
    accelerator = make_accelerator(loop.grad_accum_steps, resolve_mixed_precision(loop.mixed_precision, cuda))
    tracker = tracker_for_spec(spec, accelerator.is_main_process)
    stage = pretrain if spec.stage == "pretrain" else finetune
    run_training_process(spec, accelerator, tracker, lambda: stage(spec, recipe, accelerator, tracker))


def initial_drafter(
    drafter: DrafterConfig,
    init: str | None,
    revision: str | None,
    target: ResolvedTarget,
    tokenizer: Any,
    loop: LoopConfig,
    cuda: bool,
) -> torch.nn.Module:
    """The drafter a job starts from: `drafter`'s architecture built on the target's vocabulary, or the
    checkpoint `init` (at `revision`), checked before any weight is read to have the target's vocabulary
    and tokenizer."""
    vocab = target_vocab_size(target.path, target.revision, target.trust_remote_code)
    attn = resolve_attn_implementation(loop.attn_implementation, cuda)
    if init is None:
        return build_drafter(
            drafter.arch,
            vocab,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_id_of(tokenizer),
            max_position_embeddings=max(2048, loop.max_length),
            attn_implementation=attn,
            seed=loop.seed,
            hidden_size=drafter.hidden_size,
            num_layers=drafter.num_layers,
            num_heads=drafter.num_heads,
            num_kv_heads=drafter.num_kv_heads,
            intermediate_size=drafter.intermediate_size,
        )
    check_drafter_init(init, revision, target, tokenizer)
    return load_drafter(init, revision, attn)


def check_drafter_init(init: str, revision: str | None, target: ResolvedTarget, tokenizer: Any) -> None:
    """DrafterMismatch unless checkpoint `init` has the target's vocabulary size and (when it ships a
    tokenizer) the target's tokenizer. Reads configs and tokenizers only, no weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(init, revision=revision)
    check_drafter_compatible(
        int(config.get_text_config().vocab_size),
        target_vocab_size(target.path, target.revision, target.trust_remote_code),
        tokenizer,
        drafter_tokenizer(init, revision),
        drafter_name=f"drafter {init}",
        target_name=f"target {target.path}",
    )


def step_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    teacher: Any | None,
    kd_top_k: int,
    kd_weight: float,
) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch, plus the weighted top-k forward KL to the target (kd)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss, _ = ce_sum(logits, batch["labels"])
    if teacher is not None:
        with torch.no_grad():
            target_logits = teacher(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        loss = loss + kd_weight * topk_kl_sum(logits, target_logits, batch["labels"], kd_top_k)
    return loss


def train_loop(
    accelerator: Any,
    model: torch.nn.Module,
    data: MixBatches | PackedBatches,
    evals: dict[str, list[dict]],
    tracker: Any,
    *,
    name: str,
    optim: OptimConfig,
    loop: LoopConfig,
    total_steps: int,
    job_dir: Path,
    quiet: bool,
    pad_id: int,
    step_offset: int = 0,
    teacher: Any | None = None,
    kd: tuple[int, float] = (0, 0.0),
) -> tuple[torch.nn.Module, dict[str, float]]:
    """Train `model` for `total_steps` optimizer steps, resuming from the last checkpoint under
    `job_dir.checkpoints`; returns the prepared model and the final metrics."""
    from tqdm.auto import tqdm

    main_process, device = accelerator.is_main_process, accelerator.device
    world, accum = accelerator.num_processes, accelerator.gradient_accumulation_steps
    config = model.config
    flops_per_token = train_flops_per_token(
        matmul_params(model), config.num_hidden_layers, config.hidden_size, loop.max_length
    )
    peak = peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    model.to(device)
    if loop.compile:
        model.compile()
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps)
    scheduler = build_scheduler(
        optimizer, total_steps, optim.warmup_ratio, optim.schedule, optim.min_lr_ratio
    )
    configure_deepspeed(accelerator, loop.per_device_batch_size, optim.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    checkpoints = job_dir.with_name(job_dir.name + ".checkpoints")
    log_path = job_dir.with_name(job_dir.name + ".train_log.jsonl")
    step, tokens_seen = 0, 0
    last_checkpoint = latest_checkpoint(checkpoints)
    if last_checkpoint is not None:
        state = load_checkpoint(accelerator, last_checkpoint, {"scheduler": scheduler})
        step, tokens_seen = state["step"], state["tokens"]
        data.restore(state["data"])
        log.info("[%s] resuming from %s (step %d of %d)", name, last_checkpoint, step, total_steps)
    if main_process:
        truncate_log(log_path, step)
    max_grad_norm = optim.max_grad_norm or float("inf")  # 0 disables clipping; the norm is still logged
    throughput, window = Throughput(), []
    progress = tqdm(total=total_steps, initial=step, desc=name, disable=quiet or not main_process)
    while step < total_steps:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in data.micro_batches(step)]
        # the step's global token counts: the loss is the exact mean over its loss-carrying tokens
        local = torch.tensor(
            [
                sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ],
            device=device,
        )
        loss_tokens, input_tokens = accelerator.reduce(local, "sum").tolist()
        scale = scale_for_step(loss_tokens, world, accum)
        loss_sum = torch.zeros((), device=device)
        grad_norm = None
        for batch in micro_batches:
            with accelerator.accumulate(model):
                loss = step_loss(model, batch, teacher, *kd)
                accelerator.backward(loss * scale)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        step_loss_value = accelerator.reduce(loss_sum, "sum").item() / max(loss_tokens, 1)
        check_finite(step_loss_value, step + 1, str(last_checkpoint) if last_checkpoint else None)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1
        tokens_seen += input_tokens
        throughput.add(input_tokens)
        window.append(step_loss_value)
        grad_norm_value = float(grad_norm) if grad_norm is not None else float("nan")
        if main_process:
            append_log(
                log_path,
                {
                    "step": step,
                    "loss": step_loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm_value,
                    "tokens": tokens_seen,
                },
            )
        if step % loop.log_every == 0 or step == total_steps:
            tokens_per_s = throughput.rate()
            metrics = {
                f"{name}/train/loss": sum(window) / len(window),
                f"{name}/train/lr": lr,
                f"{name}/train/grad_norm": grad_norm_value,
                f"{name}/train/tokens_per_s": tokens_per_s,
                f"{name}/train/tokens": tokens_seen,
            }
            utilisation = mfu(tokens_per_s / world, flops_per_token, peak)
            if utilisation is not None:
                metrics[f"{name}/train/mfu"] = utilisation
            window = []
            if main_process:
                tracker.log(metrics, step=step_offset + step)
        if evals and loop.eval_every and step % loop.eval_every == 0 and step < total_steps:
            metrics = evaluate(
                accelerator, model, evals, loop.per_device_batch_size, loop.eval_batches, pad_id
            )
            if main_process:
                tracker.log({f"eval/{k}": v for k, v in metrics.items()}, step=step_offset + step)
        if step % loop.checkpoint_every == 0 or step == total_steps:
            state = {"data": data.state(), "tokens": tokens_seen}
            last_checkpoint = save_checkpoint(
                accelerator, checkpoints, step, state, loop.keep_checkpoints, {"scheduler": scheduler}
            )
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss_value:.4f}")
    progress.close()
    final = {"steps": step, "tokens": tokens_seen, "train_loss": mean_loss(log_path, loop.log_every)}
    if evals:
        final.update(
            evaluate(accelerator, model, evals, loop.per_device_batch_size, loop.eval_batches, pad_id)
        )
    return model, final


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
    loop: LoopConfig,
    token_budget: int,
    global_batch: int,
) -> int:
    """Optimizer steps of pretraining: `max_steps`, else the token budget, capped by `loop.epochs` passes
    over the corpus when no source streams (a stream's length is unknown; it cycles when it ends)."""
    if loop.max_steps is not None:
        return loop.max_steps
    steps = token_budget // (global_batch * loop.max_length)
    if not any(s["kind"] == "hf" and s["streaming"] for s in sources):
        corpus_tokens = sum(
            len(d) + 1 for d in tokenized_documents(tokenizer, sources, seed, 0, 0) if d is not None
        )
        steps = min(steps, int(loop.epochs * corpus_tokens / loop.max_length) // global_batch)
    if steps < 1:
        raise StageFailed(
            f"pretrain: the token budget ({token_budget}) or corpus is smaller than one global batch of "
            f"{global_batch} sequences of {loop.max_length} tokens; raise pretrain.token_budget or lower "
            "the batch size or max_length"
        )
    return steps


def pretrain(spec: StageSpec, recipe: Recipe, accelerator: Any, tracker: Any) -> dict[str, Any]:
    """P: causal-LM training of a fresh (or given) drafter on packed generic text; exports `model/`."""
    from accelerate.utils import set_seed

    block, data = recipe.pretrain, recipe.data
    loop, target, work_dir = block.loop, spec.resolved_target, Path(spec.work_dir)
    if not data.pretrain:
        raise StageFailed(
            "pretrain: data.pretrain lists no corpus (e.g. C4 streaming, ShareGPT, or the offline text)"
        )
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    cuda = accelerator.device.type == "cuda"
    model = initial_drafter(
        block.drafter, block.drafter.init, block.drafter.revision, target, tokenizer, loop, cuda
    )
    sources = [{**s.model_dump(mode="json"), **data.offline.source_options()} for s in data.pretrain]

    def documents(epoch: int, start: int) -> Any:
        return tokenized_documents(tokenizer, sources, data.seed, epoch, start)

    batches = PackedBatches(
        documents,
        loop.max_length,
        tokenizer.eos_token_id,
        loop.per_device_batch_size,
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.gradient_accumulation_steps,
    )
    total_steps = pretrain_steps(
        tokenizer, sources, data.seed, loop, block.token_budget, batches.global_batch
    )
    distill_dir = Path(spec.upstream["distill"]) if "distill" in spec.upstream else None
    evals = read_eval_sets(distill_dir, list(data.pairs), tokenizer, loop.max_length)
    model, metrics = train_loop(
        accelerator, model, batches, evals, tracker, name="pretrain", optim=block.optim, loop=loop,
        total_steps=total_steps, job_dir=work_dir / "model", quiet=spec.quiet, pad_id=pad_id_of(tokenizer),
    )  # fmt: skip
    export(accelerator, model, tokenizer, work_dir / "model")
    return metrics


def finetune(spec: StageSpec, recipe: Recipe, accelerator: Any, tracker: Any) -> dict[str, Any]:
    """F: one drafter per pair on the distilled mix (loss on responses); exports `<pair>/` folders."""
    from accelerate.utils import set_seed

    from distill.mix import read_mix

    block, target, work_dir = recipe.finetune, spec.resolved_target, Path(spec.work_dir)
    loop = block.loop
    if "distill" not in spec.upstream:
        raise StageFailed("finetune trains on the distill stage's mix: enable the distill stage")
    distill_dir = Path(spec.upstream["distill"])
    # from the pretrained drafter (P-F), or from finetune.drafter when there is no pretraining (F)
    if "pretrain" in spec.upstream:
        init, revision = str(Path(spec.upstream["pretrain"]) / "model"), None
    else:
        init, revision = block.drafter.init, block.drafter.revision
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    cuda = accelerator.device.type == "cuda"
    teacher = None
    if block.loss == "kd":  # the frozen target beside the drafter (bf16 on a GPU, fp32 on a CPU)
        teacher = load_causal_lm(
            target.path, target.revision, target.dtype, target.trust_remote_code, accelerator.device
        ).requires_grad_(False)
    summary: dict[str, Any] = {}
    step_offset = 0
    for pair in recipe.data.pairs:
        out_dir = work_dir / pair
        try:
            train_rows = read_mix(distill_dir, pair, "train", block.temperatures)
        except FileNotFoundError as err:
            raise StageFailed(f"finetune: {err}") from err
        examples, dropped = encode_rows(tokenizer, train_rows, loop.max_length)
        batches = MixBatches(
            examples, recipe.data.seed, loop.per_device_batch_size, accelerator.process_index,
            accelerator.num_processes, accelerator.gradient_accumulation_steps, pad_id_of(tokenizer),
        )  # fmt: skip
        if batches.steps_per_epoch == 0:
            raise StageFailed(
                f"finetune {pair}: {len(examples)} training examples are fewer than one global batch of "
                f"{batches.global_batch} (per_device_batch_size x processes x grad_accum_steps)"
            )
        total_steps = loop.max_steps or max(1, int(loop.epochs * batches.steps_per_epoch))
        log.info("[%s] %d examples (%d over max_length), %d steps", pair, len(examples), dropped, total_steps)
        set_seed(loop.seed)
        model = initial_drafter(block.drafter, init, revision, target, tokenizer, loop, cuda)
        evals = read_eval_sets(distill_dir, [pair], tokenizer, loop.max_length)
        model, metrics = train_loop(
            accelerator, model, batches, evals, tracker, name=pair, optim=block.optim, loop=loop,
            total_steps=total_steps, job_dir=out_dir, quiet=spec.quiet, pad_id=pad_id_of(tokenizer),
            step_offset=step_offset, teacher=teacher, kd=(block.kd_top_k, block.kd_weight),
        )  # fmt: skip
        export(accelerator, model, tokenizer, out_dir)
        # eval metrics are already named `<pair>/...`; steps, tokens and train_loss get the prefix
        metrics = {(k if "/" in k else f"{pair}/{k}"): v for k, v in metrics.items()}
        if accelerator.is_main_process:
            pair_metrics_path(work_dir, pair).write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        summary.update(metrics)
        step_offset += total_steps
        accelerator.free_memory()
    return summary


if __name__ == "__main__":
    main()
