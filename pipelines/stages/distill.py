"""The distill stage: the target answers the recipe's prompts at several temperatures (seed 003 App.
F.2, seed 001 §3.2), and the answers plus some open-source rows become the `mix` the trainers read.

Work dir layout:
- `plan.json`, `prompts.jsonl`: what this shard has to generate (the merge step checks against them)
- `records/*.jsonl`: one record per (prompt id, temperature, sample index), append-only (`store.py`)
- `engines/`: the settings, requests, logs and results of the engine processes (`distill_engines.py`: the
  vllm backend's, and the hf backend's with `distill.hf.processes`)
- `failures.jsonl`: the records still missing after a run, with the reason (only after a failure)
- `mix/<pair>/{train,eval}.jsonl`: the trainers' input (`mix.py`)
A rerun in the same work dir (`polydraft run RECIPE --only distill`) generates only the missing keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from polydraft.data.prompts import answer_stop_ids, encode_prompt
from polydraft.data.sources import SourceError, read_source
from polydraft.distill.openai_backend import ServerSettings, generate_openai
from polydraft.distill.outcome import (
    NOT_REACHED,
    DistillMetrics,
    build_mix,
    choose_open_rows,
    record_stats,
    write_failures,
)
from polydraft.distill.requests import (
    PromptItem,
    Request,
    open_rows,
    pending_requests,
    prompt_items,
    record_id,
    sample_slots,
    shard_of,
)
from polydraft.distill.store import RecordStore, RecordWriter, StoreError
from polydraft.models.loading import load_tokenizer
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult
from polydraft.pipelines.schema.common import SourceConfig, reader_args
from polydraft.pipelines.schema.inputs import DistillInputs
from polydraft.pipelines.stages.distill_engines import generate_with_engines, generate_with_hf_processes

log = logging.getLogger(__name__)

OPERATIONAL_FIELDS = {
    "enabled",
    "batch_size",
    "records_per_file",
    "open_fraction",
    "eval_fraction",
    "hf",
    "shard_index",
}
"""Distill fields that do not change what is generated: a rerun may change them and still resume.
(`shard_index` is left out so that all shards of one distillation share the fingerprint; the plan
records it separately.)"""
OPERATIONAL_SUBFIELDS = {
    "vllm": {
        "gpu_memory_utilization",
        "submit_size",
        "tensor_parallel_size",
        "cpu_kv_cache_gib",
        "data_parallel",
    },
    "openai": {
        "base_urls",
        "api_key_env",
        "max_in_flight",
        "request_timeout",
        "max_retries",
        "backoff",
        "max_backoff",
        "give_up_after",
    },
}


def fingerprint(inputs: DistillInputs) -> str:
    """Hash of everything that decides which records exist and what they hold."""
    distill = inputs.distill.model_dump(mode="json", exclude=OPERATIONAL_FIELDS)
    for block, fields in OPERATIONAL_SUBFIELDS.items():
        distill[block] = {k: v for k, v in distill[block].items() if k not in fields}
    offline = inputs.offline.model_dump(mode="json") if inputs.offline is not None else None
    relevant = {
        "distill": distill,
        "sources": [s.model_dump(mode="json") for s in inputs.sources],
        "seed": inputs.data_seed,
        "offline": offline,
        "target": [inputs.target.path, inputs.target.revision, inputs.target.dtype],
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def context_limit(inputs: DistillInputs) -> int | None:
    """Longest prompt + answer the local engine can hold (hf: the model's positions; vllm: max_model_len)."""
    cfg, target = inputs.distill, inputs.target
    if cfg.backend == "vllm" and cfg.vllm.max_model_len is not None:
        return cfg.vllm.max_model_len
    if cfg.backend == "openai":
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        target.path, revision=target.revision, trust_remote_code=target.trust_remote_code
    )
    return getattr(config, "max_position_embeddings", None)


def read(source: SourceConfig, inputs: DistillInputs) -> Any:
    return read_source(**reader_args(source, inputs.data_seed, inputs.offline))


def collect_prompts(
    inputs: DistillInputs, tokenizer: Any, limit: int | None
) -> tuple[list[PromptItem], dict[str, int]]:
    """Prompt items of this shard, after invalid rows and over-long prompts (`limit`: the engine's
    context) are counted and dropped."""
    cfg = inputs.distill
    if not inputs.sources:
        raise StageFailed(
            "distill: data.distill lists no prompt source; add one (translation, chat, prompts or text)"
        )
    items: list[PromptItem] = []
    counts = {"invalid_rows": 0, "long_prompts": 0}
    seen: set[str] = set()
    for index, source in enumerate(inputs.sources):
        try:
            rows = read(source, inputs)
            found, invalid = prompt_items(
                rows,
                source.format,
                index,
                cfg.prompt_format,
                tokenizer,
                source.skip_invalid,
                seen,
                cfg.text_prompt_tokens,
            )
        except (SourceError, ValueError) as err:
            raise StageFailed(f"distill: {err}") from err
        if invalid.count:
            log.warning(
                "%s: %d invalid rows counted and skipped (e.g. %s)",
                rows.description,
                invalid.count,
                invalid.examples[0],
            )
        counts["invalid_rows"] += invalid.count
        items += [item for item in found if shard_of(item.id, cfg.num_shards) == cfg.shard_index]
    if tokenizer is not None:
        kept = []
        for item in items:
            item.prompt_ids = encode_prompt(tokenizer, item.prompt)
            too_long = (
                cfg.max_prompt_tokens is not None and len(item.prompt_ids) > cfg.max_prompt_tokens
            ) or (limit is not None and len(item.prompt_ids) >= limit)
            counts["long_prompts"] += too_long
            if not too_long:
                kept.append(item)
        if counts["long_prompts"]:
            log.warning("distill: skipped %d prompts longer than the limit", counts["long_prompts"])
        items = kept
    return items, counts


