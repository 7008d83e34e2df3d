"""Stage `eagle3`: one EAGLE-3 head per language pair (and one on their balanced union with
`eagle3.multilingual`), trained on the distill stage's mix with the frozen target's features.

Runner side: `run` launches `main` through `accelerate launch` for the heads an earlier, interrupted run
did not finish. Subprocess side: `train_heads` loads the whole target once (bf16 on a GPU, one copy per
process), and for each head picks its draft vocabulary from the pair's self-distilled answers
(`models.draft_vocab`), builds it (`models.eagle3.head_for_target`) and trains it (`train.eagle3.fit`).
Output per head: `<pair>/` in the speculators format vLLM's `eagle3` method loads, with polydraft's
`eagle3.json`; `<pair>.metrics.json` once it is written (the head is done); while it trains
`<pair>.checkpoints/` and `<pair>.train_log.jsonl`.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from polydraft.data.mix import mix_path, read_mix
from polydraft.data.prompts import MULTILINGUAL
from polydraft.models.draft_vocab import always_kept, count_tokens, coverage, draft_vocabulary
from polydraft.models.eagle3 import (
    aux_layers_problem,
    default_aux_layers,
    head_for_target,
    read_info,
    save_eagle3,
)
from polydraft.models.loading import load_tokenizer
from polydraft.models.placement import load_target, process_device
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import loop_settings, optim_settings, training_main
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.inputs import Eagle3Inputs
from polydraft.pipelines.stages.mix_training import (
    MIX_CACHE,
    pair_jobs,
    peak_memory_gib,
    read_metrics,
    sized_batches,
    unfinished,
    write_metrics,
    write_output,
)
from polydraft.train.data import pad_id_of
from polydraft.train.eagle3 import Eagle3Settings, FeatureCache, Unroll, fit
from polydraft.train.evaluation import eval_set
from polydraft.train.loop import TrainJob
from polydraft.train.mix_cache import MixExamples, balanced_union, load_examples
from polydraft.train.runtime import prepare_for_training, unwrap
from polydraft.train.stage_metrics import DraftVocab, Eagle3HeadMetrics, Eagle3Metrics, Launched

log = logging.getLogger(__name__)


def run(inputs: Eagle3Inputs, ctx: StageContext) -> StageResult:
    """Launch one training subprocess for the heads still to train; return the metrics of every one."""
    jobs = head_names(inputs)
    todo = unfinished("eagle3", inputs, ctx, jobs)
    launched = Launched()
    aux_layers = None
    if todo is not None:
        metrics = launch_training(todo, inputs.launch, ctx, "polydraft.pipelines.stages.eagle3")
        launched = Launched.model_validate({k: metrics[k] for k in ("distributed_type", "num_processes")})
        aux_layers = metrics["aux_layers"]
    heads = {job: read_metrics(ctx.work_dir, job, Eagle3HeadMetrics) for job in jobs}
    if aux_layers is None:  # every head was done before: the layers they were trained on
        aux_layers = read_info(ctx.work_dir / jobs[0])["aux_layers"]
    result = Eagle3Metrics(heads=heads, aux_layers=aux_layers, **launched.model_dump())
    return StageResult(metrics=result.model_dump())


def head_names(inputs: Eagle3Inputs) -> list[str]:
    return pair_jobs(inputs.pairs, inputs.eagle3.multilingual)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.eagle3 SPEC.json`, started by `accelerate launch` on every process."""
    training_main(argv, Eagle3Inputs, lambda inputs: inputs.eagle3.loop, train_heads)


# ----------------------------------------------------------------------------- draft vocabularies


