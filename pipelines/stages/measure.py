"""Stage `measure`: speculative decoders x eval sets x temperatures x seeds for every drafter of the run.

Drafters are found upstream (`decoding.measurement.eval_inputs.discover_drafters`); for each (eval set, temperature, seed)
group every method decodes the same prompts in one process (`decoding.measurement.groups.measure_group`) and the
group's typed rows are appended to `results.jsonl` (`decoding.measurement.results`), so a killed run resumes with the
groups it has not finished. The groups are dealt to several measure processes when this node's GPUs hold
several copies of the target, and to as many on every other node of the run (`spread_groups`). With
`measure.vllm` the standalone drafters are then measured inside vLLM too (`decoding.measurement.vllm_rows`),
on node 0, rows of engine `vllm` beside polydraft's. Ends with `summary.md` and PNG plots
(`decoding.measurement.tables`).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polydraft.decoding.lattice import CandidateTree
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.eval_inputs import (
    DrafterSource,
    EvalSet,
    discover_drafters,
    repetition_prompts,
)
from polydraft.decoding.measurement.groups import (
    Drafter,
    UnsupportedDecoder,
    eos_ids_of,
    group_rows,
    hardware,
    headline,
    load_drafters,
    measure_group,
)
from polydraft.decoding.measurement.latency import RunLatencies
from polydraft.decoding.measurement.results import (
    RESULTS_FILE,
    ResultRow,
    ResultsError,
    append_rows,
    read_rows,
    write_rows,
)
from polydraft.decoding.measurement.tables import write_report
from polydraft.decoding.measurement.vllm_rows import (
    VllmMeasureFailed,
    measure_subprocess,
    vllm_rows,
    vllm_unavailable,
)
from polydraft.decoding.sampling import Sampling
from polydraft.distill.engines import die_with_parent
from polydraft.distill.node_share import (
    RemoteProcess,
    clear_share,
    remote_processes,
    stopped_on_error,
    wait_all,
    watch_share,
)
from polydraft.models.calibration import check_covers
from polydraft.models.drafters import DrafterMismatch
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec, spec_for
from polydraft.pipelines.runtime.nodes import usable_cores
from polydraft.pipelines.runtime.process import setup_process_logging
from polydraft.pipelines.runtime.target import gpus_per_copy
from polydraft.pipelines.schema import MeasureConfig
from polydraft.pipelines.schema.common import ResolvedTarget
from polydraft.pipelines.schema.inputs import MeasureInputs
from polydraft.pipelines.stages.measure_methods import build_methods, measure_latencies, measured_on
from polydraft.pipelines.stages.measure_mixed import measure_mixed, mixed_summary

log = logging.getLogger("polydraft.pipelines.stages.measure")  # not `__main__` in a measure process

LATENCY_FILE = "latency.json"


@dataclass
class Loaded:
    """What one measure process decodes with: the target, its drafters and the eval sets."""

    target: Any
    target_lm: CachedLM
    eos_ids: list[int]
    eval_sets: list[EvalSet]
    sources: list[DrafterSource]
    drafters: list[Drafter]
    latencies: RunLatencies
    context: dict[str, Any]
    warmed: set[str] = field(default_factory=set)
    """Methods already warmed up (`measure_group`): once per process."""


def load(inputs: MeasureInputs, upstream: dict[str, Path], latency_path: Path) -> Loaded:
    """Load the target, the eval sets and every drafter, and measure the forward latencies into
    `latency_path`; StageFailed on bad input."""
    import transformers

    from polydraft.models.loading import load_tokenizer
    from polydraft.models.placement import input_device, load_target

    cfg, spec = inputs.measure, inputs.target
    target = load_target(
        spec.path, spec.revision, spec.dtype, spec.trust_remote_code, spec.max_memory_per_gpu_gib
    )
    device = input_device(target)  # drafters, prompts and samplers live where the target takes its input
    tokenizer = load_tokenizer(spec.path, spec.revision, spec.trust_remote_code)
    eval_sets = load_eval_sets(inputs, tokenizer)
    try:
        sources = discover_drafters(upstream, cfg.extra_drafters, cfg.include_pretrained)
        for source in sources if "cali_ts" in cfg.controls else ():
            if source.calibration is not None:
                check_covers(source.calibration, cfg.max_draft_length)
        drafters = load_drafters(sources, target, tokenizer, device, cfg.profile)
    except (ValueError, DrafterMismatch) as err:
        raise StageFailed(f"measure: {err}") from err
    try:
        CandidateTree.from_paths(cfg.medusa_tree)
    except ValueError as err:
        raise StageFailed(f"measure.medusa_tree: {err}") from err
    if not drafters:
        log.warning(
            "measure: no drafter found upstream (finetune/pretrain) nor in measure.extra_drafters: only `ar` runs"
        )
    target_lm = CachedLM(target, cfg.profile)
    latencies = measure_latencies(cfg, target_lm, drafters, eval_sets[0].prompts[0])
    latency_path.write_text(json.dumps(latencies.as_json(), indent=2) + "\n", encoding="utf-8")
    context = {
        "target": spec.path,
        "device": device.type,
        "hardware": hardware(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    eos_ids = eos_ids_of(target, tokenizer)
    return Loaded(target, target_lm, eos_ids, eval_sets, sources, drafters, latencies, context)


def load_eval_sets(inputs: MeasureInputs, tokenizer: Any = None) -> list[EvalSet]:
    """The eval sets the groups decode (the target's tokenizer loaded when not given); StageFailed on bad
    input. With disjoint prompts each seed (repetition) decodes its own num_prompts prompts."""
    from polydraft.models.loading import load_tokenizer

    cfg, spec = inputs.measure, inputs.target
    if tokenizer is None:
        tokenizer = load_tokenizer(spec.path, spec.revision, spec.trust_remote_code)
    per_set = cfg.num_prompts * (len(cfg.seeds) if cfg.disjoint_prompts else 1)
    try:
        return inputs.eval.load(per_set, cfg.max_prompt_tokens, tokenizer)
    except ValueError as err:
        raise StageFailed(f"measure: {err}") from err


Group = tuple[str, float, int]
"""(eval set name, temperature, seed): the rows every method of one `measure_group` call gives."""


def all_groups(cfg: MeasureConfig, eval_sets: list[EvalSet]) -> list[Group]:
    return [(s.name, t, seed) for s in eval_sets for t in cfg.temperatures for seed in cfg.seeds]


def measure_groups(
    cfg: MeasureConfig, loaded: Loaded, groups: list[Group], path: Path, tracker: Any = None
) -> list[ResultRow]:
    """Decode `groups` in order, appending each one's rows to `path` when it is done; returns the rows."""
    by_name = {s.name: s for s in loaded.eval_sets}
    out: list[ResultRow] = []
    for name, temperature, seed in groups:
        eval_set = by_name[name]
        sampling = Sampling(temperature, cfg.top_p if temperature > 0 else 1.0)
        build = functools.partial(
            build_methods, cfg, eval_set, sampling, seed, loaded.target, loaded.target_lm, loaded.drafters,
            loaded.eos_ids, loaded.latencies,
        )  # fmt: skip
        try:
            prompts = repetition_prompts(
                eval_set.prompts, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts
            )
            methods = measure_group(build, prompts, loaded.warmed)
        except (UnsupportedDecoder, ValueError) as err:
            raise StageFailed(f"measure: {err}") from err
        loaded.context["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        new_rows = group_rows(
            methods,
            eval_set,
            temperature,
            cfg.top_p,
            seed,
            cfg.max_new_tokens,
            {d.name: d for d in loaded.sources},
            loaded.context,
            loaded.latencies.target.chain[1],
        )
        append_rows(path, new_rows)
        out += new_rows
        if tracker is not None:
            tracker.log(
                {f"{name}/T{temperature}/{r.method}/speedup": r.speedup for r in new_rows if r.speedup}
            )
    return out


def run(inputs: MeasureInputs, ctx: StageContext) -> StageResult:
    """Writes results.jsonl, summary.md and plots into the stage folder."""
    cfg = inputs.measure
    path = ctx.work_dir / RESULTS_FILE
    try:
        rows = read_rows(path)
        rows += [row for part in sorted(ctx.work_dir.glob(PART_GLOB)) for row in read_rows(part)]
    except ResultsError as err:
        raise StageFailed(f"measure: {err}; delete the file to measure again") from err
    write_rows(path, rows)  # drop what an interrupted run left half-written, gather the processes' parts
    for part in ctx.work_dir.glob(PART_GLOB):
        part.unlink()
    done = {row.group for row in rows}
    processes = measure_processes(cfg, inputs.target)
    nodes = ctx.leader.machines.nodes if ctx.leader is not None else 1
    loaded = None
    if processes * nodes == 1:
        loaded = load(inputs, ctx.upstream, ctx.work_dir / LATENCY_FILE)
        todo = [g for g in all_groups(cfg, loaded.eval_sets) if ("polydraft", *g) not in done]
        for group in ctx.track(todo, "measured", "group"):
            rows += measure_groups(cfg, loaded, [group], path, ctx.tracker)
    elif sum(g[0] == "polydraft" for g in done) < len(inputs.eval.sources) * len(cfg.temperatures) * len(
        cfg.seeds
    ):
        rows = spread_groups(inputs, ctx, processes, rows)
    mixed = []
    if cfg.mixed:
        eval_sets = loaded.eval_sets if loaded is not None else load_eval_sets(inputs)
        try:
            mixed = measure_mixed(cfg, eval_sets, rows, ctx.work_dir)
        except ValueError as err:
            raise StageFailed(f"measure: {err}") from err
    if cfg.vllm != "off":
        loaded = loaded or load(inputs, ctx.upstream, ctx.work_dir / "latency.vllm.json")
        loaded.context["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        rows = add_vllm_rows(
            cfg, inputs.target.path, loaded.eval_sets, loaded.drafters, rows, loaded.context, path
        )
    write_report(rows, ctx.work_dir)
    mixed_summary(ctx.work_dir, mixed)
    ctx.tracker.log_table("measure/results", [row.model_dump() for row in rows])
    return StageResult(metrics=headline(rows).model_dump())


# ----------------------------------------------------------------------------- several processes

PART_GLOB = "results.part*.jsonl"
SPEC_FILE = "measure-spec.json"


def measure_processes(cfg: MeasureConfig, target: ResolvedTarget) -> int:
    """Measure processes on each node: `measure.processes`, else one per copy of the target this node's
    GPUs hold (a copy on as few GPUs as it fits, `models.placement`), else 1 (a CPU machine)."""
    if cfg.processes is not None:
        return cfg.processes
    if not torch.cuda.is_available():
        return 1
    return max(1, torch.cuda.device_count() // gpus_per_copy(target))


def _name(rank: int) -> str:
    """Measure process `rank`'s name: its log is `<name>.log`, its exit status on another node
    `<name>.exit` (`distill/node_share.py`)."""
    return f"measure.part{rank}"


def _start(
    spec_path: Path, rank: int, processes: int, local_rank: int, per_node: int, per_copy: int
) -> subprocess.Popen:
    """Start measure process `rank` of `processes` (`main`), the `local_rank`-th of this node's `per_node`:
    on GPUs `local_rank * per_copy` .. of this node (none: the CPU), with its share of the cores, its output
    in `measure.part<rank>.log`, leading a process group of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, usable_cores() // per_node))}
    if per_copy:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(local_rank * per_copy + i) for i in range(per_copy))
    command = [sys.executable, "-m", __name__, str(spec_path), str(rank), str(processes)]
    with (spec_path.parent / f"{_name(rank)}.log").open("ab") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def spread_groups(
    inputs: MeasureInputs, ctx: StageContext, processes: int, rows: list[ResultRow]
) -> list[ResultRow]:
    """Deal the groups not in `rows` round-robin to `processes` measure processes on every node of the run
    (node r runs ranks r x processes .. (r + 1) x processes - 1), each with its own copy of the target on
    its own GPUs: start this node's, announce the other nodes' (each starts them with `run_share`), wait for
    every one and gather their rows into results.jsonl in group order. A process writes
    `results.part<rank>.jsonl` group by group into the shared work folder, so a rerun keeps every group
    finished, those of a process that failed or of a node lost included."""
    spec_path = spec_for(inputs, ctx).write(ctx.work_dir / SPEC_FILE)
    per_copy = gpus_per_copy(inputs.target) if torch.cuda.is_available() else 0
    leader = ctx.leader
    total = processes * (leader.machines.nodes if leader is not None else 1)
    for rank in range(total):
        (ctx.work_dir / f"error.part{rank}.txt").unlink(missing_ok=True)  # an earlier run's
    names = [_name(rank) for rank in range(total)]
    children: list[subprocess.Popen | RemoteProcess] = []
    with stopped_on_error(children):
        for rank in range(processes):
            children.append(_start(spec_path, rank, total, rank, processes, per_copy))
        if leader is not None and total > processes:
            children += remote_processes(ctx.work_dir, names, processes, leader.timeout)
            leader.announce({"kind": "measure", "spec": str(spec_path), "per_node": processes,
                             "processes": total, "gpus_per_process": per_copy})  # fmt: skip
        log.info("measure: the groups dealt to %d processes (logs: measure.part<i>.log)", total)
        wait_all(children, lambda: None)
    clear_share(ctx.work_dir, names, processes)  # the other nodes' exit files and heartbeats
    parts = sorted(ctx.work_dir.glob(PART_GLOB))
    try:
        rows = rows + [row for part in parts for row in read_rows(part)]
    except ResultsError as err:
        raise StageFailed(f"measure: {err}; delete the file to measure again") from err
    cfg = inputs.measure
    rows = sorted(rows, key=lambda r: (r.engine, r.dataset, cfg.temperatures.index(r.temperature), cfg.seeds.index(r.seed)))  # fmt: skip
    write_rows(ctx.work_dir / RESULTS_FILE, rows)
    for part in parts:
        part.unlink()
    failed = []
    for rank, child in enumerate(children):
        if isinstance(child, RemoteProcess) and child.lost:
            failed.append(f"process {rank} of {total} on node {child.node}: {child.lost_why()}")
        elif child.returncode != 0:
            error = ctx.work_dir / f"error.part{rank}.txt"
            why = (
                error.read_text(encoding="utf-8").strip()
                if error.is_file()
                else f"see {ctx.work_dir / _name(rank)}.log"
            )
            failed.append(f"process {rank} of {total} ({child.pid}) failed: {why}")
    if failed:
        raise StageFailed(
            "measure: " + "\n".join(failed) + "\nEvery finished group is kept: a rerun measures only the rest"
        )
    measured = {row.group for row in rows}
    missing = [g for g in all_groups(cfg, load_eval_sets(inputs)) if ("polydraft", *g) not in measured]
    if missing:  # every process ended well, yet some group has no rows: never count it as measured
        raise StageFailed(
            f"measure: {len(missing)} group(s) have no rows after every process ended well, e.g. (eval set, "
            f"temperature, seed) {missing[0]} (see {ctx.work_dir}/measure.part*.log); a rerun measures them"
        )
    first = ctx.work_dir / "latency.part0.json"
    if first.is_file():
        first.replace(ctx.work_dir / LATENCY_FILE)
    return rows


def run_share(event: dict[str, Any], rank: int, gone: Callable[[], str | None]) -> None:
    """Node `rank`'s share of node 0's measure processes (a `measure` announcement): ranks rank x per_node
    .. (rank + 1) x per_node - 1, started on this node's GPUs as node 0 starts its own, then watched for
    node 0 (`distill.node_share.watch_share`) until they end or node 0 no longer waits for them (`gone()`
    says why)."""
    spec_path, per_node, total = Path(event["spec"]), int(event["per_node"]), int(event["processes"])
    ranks = range(rank * per_node, (rank + 1) * per_node)
    started = []
    for local_rank, global_rank in enumerate(ranks):
        process = _start(spec_path, global_rank, total, local_rank, per_node, int(event["gpus_per_process"]))
        started.append((_name(global_rank), process))
    log.info("measure: node %d runs processes %d..%d of %d", rank, ranks[0], ranks[-1], total)
    watch_share(spec_path.parent, rank, started, gone)


def main(argv: list[str] | None = None) -> None:
    """One measure process: `python -m polydraft.pipelines.stages.measure SPEC RANK PROCESSES` decodes every
    PROCESSES-th group not yet in results.jsonl, from the RANK-th, into `results.part<RANK>.jsonl`. It dies
    with the process that started it (`distill.engines.die_with_parent`), so no process of a killed node
    goes on writing into the shared folder."""
    die_with_parent()
    spec_file, rank, processes = argv or sys.argv[1:]
    spec = StageSpec.read(spec_file)
    setup_process_logging(spec)
    inputs = MeasureInputs.model_validate(spec.inputs)
    work_dir = Path(spec.work_dir)
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        upstream = {k: Path(v) for k, v in spec.upstream.items()}
        loaded = load(inputs, upstream, work_dir / f"latency.part{rank}.json")
        done = {row.group for row in read_rows(work_dir / RESULTS_FILE)}
        todo = [g for g in all_groups(inputs.measure, loaded.eval_sets) if ("polydraft", *g) not in done]
        mine = todo[int(rank) :: int(processes)]
        log.info("measure: process %s of %s, %d groups", rank, processes, len(mine))
        measure_groups(inputs.measure, loaded, mine, work_dir / f"results.part{rank}.jsonl")
    except Exception as err:
        (work_dir / f"error.part{rank}.txt").write_text(f"{type(err).__name__}: {err}\n", encoding="utf-8")
        raise


def add_vllm_rows(
    cfg: MeasureConfig,
    target: str,
    eval_sets: list[EvalSet],
    drafters: list[Drafter],
    rows: list[ResultRow],
    context: dict[str, Any],
    path: Path,
) -> list[ResultRow]:
    """`rows` with the standalone drafters' rows of engine `vllm` (`measure.vllm`); a results file that
    already has all of them is kept, one with some of them is measured in vLLM again."""
    missing = vllm_unavailable()
    if missing is not None:
        if cfg.vllm == "require":
            raise StageFailed(f"measure.vllm is `require`, but {missing}")
        log.warning("measure.vllm is `auto`: no vLLM rows, %s", missing)
        return rows
    plan = [(d, [s for s in eval_sets if measured_on(cfg, d, s)]) for d in drafters if d.lm is not None]
    plan = [(d, sets) for d, sets in plan if sets]
    wanted = {("vllm", s.name, t, cfg.seeds[0]) for _, sets in plan for s in sets for t in cfg.temperatures}
    if wanted == {row.group for row in rows if row.engine == "vllm"}:
        return rows
    rows = [row for row in rows if row.engine != "vllm"]
    write_rows(path, rows)
    measured = []
    for drafter, sets in plan:
        log.info("measure: %s inside vLLM on %s", drafter.source.name, ", ".join(s.name for s in sets))
        request = {
            "target": target,
            "drafter": drafter.source.path,
            "prompt_sets": {s.name: [p.tolist() for p in s.prompts] for s in sets},
            "temperatures": cfg.temperatures,
            "num_speculative_tokens": cfg.draft_length,
            "max_new_tokens": cfg.max_new_tokens,
            "top_p": cfg.top_p,
            "batch_sizes": cfg.vllm_batch_sizes,
            "seed": cfg.seeds[0],
            "draft_sample_method": cfg.vllm_draft_sample_method,
        }
        try:
            results = measure_subprocess(request)
        except VllmMeasureFailed as err:
            raise StageFailed(f"measure.vllm: {err}") from err
        measured += [(drafter.source, drafter.size_ratio, result) for result in results]
    new_rows = vllm_rows(measured, {s.name: s for s in eval_sets}, cfg.max_new_tokens, context)
    append_rows(path, new_rows)
    return rows + new_rows


if __name__ == "__main__":
    main()