def collect_open_rows(inputs: DistillInputs, tokenizer: Any) -> list[dict[str, Any]]:
    """Mix rows of the data.open sources (only read when open_fraction > 0)."""
    cfg = inputs.distill
    if cfg.open_fraction == 0:
        return []
    if not inputs.open_sources:
        raise StageFailed(f"distill.open_fraction is {cfg.open_fraction} but data.open lists no source")
    rows: list[dict[str, Any]] = []
    for index, source in enumerate(inputs.open_sources):
        try:
            rows += open_rows(read(source, inputs), source.format, index, cfg.prompt_format, tokenizer)
        except (SourceError, ValueError) as err:
            raise StageFailed(f"distill: data.open: {err}") from err
    return rows


def write_plan(work_dir: Path, plan: dict[str, Any], items: list[PromptItem]) -> None:
    """`plan.json` + `prompts.jsonl`; a work dir holding another config's records is refused."""
    path = work_dir / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if (old["fingerprint"], old["shard_index"]) != (plan["fingerprint"], plan["shard_index"]):
            raise StageFailed(
                f"distill: {work_dir} holds records of another distill configuration (fingerprint "
                f"{old['fingerprint']} shard {old['shard_index']}, now {plan['fingerprint']} shard "
                f"{plan['shard_index']}); restore that configuration to resume, "
                f"or delete {work_dir} to start over"
            )
    prompts = work_dir / "prompts.jsonl"
    with open(prompts.with_suffix(".tmp"), "w", encoding="utf-8") as handle:
        for item in items:
            handle.write(
                json.dumps(
                    {"id": item.id, "source": item.source, "pair": item.pair, "prompt": item.prompt},
                    ensure_ascii=False,
                )
                + "\n"
            )
    prompts.with_suffix(".tmp").replace(prompts)
    path.with_suffix(".tmp").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    path.with_suffix(".tmp").replace(path)


def api_key_from_env(variable: str | None) -> str:
    if variable is None:
        return "EMPTY"
    value = os.environ.get(variable)
    if not value:
        raise StageFailed(f"distill.openai.api_key_env names {variable}, which is not set in the environment")
    return value


def generate(
    inputs: DistillInputs,
    ctx: StageContext,
    requests: list[Request],
    writer: RecordWriter,
    tokenizer: Any,
    limit: int | None,
) -> dict[str, int]:
    """Run the recipe's backend over the pending requests; returns backend counters."""
    cfg, target = inputs.distill, inputs.target
    eos, extra = answer_stop_ids(cfg.stop_token_ids, target, tokenizer)
    sampling = {
        "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "stop": cfg.stop,
        "stop_token_ids": eos + extra, "seed": cfg.seed,
    }  # fmt: skip
    if cfg.backend == "hf" and cfg.hf.processes > 1:
        return generate_with_hf_processes(inputs, ctx, requests, writer, sampling, limit)
    if cfg.backend == "hf":
        from polydraft.distill.hf_backend import generate_hf, load_model

        model = load_model(
            target.path, target.revision, target.dtype, target.trust_remote_code, cfg.hf.device
        )
        generate_hf(
            model,
            tokenizer,
            requests,
            batch_size=cfg.batch_size,
            emit=writer.emit,
            max_length=limit,
            **sampling,
        )
        return {}
    if cfg.backend == "vllm":
        return generate_with_engines(inputs, ctx, requests, writer, sampling)
    o = cfg.openai
    settings = ServerSettings(
        base_urls=o.base_urls,
        model=o.model or target.path,
        endpoint=o.endpoint,
        api_key=api_key_from_env(o.api_key_env),
        max_in_flight=o.max_in_flight,
        request_timeout=o.request_timeout,
        max_retries=o.max_retries,
        backoff=o.backoff,
        max_backoff=o.max_backoff,
        give_up_after=o.give_up_after,
        return_token_ids=o.return_token_ids,
    )
    # the server stops at its model's EOS on its own: only the other ids are sent
    sampling["stop_token_ids"] = extra
    stats = generate_openai(requests, settings, emit=writer.emit, fail=writer.fail, **sampling)
    return dict(stats)