def answer_counts(
    distill_dir: Path, pair: str, split: str, tokenizer: Any, temperatures: list[float] | None
) -> Counter[int]:
    """Token counts of the pair's self-distilled answers in `split` (each answer with its EOS, as the
    trainers encode it); empty when the pair has no such split."""
    if not mix_path(distill_dir, pair, split).is_file():
        return Counter()
    rows = [r for r in read_mix(distill_dir, pair, split, temperatures) if r["origin"] == "distill"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encoded = tokenizer([r["response"] for r in rows], add_special_tokens=False).input_ids if rows else []
    return count_tokens(ids + eos for ids in encoded)


def choose_vocab(
    train: dict[str, Counter[int]], heldout: dict[str, Counter[int]], size: int, tokenizer: Any, vocab: int
) -> tuple[list[int], DraftVocab]:
    """The draft vocabulary of a head trained on the pairs of `train` (one pair, or every pair's
    frequencies weighted equally) and its record."""
    if len(train) == 1:
        (weighted,) = train.values()
    else:  # each pair's relative frequencies: a pair with longer or more answers does not crowd out another
        weighted = Counter()
        for counts in train.values():
            total = sum(counts.values()) or 1
            weighted.update({token: n / total for token, n in counts.items()})
    kept = always_kept(tokenizer)
    ids = draft_vocabulary(weighted, size, kept, vocab)
    union_train, union_heldout = sum(train.values(), Counter()), sum(heldout.values(), Counter())
    record = DraftVocab(
        size=len(ids),
        kept=len(kept),
        answer_tokens=sum(union_train.values()),
        coverage_train=coverage(union_train, ids),
        coverage_heldout=coverage(union_heldout, ids),
    )
    return ids, record


# ----------------------------------------------------------------------------- training


def train_heads(spec: StageSpec, inputs: Eagle3Inputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
    """Train every head of `head_names` not in `inputs.done`; returns the feature layers they read."""
    job = Job(spec, inputs, accelerator, tracker)
    step_offset = 0
    for name in head_names(inputs):
        if name in inputs.done:
            continue
        steps = job.train(name, step_offset)
        step_offset += steps
    return {"aux_layers": job.aux_layers, "peak_memory_gib": peak_memory_gib(accelerator.device)}


class Job:
    """What every head of the stage shares: the frozen target, its tokenizer, the feature layers, the
    pairs' answer counts and encoded mixes."""

    def __init__(self, spec: StageSpec, inputs: Eagle3Inputs, accelerator: Any, tracker: Tracker) -> None:
        self.spec, self.inputs, self.accelerator, self.tracker = spec, inputs, accelerator, tracker
        self.block, target = inputs.eagle3, inputs.target
        self.work_dir, self.distill_dir = Path(spec.work_dir), Path(spec.upstream["distill"])
        self.tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
        self.target = load_target(
            target.path, target.revision, target.dtype, target.trust_remote_code, target.max_memory_per_gpu_gib,
            process_device(accelerator.device, accelerator.num_processes),
        ).requires_grad_(False)  # fmt: skip
        text = self.target.config.get_text_config(decoder=True)
        self.vocab_size = text.vocab_size
        self.aux_layers = list(self.block.aux_layers or default_aux_layers(text.num_hidden_layers))
        problem = aux_layers_problem(self.aux_layers, text.num_hidden_layers)
        if problem:
            raise StageFailed(f"eagle3.aux_layers: {problem}; set eagle3.aux_layers for this target")
        self.counts = {
            split: {
                pair: answer_counts(self.distill_dir, pair, split, self.tokenizer, self.block.temperatures)
                for pair in inputs.pairs
            }
            for split in ("train", "eval")
        }
        self.mixes: dict[str, MixExamples] = {}
        gib = self.block.feature_cache_gib
        self.cache = FeatureCache(int(gib * 2**30)) if gib > 0 else None

    def mix(self, pair: str) -> MixExamples:
        """The pair's encoded training rows (StageFailed naming the pair when there are none)."""
        if pair not in self.mixes:
            try:
                self.mixes[pair] = load_examples(
                    self.distill_dir, self.tokenizer, "train", temperatures=self.block.temperatures,
                    loss_on="response", max_length=self.block.loop.max_length, cache_dir=self.work_dir / MIX_CACHE,
                    main_process_first=self.accelerator.main_process_first, pairs=[pair], need_distilled=True,
                    open_rows=self.block.open_rows,
                )  # fmt: skip
            except FileNotFoundError as err:
                raise StageFailed(f"eagle3: {err}") from err
            except ValueError as err:
                raise StageFailed(
                    f"eagle3 {pair}: {err}; check eagle3.temperatures and that distill answered this pair"
                ) from err
        return self.mixes[pair]

    def held_out(self, pairs: list[str]) -> list[dict[str, list[int]]]:
        """The held-out rows of `pairs` (every temperature; open rows as in training), encoded like the
        training rows."""
        if not any(mix_path(self.distill_dir, pair, "eval").is_file() for pair in pairs):
            return []
        mix = load_examples(
            self.distill_dir, self.tokenizer, "eval", temperatures=None, loss_on="response",
            max_length=self.block.loop.max_length, cache_dir=self.work_dir / MIX_CACHE,
            main_process_first=self.accelerator.main_process_first, pairs=pairs, open_rows=self.block.open_rows,
        )  # fmt: skip
        return mix.examples.to_list()

    def examples(self, name: str, pairs: list[str]) -> Any:
        if name != MULTILINGUAL:
            return self.mix(name).examples
        try:
            union, rows = balanced_union({p: self.mix(p).examples for p in pairs}, self.inputs.data_seed)
        except ValueError as err:
            raise StageFailed(f"eagle3 {MULTILINGUAL}: {err}") from err
        log.info("[eagle3 %s] balanced rows per pair: %s", name, rows)
        return union

    def train(self, name: str, step_offset: int) -> int:
        """Train and save the head `name` (a pair, or `multilingual`); its optimizer steps."""
        from accelerate.utils import set_seed

        block, accelerator, work_dir = self.block, self.accelerator, self.work_dir
        pairs = list(self.inputs.pairs) if name == MULTILINGUAL else [name]
        examples = self.examples(name, pairs)
        draft_ids, vocab = choose_vocab(
            {p: self.counts["train"][p] for p in pairs}, {p: self.counts["eval"][p] for p in pairs},
            block.draft_vocab_size, self.tokenizer, self.vocab_size,
        )  # fmt: skip
        log.info(
            "[eagle3 %s] draft vocabulary of %d tokens: %.1f%% of the held-out answers' tokens",
            name, vocab.size, 100 * (vocab.coverage_heldout or 0.0),
        )  # fmt: skip
        loop, optim, pad_id = block.loop, optim_settings(block.optim), pad_id_of(self.tokenizer)
        batches, total_steps = sized_batches(
            f"eagle3 {name}", examples, self.inputs.data_seed, loop, accelerator, pad_id
        )
        log.info("[eagle3 %s] %d examples, %d steps", name, len(examples), total_steps)
        set_seed(loop.seed)
        head = head_for_target(
            self.target, torch.tensor(draft_ids), self.aux_layers, block.intermediate_size, loop.seed
        )
        unroll, optimizer, scheduler = prepare_for_training(
            Unroll(head, block.ttt_steps),
            optim,
            total_steps,
            loop.per_device_batch_size,
            accelerator,
            loop.compile,
        )
        evals = eval_set(
            self.held_out(pairs), loop.per_device_batch_size, loop.eval_batches, accelerator, pad_id
        )
        if self.cache is not None and accelerator.num_processes == 1:  # a process of several reads a share
            self.cache.fill(self.target, examples, self.aux_layers, pad_id, accelerator.device)
        job = TrainJob.beside(
            work_dir / name, f"eagle3 {name}", self.tracker, self.spec.quiet, f"{name}/", step_offset
        )
        result, initial, final = fit(
            accelerator, self.target, unroll, (optimizer, scheduler, optim.max_grad_norm), batches, evals,
            loop_settings(loop, total_steps), Eagle3Settings(block.ttt_steps, block.step_decay), job, self.cache,
        )  # fmt: skip
        if self.cache is not None:
            log.info(
                "[eagle3 %s] feature cache: %d rows read, %d computed, %.2f GiB kept",
                name, self.cache.hits, self.cache.misses, self.cache.used / 2**30,
            )  # fmt: skip
        metrics = Eagle3HeadMetrics(
            steps=result.steps, tokens=result.tokens, train_loss=result.train_loss, initial=initial, final=final,
            vocab=vocab,
        )  # fmt: skip
        self.save(name, unroll, metrics)
        write_metrics(accelerator, work_dir, name, metrics)
        accelerator.free_memory()
        return total_steps

    def save(self, name: str, unroll: torch.nn.Module, metrics: Eagle3HeadMetrics) -> None:
        """`<name>/` in the speculators format, with polydraft's `eagle3.json`; the checkpoints go."""
        accelerator, target = self.accelerator, self.inputs.target
        state = accelerator.get_state_dict(unroll)  # every process: FSDP / ZeRO-3 gather the shards
        head = unwrap(accelerator, unroll).head
        info = {
            "format": "polydraft-eagle3/1",
            "pair": name,
            "aux_layers": self.aux_layers,
            "ttt_steps": self.block.ttt_steps,
            "target": {"path": target.path, "revision": target.revision},
            "training": metrics.model_dump(),
        }

        def write(folder: Path) -> None:
            save_eagle3(
                head, folder, verifier=target.path,
                verifier_architectures=list(self.target.config.architectures or []),
                speculative_tokens=self.block.ttt_steps, info=info,
                state={k.removeprefix("head."): v for k, v in state.items()},
            )  # fmt: skip

        write_output(accelerator, self.work_dir, name, write, checkpoints=f"{name}.checkpoints")


if __name__ == "__main__":
    main()
