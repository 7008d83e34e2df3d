"""`polydraft plan`: per enabled stage, the tokens it generates or trains on, the estimated hours, GPU-hours
and peak memory per GPU on a given cluster, with warnings for idle GPUs and memory that will not fit. Every
constant comes from `pipelines/runtime/cluster.py`; nothing is loaded or run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polydraft.decoding.measurement.eval_inputs import extra_pair
from polydraft.pipelines.runtime.cluster import (
    ANSWER_TOKENS,
    CROSS_PAIR_SPEEDUP,
    DISTILL_PASSES,
    GIB,
    MEMORY_HEADROOM,
    RECORD_BYTES_PER_TOKEN,
    RECORDS_BYTES_PER_S,
    SOURCE_TOKENS,
    SPEC_SPEEDUP,
    TEMPLATE_TOKENS,
    TOKENIZE_BYTES_PER_S,
    VLLM_PREFIX_CACHED,
    Cluster,
    PlanError,
    Shape,
    decode_latency,
    device,
    drafter_size,
    spread,
    target_shape,
    train_memory,
)
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.runtime.launch import resolve_accelerate_config
from polydraft.pipelines.runtime.nodes import processes_per_node
from polydraft.pipelines.schema import Recipe, SourceConfig
from polydraft.pipelines.schema.train import MemoryLoop, TargetLayerLoop
from polydraft.train.mix_cache import PARALLEL_BYTES, TOKENIZE_PROCESSES
from polydraft.train.throughput import train_flops_per_token

SPEC_DECODERS = ("sd", "rsd_c", "rsd_s", "assisted")
"""Measure decoders run once per standalone drafter (and eval set it is measured on)."""
MIX_TRAINED = ("finetune", "early_exit", "heads", "eagle3")
LAUNCHED = ("pretrain", "finetune", "early_exit", "heads", "eagle3", "calibrate")
"""Stages that train in an `accelerate launch` of their own."""
WITH_TARGET = ("early_exit", "heads", "eagle3", "calibrate")
"""Launches that load the frozen target (finetune too with the kd loss)."""
IDLE_WARNING_HOURS = 0.05
"""Idle GPUs are reported for stages that last at least this long (not for a minute of smoke checks)."""


@dataclass
class StagePlan:
    name: str
    tokens: float
    """Tokens generated (distill, measure) or trained on (training stages)."""
    hours: float
    gpus: int
    """GPUs the stage keeps busy."""
    peak_gib: float
    """Estimated peak memory on one of them."""
    note: str = ""
    most_gpus: int | None = None
    """GPUs the stage's work could keep busy at most (export: a copy of the target per folder); None: any
    number. Idle GPUs are reported only up to it."""

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.gpus


@dataclass
class Plan:
    cluster: Cluster
    stages: list[StagePlan] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def hours(self) -> float:
        return sum(s.hours for s in self.stages)


def source_rows(source: SourceConfig, recipe: Recipe, block: str) -> int:
    """Rows a source yields: its `limit`, or the offline corpus's size; PlanError when only reading it
    would tell."""
    if source.limit is not None:
        return source.limit
    if source.kind == "offline":
        train = recipe.data.offline.samples_per_pair
        return train if source.split == "train" else max(1, train // 10)
    raise PlanError(
        f"data.{block} source {source.path or source.kind}: no `limit`, so its size is unknown without "
        f"reading it; set a limit for the plan"
    )


def prompt_tokens(source: SourceConfig, recipe: Recipe) -> int:
    if source.format == "text":
        return recipe.distill.text_prompt_tokens
    return TEMPLATE_TOKENS[recipe.distill.prompt_format] + SOURCE_TOKENS[source.format]


def answer_tokens(source: SourceConfig, max_new_tokens: int) -> int:
    return min(max_new_tokens, ANSWER_TOKENS[source.format])


def training_processes(recipe: Recipe, cluster: Cluster) -> int:
    """Processes `accelerate launch` starts over every node: launch.num_processes on each node (else the
    config file's count per machine) times the nodes."""
    try:
        config_file = resolve_accelerate_config(recipe.launch.accelerate_config)
    except StageFailed as err:
        raise PlanError(str(err)) from err
    return processes_per_node(config_file, recipe.launch.num_processes) * cluster.nodes


def estimate(recipe: Recipe, cluster: Cluster, distill_engines: int | None = None) -> Plan:
    """The plan of every enabled stage. `distill_engines`: vLLM engines running at once on each node (default: the
    recipe's `distill.vllm.data_parallel`, None there meaning every GPU of a node divided by
    `tensor_parallel_size`, as the distill stage does)."""
    plan = Plan(cluster)
    target = target_shape(recipe.target)
    drafter = drafter_size(recipe.pretrain.drafter if recipe.pretrain.enabled else recipe.finetune.drafter,
                           target.vocab)  # fmt: skip
    processes = training_processes(recipe, cluster)
    if processes > cluster.total:
        plan.warnings.append(
            f"launch asks for {processes} training processes but {cluster} has {cluster.total} GPUs"
        )
    train_gpus = min(processes, cluster.total)
    mix_rows, mix_tokens = 0.0, 0.0
    if recipe.distill.enabled:
        stage, mix_rows, mix_tokens = _distill(recipe, cluster, target, distill_engines)
        plan.stages.append(stage)
    if recipe.pretrain.enabled:
        p = recipe.pretrain
        plan.stages.append(
            _train("pretrain", plan, drafter, 0, p.token_budget, p.loop.max_length, p.loop, train_gpus, 0)
        )
    if recipe.finetune.enabled:
        pairs = max(1, len(recipe.data.pairs))
        frozen = target.params() if recipe.finetune.loss == "kd" else 0
        for pair in recipe.data.pairs or ["all"]:
            loop = recipe.finetune.loop
            stage = _train(f"finetune {pair}", plan, drafter, frozen, mix_tokens / pairs * loop.epochs,
                           mix_tokens / max(mix_rows, 1), loop, train_gpus, target.vocab if frozen else 0)  # fmt: skip
            plan.stages.append(stage)
        if recipe.finetune.multilingual:  # the union balanced by pair: about every pair's tokens per epoch
            loop = recipe.finetune.loop
            stage = _train("finetune multilingual", plan, drafter, frozen, mix_tokens * loop.epochs,
                           mix_tokens / max(mix_rows, 1), loop, train_gpus, target.vocab if frozen else 0)  # fmt: skip
            plan.stages.append(stage)
    if recipe.early_exit.enabled:
        e = recipe.early_exit
        exit_shape = Shape(target.hidden, e.num_exit_layers, target.vocab, target.intermediate, target.heads,
                           target.kv_heads, target.head_dim, target.tied)  # fmt: skip
        plan.stages.append(
            _train("early_exit", plan, exit_shape, target.params(e.num_shared_layers),
                   mix_tokens * e.loop.epochs, mix_tokens / max(mix_rows, 1), e.loop, train_gpus, 0,
                   frozen_layers=e.num_shared_layers, frozen_shape=target)
        )  # fmt: skip
    if recipe.heads.enabled:
        h = recipe.heads
        # one LM head per proposal head (their small residual blocks left out)
        heads_shape = Shape(target.hidden, 0, target.vocab * h.num_heads, 0, 1, 1, 1, tied=True)
        plan.stages.append(
            _train("heads", plan, heads_shape, target.params(), mix_tokens * h.loop.epochs,
                   mix_tokens / max(mix_rows, 1), h.loop, train_gpus, 0,
                   frozen_layers=target.layers, frozen_shape=target)
        )  # fmt: skip
    if recipe.eagle3.enabled:
        plan.stages.extend(_eagle3(recipe, plan, target, mix_tokens, mix_rows, train_gpus))
    _tokenizing(plan, mix_tokens)
    if recipe.calibrate.enabled:
        plan.stages.append(_calibrate(recipe, cluster, target, mix_tokens / max(mix_rows, 1)))
    if recipe.measure.enabled:
        plan.stages.append(_measure(recipe, plan, target, drafter))
    if recipe.export.enabled:
        plan.stages.append(_export(recipe, cluster, target))
    _launches(plan, target, recipe.finetune.loss == "kd")
    for stage in plan.stages:
        usable = min(cluster.total, stage.most_gpus or cluster.total)
        if stage.gpus < usable and stage.hours >= IDLE_WARNING_HOURS:
            plan.warnings.append(
                f"{stage.name}: {cluster.total - stage.gpus} of {cluster.total} GPUs idle for {stage.hours:.2f} h"
            )
        if stage.peak_gib > cluster.memory_gib * MEMORY_HEADROOM:
            plan.warnings.append(
                f"{stage.name}: ~{stage.peak_gib:.0f} GiB per GPU will not fit a {cluster.memory_gib} GB "
                f"{cluster.gpu} ({stage.note or 'see the stage'})"
            )
    return plan


def _tokenizing(plan: Plan, mix_tokens: float) -> None:
    """Each stage that trains on the mix first tokenizes it on rank 0 while the other ranks wait
    (`train.mix_cache`): its bytes at TOKENIZE_BYTES_PER_S a process (TOKENIZE_PROCESSES of them for a
    big mix: a GPU node has the cores), added to the stage's first row."""
    mix_bytes = mix_tokens * RECORD_BYTES_PER_TOKEN
    processes = TOKENIZE_PROCESSES if mix_bytes > PARALLEL_BYTES else 1
    hours = mix_bytes / (TOKENIZE_BYTES_PER_S * processes) / 3600
    for name in MIX_TRAINED:
        first = next((s for s in plan.stages if s.name.split(" ")[0] == name), None)
        if first is not None and hours > 0:
            first.hours += hours
            first.note += f" + {hours * 60:.1f} min tokenizing the mix ({processes} process(es) of rank 0)"


def _launches(plan: Plan, target: Shape, kd: bool) -> None:
    """A launch's fixed cost (`Rates.launch_s`) and, where it runs the frozen target, reading the target's
    weights, added to the stage's first row."""
    rates = plan.cluster.rates
    load = target.params() * rates.bytes_per_param / rates.load_bytes_per_s
    for name in LAUNCHED:
        first = next((s for s in plan.stages if s.name.split(" ")[0] == name), None)
        if first is not None:
            loads = name in WITH_TARGET or (name == "finetune" and kd)
            first.hours += (rates.launch_s + load * loads) / 3600


def _engines(recipe: Recipe, cluster: Cluster, given: int | None) -> int:
    tp = recipe.distill.vllm.tensor_parallel_size
    if given is not None:
        return given
    data_parallel = recipe.distill.vllm.data_parallel
    return data_parallel if data_parallel is not None else max(1, cluster.per_node // tp)


def _distill(
    recipe: Recipe, cluster: Cluster, target: Shape, engines: int | None
) -> tuple[StagePlan, float, float]:
    """(the stage, distilled mix rows, their tokens)."""
    d = recipe.distill
    per_prompt = (1 if 0.0 in d.temperatures else 0) + d.samples_per_prompt * sum(
        t > 0 for t in d.temperatures
    )
    generated = prefill = mix_rows = mix_tokens = 0.0
    for source in recipe.data.distill:
        requests = source_rows(source, recipe, "distill") / d.num_shards * per_prompt
        prompt, answer = prompt_tokens(source, recipe), answer_tokens(source, d.max_new_tokens)
        cached = TEMPLATE_TOKENS[d.prompt_format] if VLLM_PREFIX_CACHED and d.backend == "vllm" else 0
        generated += requests * answer
        prefill += requests * (prompt - cached)
        # the mix: each answer and `open_fraction` as many open rows (a source's reference answers)
        mix_rows += requests * (1 + d.open_fraction) * (1 - d.eval_fraction)
        mix_tokens += requests * (1 + d.open_fraction) * (1 - d.eval_fraction) * (prompt + answer)
    flops = 2.0 * target.params() * (generated + prefill)
    weights_gib = target.params() * 2 / GIB
    # besides generating: the prompt and request files, the statistics and the mix over the records
    bookkeeping = (generated + prefill) * RECORD_BYTES_PER_TOKEN * DISTILL_PASSES / RECORDS_BYTES_PER_S
    if d.backend == "openai":
        return (
            StagePlan(
                "distill", generated, bookkeeping / 3600, 0, 0.0, "external servers: generation not estimated"
            ),
            mix_rows,
            mix_tokens,
        )
    if d.backend == "hf":
        # padded batches: every row of a batch decodes as long as its longest answer, max_new_tokens at worst
        padded = (
            2.0
            * target.params()
            * sum(
                source_rows(source, recipe, "distill") / d.num_shards * per_prompt * d.max_new_tokens
                for source in recipe.data.distill
            )
        )
        seconds = (flops - 2.0 * target.params() * generated + padded) / cluster.rates.generate_flops
        seconds += bookkeeping
        seconds += target.params() * cluster.rates.bytes_per_param / cluster.rates.load_bytes_per_s
        return (
            StagePlan(
                "distill",
                generated,
                seconds / 3600,
                1,
                weights_gib * 1.2,
                f"hf generate, 1 {device(cluster)}",
            ),
            mix_rows,
            mix_tokens,
        )
    tp = d.vllm.tensor_parallel_size
    count = _engines(recipe, cluster, engines)
    gpus = count * tp
    if gpus > cluster.per_node:
        raise PlanError(
            f"distill: {count} engines x tensor_parallel_size {tp} exceed the {cluster.per_node} GPUs of a node"
        )
    # as many engines on every node as on node 0 (distill/engines.py)
    rates = cluster.rates
    seconds = (
        flops / (count * tp * cluster.nodes * rates.vllm_flops) + rates.vllm_import_s + rates.vllm_startup_s
    )
    seconds += bookkeeping
    gpus *= cluster.nodes
    # vLLM claims gpu_memory_utilization of each GPU; the weights must leave room for a KV cache in it
    peak = cluster.memory_gib * d.vllm.gpu_memory_utilization
    note = f"vLLM, {count} engine(s) x TP {tp}" + (
        f" on each of {cluster.nodes} nodes" if cluster.nodes > 1 else ""
    )
    if weights_gib / tp > peak * MEMORY_HEADROOM:
        peak = weights_gib / tp
        note += f": {weights_gib:.0f} GiB of weights over {tp} GPU(s)"
    return StagePlan("distill", generated, seconds / 3600, gpus, peak, note), mix_rows, mix_tokens


def _train(
    name: str, plan: Plan, trainable: Shape, frozen: int, tokens: float, row_tokens: float, loop: MemoryLoop,
    gpus: int, kd_vocab: int, frozen_layers: int = 0, frozen_shape: Shape | None = None, passes: float = 1.0,
) -> StagePlan:  # fmt: skip
    """A data-parallel trainer: 6N FLOPs per token for the trainable part, 2N for frozen parameters (times
    the frozen forward `passes` a token), each step paying STEP_OVERHEAD_S on top; memory of one process."""
    length = min(row_tokens, loop.max_length)
    flops_token = train_flops_per_token(
        trainable.matmul_params(), trainable.layers, trainable.hidden, int(length)
    )
    flops_token += 2.0 * frozen * passes
    micro_tokens = loop.per_device_batch_size * length
    rates = plan.cluster.rates
    compute = micro_tokens * flops_token / rates.train_flops
    steps = tokens / (micro_tokens * gpus)  # micro-batches on each process
    if loop.max_steps is not None:  # it wins over epochs
        steps = min(steps, loop.max_steps * loop.grad_accum_steps)
        tokens = steps * micro_tokens * gpus
    busy = compute / (compute + rates.step_overhead_s)
    if busy < 0.5:
        plan.warnings.append(
            f"{name}: a micro-batch of {loop.per_device_batch_size} x ~{length:.0f} tokens keeps the "
            f"{device(plan.cluster)} busy {busy:.0%} of a step (fixed step cost "
            f"{rates.step_overhead_s * 1000:.0f} ms): raise per_device_batch_size"
        )
    layers_hidden = trainable.layers * trainable.hidden + (
        frozen_layers * frozen_shape.hidden if frozen_shape else 0
    )
    checkpointed = isinstance(loop, TargetLayerLoop) and loop.gradient_checkpointing
    memory = train_memory(
        trainable.params(), frozen, int(micro_tokens), layers_hidden, trainable.vocab + kd_vocab,
        logit_tokens=int(min(micro_tokens, loop.loss_chunk_tokens or micro_tokens)),
        checkpointed_hidden=trainable.hidden if checkpointed else None,
    )  # fmt: skip
    hours = steps * (compute + rates.step_overhead_s) / 3600
    return StagePlan(
        name, tokens, hours, gpus, memory / GIB, f"{steps:.0f} steps of {gpus} x {micro_tokens:.0f} tokens"
    )


def _eagle3(
    recipe: Recipe, plan: Plan, target: Shape, mix_tokens: float, mix_rows: float, gpus: int
) -> list[StagePlan]:
    """One trainer per head: the whole frozen target forward over each row (its features), the head's
    layer and draft-vocabulary lm head forward and backward once per unrolled step (counted as
    `ttt_steps` layers and lm heads). With `eagle3.feature_cache_gib`, the share of its rows a process keeps
    (features and final states, 4 hidden sizes a token) runs the target once: in the pair's head's first
    epoch, not in its later ones nor in the multilingual head, which trains after them on the same rows."""
    e, d = recipe.eagle3, recipe.distill
    steps, vocab = e.ttt_steps, min(e.draft_vocab_size, target.vocab)

    # the distilled rows at the temperatures the heads keep (the plan counts no open row)
    def answers(temperatures: list[float]) -> int:
        return (0.0 in temperatures) + d.samples_per_prompt * sum(t > 0 for t in temperatures)

    row_tokens = mix_tokens / max(mix_rows, 1)
    mix_tokens *= answers(list(e.temperatures or d.temperatures)) / max(1, answers(list(d.temperatures)))
    unrolled = Shape(target.hidden, steps, vocab * steps, e.intermediate_size or target.intermediate,
                     target.heads, target.kv_heads, target.head_dim, False)  # fmt: skip
    kept_bytes = mix_tokens / gpus * 4 * target.hidden * plan.cluster.rates.bytes_per_param
    kept = min(1.0, e.feature_cache_gib * GIB / kept_bytes) if kept_bytes else 0.0
    epochs = e.loop.epochs  # the target's forward passes a token: in a pair's head, in the multilingual one
    pair_passes = (min(epochs, 1.0) + max(epochs - 1.0, 0.0) * (1 - kept)) / epochs
    pairs = recipe.data.pairs or ["all"]
    heads = [(pair, mix_tokens / len(pairs), pair_passes) for pair in pairs]
    if e.multilingual:  # the union balanced by pair: about every pair's tokens per epoch
        heads.append(("multilingual", mix_tokens, 1 - kept))
    return [
        _train(f"eagle3 {name}", plan, unrolled, target.params(), tokens * epochs, row_tokens, e.loop, gpus, 0,
               frozen_layers=target.layers, frozen_shape=target, passes=passes)
        for name, tokens, passes in heads
    ]  # fmt: skip


def _calibrate(recipe: Recipe, cluster: Cluster, target: Shape, row_tokens: float) -> StagePlan:
    """One process, per sampled position: the early exit reads the prefix, drafts `draft_length` tokens one
    step at a time (each step its shared and exit layers and its head, a batch-1 forward), then one target
    forward over prefix + drafts (its FLOPs and each layer's fixed cost); the target spread over every GPU
    of a node."""
    c, e = recipe.calibrate, recipe.early_exit
    positions = c.num_positions * (1 + c.heldout_fraction)
    tokens = positions * (row_tokens + c.draft_length)
    seconds = 2.0 * target.params() * tokens / cluster.rates.train_flops
    seconds += positions * target.layers * cluster.rates.layer_s
    exit_drafter = Shape(target.hidden, e.num_shared_layers + e.num_exit_layers, target.vocab, target.intermediate,
                         target.heads, target.kv_heads, target.head_dim, target.tied)  # fmt: skip
    seconds += positions * c.draft_length * decode_latency(exit_drafter, cluster)
    # the early exit's own forward over each prefix, before its first draft
    seconds += positions * row_tokens * 2.0 * exit_drafter.matmul_params() / cluster.rates.train_flops
    seconds += positions * exit_drafter.layers * cluster.rates.layer_s
    weights = target.params() * 2 / GIB
    return StagePlan("calibrate", tokens, seconds / 3600, cluster.per_node, weights / cluster.per_node)


def _measure(recipe: Recipe, plan: Plan, target: Shape, drafter: Shape) -> StagePlan:
    """Batch 1, every method on every prompt of every (eval set, T, seed) group; the groups dealt to one
    process per copy of the target a node's GPUs hold (`measure.processes`), on every node."""
    m = recipe.measure
    cluster = plan.cluster
    languages = len(recipe.data.pairs) if recipe.finetune.enabled else 0
    multilingual = int(recipe.finetune.enabled and recipe.finetune.multilingual)
    paired = [extra_pair(path) for path in m.extra_drafters.values()]
    generic = int(m.include_pretrained and recipe.pretrain.enabled) + paired.count(None) + multilingual
    drafters = languages + generic + len(paired) - paired.count(None)
    per_set = m.num_prompts * (len(m.seeds) if m.disjoint_prompts else 1)
    # decodings per drafter (each chain/tree decoder, sd's other controls and K sweep) and of the target's
    # own early exit (per set and control); Cali-TS's only with a calibration model (`controls_for`)
    fixed, cali, calibrate = "fixed" in m.controls, sum("cali_ts" in c for c in m.controls), recipe.calibrate
    beta = len(m.controls) - fixed - cali
    sd_controls = beta + cali * (calibrate.enabled and calibrate.drafters == "all") + len(m.k_sweep)
    spec = sum(d in SPEC_DECODERS for d in m.decoders) + ("sd" in m.decoders) * sd_controls
    eesd = ("eesd" in m.decoders and recipe.early_exit.enabled) * (fixed + beta + cali * calibrate.enabled)
    # EAGLE-3 heads (a pair's each, and the multilingual one): fixed K, the K sweep, the Beta-TS controls
    head_languages = len(recipe.data.pairs) if recipe.eagle3.enabled and "eagle3" in m.decoders else 0
    head_multilingual = int(head_languages > 0 and recipe.eagle3.multilingual)
    head_methods = fixed + len(m.k_sweep) + beta
    ar_seconds = decode_latency(target, cluster)
    generated = seconds = 0.0
    for source in recipe.data.eval:
        prompts = min(source_rows(source, recipe, "eval"), per_set)
        if prompts < per_set and m.disjoint_prompts:  # otherwise every seed decodes all there are
            plan.warnings.append(
                f"measure: eval source {source.path or source.kind} has {prompts} prompts, fewer than the "
                f"{per_set} that num_prompts x seeds asks for (disjoint_prompts: the stage will stop)"
            )
        # a language drafter or head on its own pair's set (or a set of no pair), a generic or multilingual
        # one anywhere, drafts well; one on another pair's set (cross_pairs) drafts little
        own_pair = source.pair is None or source.pair in recipe.data.pairs
        own_languages = (languages if source.pair is None else min(languages, 1)) if own_pair else 0
        own_heads = (head_languages if source.pair is None else min(head_languages, 1)) if own_pair else 0
        own_paired = len(paired) - paired.count(None) if source.pair is None else paired.count(source.pair)
        well = (
            spec * (generic + own_languages + own_paired)
            + head_methods * (own_heads + head_multilingual)
            + eesd
        )
        cross = 0
        if m.cross_pairs:
            cross = spec * (drafters - generic - own_languages - own_paired)
            cross += head_methods * (head_languages - own_heads)
        per_seed = prompts / (len(m.seeds) if m.disjoint_prompts else 1)
        tokens = per_seed * len(m.seeds) * len(m.temperatures) * answer_tokens(source, m.max_new_tokens)
        generated += tokens * (1 + well + cross)
        seconds += tokens * ar_seconds * (1 + well / SPEC_SPEEDUP + cross / CROSS_PAIR_SPEEDUP)
        # the mixed traffic decodes nothing more: it is composed from these groups' per-prompt results
    # the latency probes: each repeat a target step and, per drafter, head and early exit, a chain round
    # of every draft length up to max_draft_length (a verification each, `decoding.measurement.latency`)
    # each process loads the target and its drafters and probes the latencies before its first group
    rounds = drafters * (spec > 0) + (head_languages + head_multilingual) * (head_methods > 0) + (eesd > 0)
    fixed = m.latency_repeats * (1 + rounds * (m.max_draft_length + 1)) * ar_seconds
    weights = (target.params() + drafters * drafter.params()) * cluster.rates.bytes_per_param
    fixed += weights / cluster.rates.load_bytes_per_s
    gpus, peak = spread(weights * 1.1, cluster)
    per_node = m.processes or max(1, cluster.per_node // gpus)  # one process per copy of the target
    # the (eval set, temperature, seed) groups dealt over every node's processes, a group to one process:
    # the busiest decodes ceil(groups / processes) of them, and processes beyond the groups have none
    groups = len(recipe.data.eval) * len(m.temperatures) * len(m.seeds)
    busy = max(1, min(per_node * cluster.nodes, groups))
    hours = (fixed + seconds / max(groups, 1) * math.ceil(groups / busy)) / 3600
    on_nodes = f" on each of {cluster.nodes} nodes" if cluster.nodes > 1 else ""
    note = (
        f"{per_node} process(es){on_nodes} with a copy of the target on {gpus} {device(cluster)}(s) each, "
        f"{groups} group(s), batch 1, {ar_seconds * 1000:.0f} ms a target step"
    )
    return StagePlan("measure", generated, hours, gpus * busy, peak, note, most_gpus=gpus * groups)


def _export(recipe: Recipe, cluster: Cluster, target: Shape) -> StagePlan:
    """The smoke checks (target alone and with each drafter, greedy, on a few prompts, after a load) on
    one copy of the target; the vLLM check's folders dealt over the copies node 0's GPUs hold
    (`pipelines/export/vllm_check.py`), each copy's subprocess importing vLLM and starting an engine for
    the target alone and one per folder, one after the other."""
    e = recipe.export
    folders = len(recipe.data.pairs) + int(e.include_pretrained and recipe.pretrain.enabled)
    folders += int(recipe.finetune.enabled and recipe.finetune.multilingual)
    if recipe.eagle3.enabled:  # each head's greedy check
        folders += len(recipe.data.pairs) + int(recipe.eagle3.multilingual)
    folders += int(recipe.heads.enabled)
    tokens = folders * e.smoke_prompts * e.smoke_max_new_tokens * 2
    r = cluster.rates
    seconds = tokens * decode_latency(target, cluster)
    seconds += target.params() * r.bytes_per_param / r.load_bytes_per_s
    gpus, peak = spread(target.params() * 2.2, cluster)
    copies = 1
    if e.vllm_check != "off" and folders:
        copies = min(folders, max(1, cluster.per_node // gpus))
        seconds += r.vllm_import_s + (1 + math.ceil(folders / copies)) * r.vllm_startup_s
    note = f"smoke checks, vLLM's on {copies} cop(ies) of the target on {gpus} {device(cluster)}(s) each"
    return StagePlan(
        "export", tokens, seconds / 3600, gpus * copies, peak, note, most_gpus=gpus * max(1, folders)
    )