def run(inputs: DistillInputs, ctx: StageContext) -> StageResult:
    """Plan, generate what is missing, then check completeness, compute the stats and write the mix."""
    cfg, target = inputs.distill, inputs.target
    started = time.time()
    needs_tokenizer = (
        cfg.backend != "openai"
        or cfg.prompt_format == "chat_template"
        or cfg.max_prompt_tokens is not None
        or any(source.format == "text" for source in inputs.sources)  # prefixes cut in tokens
    )
    tokenizer = (
        load_tokenizer(target.path, target.revision, target.trust_remote_code) if needs_tokenizer else None
    )
    limit = context_limit(inputs) if tokenizer is not None else None
    items, counts = collect_prompts(inputs, tokenizer, limit)
    if not items:
        raise StageFailed(
            f"distill: data.distill yields no prompt for shard {cfg.shard_index} of {cfg.num_shards} "
            f"({counts['invalid_rows']} invalid rows skipped, {counts['long_prompts']} prompts over the "
            "length limit): check the sources' path, split, fields and limit, their skip_invalid, and "
            "distill.max_prompt_tokens"
        )
    # read now: a bad open source fails before hours of generation
    open_candidates = collect_open_rows(inputs, tokenizer)
    slots = sample_slots(cfg.temperatures, cfg.samples_per_prompt)
    expected = {(item.id, t, s) for item in items for t, s in slots}
    model_name = (cfg.openai.model or target.path) if cfg.backend == "openai" else target.path
    plan = {
        "fingerprint": fingerprint(inputs),
        "shard_index": cfg.shard_index,
        "num_shards": cfg.num_shards,
        "temperatures": cfg.temperatures,
        "samples_per_prompt": cfg.samples_per_prompt,
        "prompts": len(items),
        "expected_records": len(expected),
        "backend": cfg.backend,
        "model": model_name,
    }
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    write_plan(ctx.work_dir, plan, items)

    store = RecordStore(ctx.work_dir, cfg.shard_index, cfg.records_per_file)
    try:
        store.repair()
        done = store.keys()
    except StoreError as err:
        raise StageFailed(f"distill: {err}; delete the file to regenerate its records") from err
    stale = done - expected
    if stale:
        example = record_id(next(iter(stale)))
        raise StageFailed(
            f"distill: {len(stale)} records in {store.root} are not in this plan (e.g. {example}); "
            f"delete {ctx.work_dir} to start over"
        )
    requests = pending_requests(items, slots, done)
    todo = sum(len(r.sample_indices) for r in requests)
    log.info(
        "distill: %d prompts, %d records expected, %d already written, %d to generate with %s",
        len(items),
        len(expected),
        len(done),
        todo,
        cfg.backend,
    )
    meta = {"backend": cfg.backend, "model": model_name, "model_revision": target.revision or ""}
    bar = ctx.progress(todo, "generated", "sample")
    writer = RecordWriter(store, meta, cfg.seed, cfg.batch_size, done, bar, ctx.tracker.log)
    generation_started = time.time()
    try:
        backend_stats = generate(inputs, ctx, requests, writer, tokenizer, limit) if requests else {}
    finally:
        writer.flush()
        store.close()
    generation_time = time.time() - generation_started

    missing = expected - writer.done
    if missing:
        path = write_failures(ctx.work_dir, sorted(missing), writer.failures)
        example = writer.failures.get(min(missing), NOT_REACHED)
        ctx.tracker.log({"records": len(expected) - len(missing), "failures": len(missing), **backend_stats})
        raise StageFailed(
            f"distill: {len(missing)} of {len(expected)} records failed (e.g. {example}); "
            f"they are listed in {path}. The {len(expected) - len(missing)} records written are kept: "
            f"rerun `polydraft run RECIPE --only distill` to retry just the failed ones."
        )
    (ctx.work_dir / "failures.jsonl").unlink(missing_ok=True)
    stats = record_stats(ctx.work_dir, cfg.temperatures)
    chosen = choose_open_rows(
        open_candidates,
        stats["records_per_pair"],
        cfg.open_fraction,
        inputs.data_seed,
        cfg.shard_index,
        cfg.num_shards,
    )
    mix = build_mix(ctx.work_dir, chosen, cfg.eval_fraction, inputs.data_seed)
    metrics = DistillMetrics(
        prompts=len(items),
        records=len(expected),
        records_per_temperature=stats["per_temperature"],
        records_per_pair=stats["records_per_pair"],
        failures=0,
        empty_responses=stats["empty"],
        truncated_responses=stats["truncated"],
        prompt_tokens=stats["prompt_tokens"],
        response_tokens=stats["response_tokens"],
        generated_this_run=writer.written,
        wall_time_s=round(time.time() - started, 3),
        tokens_per_s=round(writer.response_tokens / generation_time, 2) if writer.written else 0.0,
        invalid_rows=counts["invalid_rows"],
        long_prompts=counts["long_prompts"],
        mix=mix,
        mix_open_rows=len(chosen),
        server=backend_stats,
    ).model_dump()
    ctx.tracker.log(metrics)
    return StageResult(metrics=metrics)
