"""The EAGLE-3 trainer: a head on the frozen target's features, trained by training-time test (arXiv
2503.01840 §3).

Each micro-batch first runs the whole target forward without autograd, keeping the states entering the
head's feature layers and the final hidden states (`models.eagle3.feature_capture`): nothing is stored
between steps (the "online" mode of the reference and of SpecForge). Then the head is unrolled for
`ttt_steps` steps (`Unroll`):

- step 0 reads, at each position i, the target's feature g_i and the token x_{i+1};
- step j > 0 reads its own output of step j - 1 at i and the token x_{i+j+1}, and attends to step 0's keys
  at positions <= i and to its own earlier steps' keys at i: what the j-th draft step of a round sees at
  inference (the committed prefix read with true features, then the chain's own steps);
- step j at i is trained towards the target's distribution at position i + j + 1 (the one that predicts
  x_{i+j+2}); steps j > 0 run only where some of them carries loss (`Unroll`).

Positions: the reference implementations keep step 0's position ids at every step; here step j's queries
and keys sit at i + j, where vLLM's proposer and `decoding.eagle3` put the j-th draft step, so the head
learns the relative positions it drafts with.

Loss, per step: the forward KL from the target's distribution restricted to the draft vocabulary (and
renormalised) to the head's, on rows whose next token x_{i+j+2} is a response token and whose target
argmax lies inside the draft vocabulary (a token the head cannot propose teaches it nothing). Each step's
KL is a token mean over the optimizer step's global batch (its rows with a response label; rows masked
for their argmax add nothing), weighted `step_decay ** j`, as the heads trainer weighs its heads. The lm
head projects `chunk_tokens` rows at a time under activation checkpointing (`train.chunked_loss`'s way);
unchunked under FSDP / ZeRO-3, inside the prepared module's forward.

The stage entry point is `pipelines.stages.eagle3`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from polydraft.models.decoder_layers import cache_kwargs
from polydraft.models.eagle3 import Eagle3Head, feature_capture
from polydraft.train.chunked_loss import OutputHead, model_head
from polydraft.train.data import MixBatches, collate
from polydraft.train.loop import HeldOut, LoopResult, LoopSettings, TrainJob, run_with_evals
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.runtime import loss_chunking, unwrap
from polydraft.train.stage_metrics import Eagle3Eval, Eagle3StepScore
from polydraft.train.step import StepStats, token_counts, train_step


@dataclass(frozen=True)
class Eagle3Settings:
    """The training-time test, as plain values."""

    ttt_steps: int
    step_decay: float

    def weights(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(
            [self.step_decay**j for j in range(self.ttt_steps)], dtype=torch.float64, device=device
        )


# ----------------------------------------------------------------------------- the unrolled head


def ttt_mask(slots: torch.Tensor, length: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, M, length + step M] of step `step`'s queries, which sit at the positions
    `slots` [B, M] of each row, over the keys of steps 0..step: step 0's at every position up to the
    query's own, each later step's (computed at the same slots) at the same slot only."""
    keys = torch.arange(length, device=slots.device)
    allowed = [keys.view(1, 1, -1) <= slots.unsqueeze(-1)]
    same = torch.eye(slots.shape[1], dtype=torch.bool, device=slots.device).expand(slots.shape[0], -1, -1)
    allowed = torch.cat(allowed + [same] * step, dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=slots.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def step_rows(labels: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] bool: the positions i where step `step` carries loss, those whose token i + step + 2 is a
    response token."""
    valid = torch.zeros_like(labels, dtype=torch.bool)
    valid[:, : max(0, labels.shape[1] - step - 2)] = labels[:, step + 2 :] != IGNORE_INDEX
    return valid


def packed_slots(wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B, M], filled [B, M]) for `wanted` [B, T] bool, M its most positions in a row (at least 1:
    every process of a run calls the head as often, whatever its batch): each row's wanted positions in
    order, then other positions of the row (`filled` False) up to M."""
    order = torch.sort((~wanted).to(torch.int8), dim=1, stable=True).indices
    width = max(1, int(wanted.sum(1).max()))
    filled = torch.arange(width, device=wanted.device) < wanted.sum(1, keepdim=True)
    return order[:, :width], filled


class Unroll(nn.Module):
    """The head unrolled for the training-time test: the one module accelerate prepares.

    Step 0 runs over every position: its keys are the committed prefix every later step reads. A later
    step at position i reads only step 0's keys and its own chain at i, so steps 1.. run only at the positions
    some step from 1 on trains (those before an answer token, about a third of a demo row), packed per row:
    the same outputs at those positions as steps over every position, for a fraction of the work."""

    def __init__(self, head: Eagle3Head, steps: int) -> None:
        super().__init__()
        self.head, self.steps = head, steps

    def forward(
        self, features: torch.Tensor, embeds: torch.Tensor, rows: list[torch.Tensor], project: bool
    ) -> list[torch.Tensor]:
        """Per step, the rows `rows[j]` [B, T] select: the head's final-norm outputs [N_j, H], or with
        `project` its draft logits [N_j, V_draft]."""
        batch, length, width = embeds.shape
        hidden = self.head.project(features)
        cache = DynamicCache()
        # the token after each position's input, j + 1 ahead at step j (past the end: zeros, no loss there)
        ahead = torch.cat([embeds, embeds.new_zeros(batch, self.steps, width)], 1)
        slots = torch.arange(length, device=embeds.device).expand(batch, -1)
        hidden = self._step(0, hidden, ahead, slots, length, cache)
        out = [self._emitted(hidden[rows[0]], project)]
        if self.steps == 1:
            return out
        slots, filled = packed_slots(torch.stack(rows[1:]).any(0))
        hidden = hidden.gather(1, slots.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        for j in range(1, self.steps):
            hidden = self._step(j, hidden, ahead, slots, length, cache)
            out.append(self._emitted(hidden[rows[j].gather(1, slots) & filled], project))
        return out

    def _step(
        self, j: int, hidden: torch.Tensor, ahead: torch.Tensor, slots: torch.Tensor, length: int, cache: Any
    ) -> torch.Tensor:
        """Step j at the positions `slots` [B, M]: the token j + 1 ahead of each, at position i + j."""
        tokens = ahead.gather(1, (slots + j + 1).unsqueeze(-1).expand(-1, -1, ahead.shape[-1]))
        return self.head(tokens, hidden, slots + j, ttt_mask(slots, length, j, hidden.dtype), cache)

    def _emitted(self, outputs: torch.Tensor, project: bool) -> torch.Tensor:
        normed = self.head.normed(outputs)
        return self.head.lm_head(normed) if project else normed


# ----------------------------------------------------------------------------- the loss


@torch.no_grad()
def target_pass(
    target: nn.Module, batch: dict[str, torch.Tensor], aux_layers: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, T, 3H], final hidden states [B, T, H], token embeddings [B, T, H]) of the frozen
    target, on the batch's device."""
    ids = batch["input_ids"]
    with feature_capture(target, aux_layers) as states:
        out = target.base_model(input_ids=ids, attention_mask=batch["attention_mask"])
    features = torch.cat(states, dim=-1).to(ids.device)
    embeds = target.get_input_embeddings()(ids.to(target.get_input_embeddings().weight.device))
    return features, out.last_hidden_state.to(ids.device), embeds.to(ids.device)


FILL_ROWS = 8
"""Rows a target call of `FeatureCache.fill`: on the demo target (2 CPU cores) 8 rows cost the least per
row, 14.7 ms against 20.3 at a training step's 2 (bench/results/eagle3_step.md)."""


class FeatureCache:
    """The frozen target's outputs per row (features, final hidden states), kept on the CPU up to
    `limit_bytes`: heads trained one after another on the same rows (the multilingual head on every pair's,
    each head's evaluations) run the target once per row. A row is keyed by its token ids. A batch whose rows
    are all kept is assembled from them, padding positions zero: the collated rows are right-padded, so no
    position of a row attends to its padding, and no loss reads it."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit, self.used = limit_bytes, 0
        self.rows: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = self.misses = 0

    @torch.no_grad()
    def fill(
        self,
        target: nn.Module,
        examples: Sequence[dict[str, list[int]]],
        aux_layers: list[int],
        pad_id: int,
        device: torch.device,
    ) -> None:
        """Compute and keep the rows of `examples` not kept yet, `FILL_ROWS` rows of similar length a target
        call: fewer rows per second are lost to per-call work than in a training step's own call. The tokens
        every one of these rows starts with (a chat template's system prompt: 36 of the demo rows' 110-135)
        run through the target once, and each call continues from their cache (`_shared_head`)."""
        todo: dict[bytes, list[int]] = {}
        for example in examples:
            key = torch.tensor(example["input_ids"]).numpy().tobytes()
            if key not in self.rows:
                todo[key] = example["input_ids"]
        ordered = sorted(todo.values(), key=len)
        head = _common_head(ordered)
        shared = _shared_head(target, head, aux_layers, device) if head else None
        for start in range(0, len(ordered), FILL_ROWS):
            if self.used >= self.limit:
                return
            chunk = ordered[start : start + FILL_ROWS]
            if shared is None:
                batch = collate([{"input_ids": ids, "labels": ids} for ids in chunk], pad_id)
                self.target_pass(target, {k: v.to(device) for k, v in batch.items()}, aux_layers)
                continue
            features, last = _after_head(
                target, shared, [ids[len(head) :] for ids in chunk], aux_layers, pad_id
            )
            for ids, row_features, row_last in zip(chunk, features, last, strict=True):
                self._keep(torch.tensor(ids).numpy().tobytes(), row_features, row_last)

    def _keep(self, key: bytes, features: torch.Tensor, last: torch.Tensor) -> None:
        """Keep one row's features [n, 3H] and final hidden states [n, H] while they fit."""
        size = features.numel() * features.element_size() + last.numel() * last.element_size()
        if key not in self.rows and self.used + size <= self.limit:
            self.rows[key] = (features.cpu().clone(), last.cpu().clone())
            self.used += size

    def target_pass(
        self, target: nn.Module, batch: dict[str, torch.Tensor], aux_layers: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`target_pass` of the batch, from the kept rows when every row is kept."""
        ids = batch["input_ids"]
        lengths = batch["attention_mask"].sum(1).tolist()
        keys = [ids[i, :n].cpu().numpy().tobytes() for i, n in enumerate(lengths)]
        if all(key in self.rows for key in keys):
            self.hits += len(keys)
            kept = [self.rows[key] for key in keys]
            features = kept[0][0].new_zeros(ids.shape[0], ids.shape[1], kept[0][0].shape[-1])
            last = kept[0][1].new_zeros(ids.shape[0], ids.shape[1], kept[0][1].shape[-1])
            for i, (n, (row_features, row_last)) in enumerate(zip(lengths, kept, strict=True)):
                features[i, :n], last[i, :n] = row_features, row_last
            embeds = target.get_input_embeddings()(ids.to(target.get_input_embeddings().weight.device))
            return features.to(ids.device), last.to(ids.device), embeds.to(ids.device)
        self.misses += len(keys)
        features, last, embeds = target_pass(target, batch, aux_layers)
        for i, (n, key) in enumerate(zip(lengths, keys, strict=True)):
            self._keep(key, features[i, :n], last[i, :n])
        return features, last, embeds


def _common_head(rows: Sequence[list[int]]) -> list[int]:
    """The tokens every row starts with, each row keeping at least one token after them."""
    return os.path.commonprefix(list(rows))[: min(len(r) for r in rows) - 1] if rows else []


@dataclass
class _Head:
    """The target's pass over the h tokens a chunk of rows starts with: its cache, its features [h, 3H]
    and final states [h, H]."""

    cache: Any
    features: torch.Tensor
    last: torch.Tensor


def _shared_head(target: nn.Module, head: list[int], aux_layers: list[int], device: torch.device) -> _Head:
    ids = torch.tensor([head], device=device)
    cache = DynamicCache(config=target.config)
    with feature_capture(target, aux_layers) as states:
        out = target.base_model(input_ids=ids, use_cache=True, **cache_kwargs(target.base_model, cache))
    features = torch.cat(states, dim=-1)[0].to(device)
    return _Head(cache, features, out.last_hidden_state[0].to(device))


def _after_head(
    target: nn.Module, head: _Head, tails: list[list[int]], aux_layers: list[int], pad_id: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row, the features [n, 3H] and final states [n, H] of the head followed by its tail: the tails
    right-padded in one call that attends to a copy of the head's cache, at positions after it."""
    batch = collate([{"input_ids": t, "labels": t} for t in tails], pad_id)
    device = head.features.device
    ids, tail_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    cache = copy.deepcopy(head.cache)
    cache.batch_repeat_interleave(len(tails))
    length = head.features.shape[0]
    mask = torch.cat([tail_mask.new_ones(len(tails), length), tail_mask], dim=1)
    positions = torch.arange(length, length + ids.shape[1], device=device).expand(len(tails), -1)
    with feature_capture(target, aux_layers) as states:
        out = target.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **cache_kwargs(target.base_model, cache),
        )  # fmt: skip
    features, last = torch.cat(states, dim=-1).to(device), out.last_hidden_state.to(device)
    rows_features, rows_last = [], []
    for i, n in enumerate(tail_mask.sum(1).tolist()):
        rows_features.append(torch.cat([head.features, features[i, :n]]))
        rows_last.append(torch.cat([head.last, last[i, :n]]))
    return rows_features, rows_last


def _chunk_kl(
    rows: torch.Tensor,
    weight: torch.Tensor | None,
    p: torch.Tensor,
    p_log_p: torch.Tensor,
    inside: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL(p || q) over the rows `inside`, q's argmax) of draft logits `rows @ weight.T` (or `rows`
    already logits when `weight` is None); `p_log_p` [N] is sum(p log p) per row, p's negative entropy."""
    logits = (rows if weight is None else F.linear(rows.to(weight.dtype), weight)).float()
    log_q = F.log_softmax(logits, dim=-1)
    kl = p_log_p - (p * log_q).sum(-1)
    return (kl * inside).sum(), log_q.argmax(-1)


def restricted_kl(
    rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    weight: torch.Tensor | None,
    teacher: OutputHead,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL over the rows whose target argmax lies in the draft vocabulary, float64 [3] of (those
    rows, rows whose draft argmax is the target's argmax, rows)). `rows` are the head's normed outputs with
    the lm head's `weight` (projected `chunk_tokens` at a time, recomputed in backward) or, `weight` None,
    its draft logits already; `teacher_rows` the target's final hidden states they are compared with."""
    total = rows.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(3, dtype=torch.float64, device=rows.device)
    if rows.shape[0] == 0:  # a zero that still reaches every trained parameter
        return rows.sum().float() * 0.0 + (weight.sum().float() * 0.0 if weight is not None else 0.0), stats
    chunk = chunk_tokens if weight is not None and chunk_tokens else rows.shape[0]
    for start in range(0, rows.shape[0], chunk):
        end = start + chunk
        with torch.no_grad():
            logits = teacher.logits(teacher_rows[start:end]).float().to(rows.device)
            best = logits.argmax(-1)
            inside = t2d[best]
            # the target's side of the KL, once and outside the checkpoint (its backward recomputes the rest)
            log_p = F.log_softmax(logits[:, draft_ids], dim=-1)
            p = log_p.exp()
            p_log_p = (p * log_p).sum(-1)
        args = (rows[start:end], weight, p, p_log_p, inside)
        if weight is not None:
            kl, guess = checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            kl, guess = _chunk_kl(*args)
        total = total + kl
        hits = draft_ids[guess] == best
        stats += torch.stack(
            [inside.sum(), hits.sum(), torch.tensor(best.numel(), device=rows.device)]
        ).double()
    return total, stats


def ttt_losses(
    unroll: nn.Module,
    bare: Unroll,
    teacher: OutputHead,
    target: nn.Module,
    batch: dict[str, torch.Tensor],
    chunk_tokens: int | None,
    cache: FeatureCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL per step [S] (fp32, with autograd), statistics per step [S, 3] (float64): rows in the
    draft vocabulary, hits, rows) of one batch. `unroll` is the prepared module, `bare` the same unwrapped;
    `cache` keeps the target's outputs of the rows it has seen."""
    head = bare.head
    if cache is None:
        features, last, embeds = target_pass(target, batch, head.aux_layers)
    else:
        features, last, embeds = cache.target_pass(target, batch, head.aux_layers)
    rows = [step_rows(batch["labels"], j) for j in range(bare.steps)]
    chunked = chunk_tokens is not None
    outputs = unroll(features, embeds, rows, project=not chunked)
    weight = head.lm_head.weight if chunked else None
    sums, stats = [], []
    for j, (out, valid) in enumerate(zip(outputs, rows, strict=True)):
        # step j at position i is compared with the target at i + j + 1
        teacher_rows = last[:, j + 1 :][valid[:, : last.shape[1] - j - 1]]
        kl, counts = restricted_kl(out, teacher_rows, weight, teacher, head.draft_ids, head.t2d, chunk_tokens)
        sums.append(kl)
        stats.append(counts)
    return torch.stack(sums), torch.stack(stats)


def step_row_counts(labels: torch.Tensor, steps: int) -> torch.Tensor:
    """Rows carrying loss at each step [S] (float64)."""
    return torch.stack([step_rows(labels, j).sum() for j in range(steps)]).double()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    accelerator: Any,
    target: nn.Module,
    unroll: nn.Module,
    evals: list[dict[str, torch.Tensor]],
    settings: Eagle3Settings,
    cache: FeatureCache | None = None,
) -> Eagle3Eval:
    """Held-out KL, top-1 agreement with the target's greedy token and draft-vocabulary share, per step."""
    unroll.eval()
    bare = unwrap(accelerator, unroll)
    teacher = model_head(target.get_output_embeddings(), target.config)
    device = accelerator.device
    totals = torch.zeros(settings.ttt_steps, 4, dtype=torch.float64, device=device)
    for batch in evals:
        batch = {k: v.to(device) for k, v in batch.items()}
        sums, stats = ttt_losses(unroll, bare, teacher, target, batch, None, cache)
        totals += torch.cat([sums.double().unsqueeze(1), stats], dim=1)
    totals = accelerator.reduce(totals, "sum")
    unroll.train()
    scores = []
    for kl, inside, hits, rows in totals.tolist():
        scores.append(
            Eagle3StepScore(
                kl=kl / max(inside, 1.0), top1=hits / max(rows, 1.0), in_vocab=inside / max(rows, 1.0)
            )
        )
    weights = settings.weights(device).tolist()
    expected, reach = 0.0, 1.0
    for score in scores:
        reach *= score.top1
        expected += reach
    return Eagle3Eval(
        eval_loss=sum(w * s.kl for w, s in zip(weights, scores, strict=True)) / sum(weights),
        steps=scores,
        expected_accepted=expected,
    )


def eval_log(metrics: Eagle3Eval) -> dict[str, float]:
    out = {"eval/loss": metrics.eval_loss, "eval/expected_accepted": metrics.expected_accepted}
    for j, score in enumerate(metrics.steps):
        out |= {f"eval/step{j}_{k}": v for k, v in score.model_dump().items()}
    return out


# ----------------------------------------------------------------------------- training


def fit(
    accelerator: Any,
    target: nn.Module,
    unroll: nn.Module,
    optimization: tuple[Any, Any, float],
    batches: MixBatches,
    evals: list[dict[str, torch.Tensor]],
    loop: LoopSettings,
    settings: Eagle3Settings,
    job: TrainJob,
    cache: FeatureCache | None = None,
) -> tuple[LoopResult, Eagle3Eval | None, Eagle3Eval | None]:
    """Train one head through the shared loop (`train.loop.run_with_evals`). `optimization`: (optimizer,
    scheduler, max_grad_norm); `cache` (FeatureCache) keeps the target's outputs across heads. Returns the
    loop's result and the held-out metrics of the initial and final head."""
    optimizer, scheduler, max_grad_norm = optimization
    device, main_process = accelerator.device, accelerator.is_main_process
    bare = unwrap(accelerator, unroll)
    teacher = model_head(target.get_output_embeddings(), target.config)
    weights = settings.weights(device)
    chunk_tokens = loss_chunking(accelerator, loop.loss_chunk_tokens)
    current: dict[str, torch.Tensor] = {}

    def loss_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        sums, _ = ttt_losses(unroll, bare, teacher, target, batch, chunk_tokens, cache)
        current["sums"] = current["sums"] + sums.detach().double()
        return (sums * current["factors"].to(sums.dtype)).sum()

    def one_step(step: int) -> StepStats:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in batches.micro_batches(step)]
        step_tokens, _ = token_counts(micro_batches, accelerator)
        local = sum(step_row_counts(b["labels"], settings.ttt_steps) for b in micro_batches)
        rows = accelerator.reduce(local, "sum")
        # train_step divides every loss sum by `step_tokens`: this makes step j's a decay^j-weighted share
        # of its own row mean (a step with no row in the batch gets no loss)
        current["factors"] = torch.where(rows > 0, weights * step_tokens / rows.clamp(min=1), 0.0)
        current["sums"] = torch.zeros(settings.ttt_steps, dtype=torch.float64, device=device)
        stats = train_step(accelerator, unroll, optimizer, scheduler, micro_batches, loss_sum, max_grad_norm)
        done = step + 1
        if done % loop.log_every == 0 or done == loop.total_steps:  # every process joins the reduction
            kls = (accelerator.reduce(current["sums"], "sum") / rows.clamp(min=1)).tolist()
            if main_process:
                metrics = {f"{job.prefix}train/step{j}_kl": kl for j, kl in enumerate(kls)}
                job.tracker.log(metrics, step=job.step_offset + done, echo=False)
        return stats

    held_out = None
    if evals:
        held_out = HeldOut(
            lambda: evaluate(accelerator, target, unroll, evals, settings, cache), eval_log, Eagle3Eval
        )
    # the target runs forward only, the head forward and backward once per unrolled step
    frozen = sum(p.numel() for p in target.parameters())
    trained = sum(p.numel() for p in bare.parameters())
    flops = 2.0 * frozen + 6.0 * settings.ttt_steps * trained
    return run_with_evals(accelerator, loop, job, scheduler, one_step, held_out, flops, batches.epoch)
