"""Held-out evaluation on the distilled mix: loss on the response tokens and top-1 agreement with the
target (on rows the target answered greedily, its own top-1 tokens are the labels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polydraft.train.data import collate, encode_texts
from polydraft.train.losses import IGNORE_INDEX, ce_sum, top1_matches
from polydraft.train.stage_metrics import EvalMetrics


def eval_examples(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> list[dict[str, list[int]]]:
    """Encoded held-out rows. `greedy_labels` keeps the labels of rows distilled at temperature 0 and
    masks the others, which count in the loss but not in the agreement."""
    out = []
    encoded = encode_texts(tokenizer, [(row["prompt"], row["response"]) for row in rows], max_length)
    for row, example in zip(rows, encoded, strict=True):
        if example is not None:
            labels = example["labels"]
            greedy = row["origin"] == "distill" and row["temperature"] == 0.0
            out.append({**example, "greedy_labels": labels if greedy else [IGNORE_INDEX] * len(labels)})
    return out


def read_eval_sets(
    distill_dir: Path | None, pairs: list[str], tokenizer: Any, max_length: int
) -> dict[str, list[dict[str, list[int]]]]:
    """The held-out mix of each pair that has one (all temperatures), by pair."""
    from polydraft.data.mix import mix_path, read_mix

    if distill_dir is None:
        return {}
    evals = {}
    for pair in pairs:
        if mix_path(distill_dir, pair, "eval").is_file():
            examples = eval_examples(tokenizer, read_mix(distill_dir, pair, "eval"), max_length)
            if examples:
                evals[pair] = examples
    return evals


def _batches_of(
    examples: list[dict[str, list[int]]], per_device: int, rank: int, world: int
) -> list[list[dict[str, list[int]]]]:
    """This process's share of the batches, padded with masked copies so every process runs the same
    number of forward passes (sharded models all-gather their weights inside forward)."""
    batches = [examples[i : i + per_device] for i in range(0, len(examples), per_device)]
    mine = batches[rank::world]
    masked = [IGNORE_INDEX] * len(examples[0]["labels"])
    dummy = [{**examples[0], "labels": masked, "greedy_labels": masked}]
    return mine + [dummy] * (-(-len(batches) // world) - len(mine))


@torch.no_grad()
def evaluate(
    accelerator: Any,
    model: torch.nn.Module,
    evals: dict[str, list[dict[str, list[int]]]],
    per_device: int,
    max_batches: int,
    pad_id: int,
) -> dict[str, EvalMetrics]:
    """Held-out loss and top-1 agreement of each eval set, by name, summed over all processes.

    `max_batches` micro-batches per process (0: all). The model goes back to train mode afterwards.
    """
    model.eval()
    device, world = accelerator.device, accelerator.num_processes
    metrics: dict[str, EvalMetrics] = {}
    for name, examples in evals.items():
        if max_batches:
            examples = examples[: max_batches * per_device * world]
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        for rows in _batches_of(examples, per_device, accelerator.process_index, world):
            batch = collate(rows, pad_id)
            greedy = collate(
                [{"input_ids": r["input_ids"], "labels": r["greedy_labels"]} for r in rows], pad_id
            )
            logits = model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits
            loss, count = ce_sum(logits, batch["labels"].to(device))
            matches, greedy_count = top1_matches(logits, greedy["labels"].to(device))
            sums += torch.stack([loss.double(), count.double(), matches.double(), greedy_count.double()])
        loss, count, matches, greedy_count = accelerator.reduce(sums, "sum").tolist()
        metrics[name] = EvalMetrics(
            eval_loss=loss / max(count, 1.0), top1_agreement=matches / greedy_count if greedy_count else None
        )
    model.train()
    return metrics


def eval_log(metrics: dict[str, EvalMetrics]) -> dict[str, float]:
    """Held-out metrics as the tracker logs them: `eval/<set>/<metric>`."""
    return {
        f"eval/{name}/{key}": value
        for name, m in metrics.items()
        for key, value in m.model_dump().items()
        if value is not None
    }


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
