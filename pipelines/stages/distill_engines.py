"""The distill stage's engine processes (`distill/engines.py`): the `vllm` backend's data-parallel engines, on
every node of the run, and the `hf` backend's generating processes with `distill.hf.processes` (this
machine only). Each process answers a round-robin share of the requests and writes its records as it goes;
what they wrote is counted into the stage's record writer."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from polydraft.distill.engines import (
    EngineError,
    EngineSpec,
    deal,
    engine_count,
    engine_envs,
    run_engines,
    visible_gpus,
)
from polydraft.distill.requests import Request
from polydraft.distill.store import RecordWriter
from polydraft.distill.vllm_backend import INSTALL_HINT
from polydraft.pipelines.runtime.contract import StageContext, StageFailed
from polydraft.pipelines.runtime.nodes import usable_cores
from polydraft.pipelines.schema.inputs import DistillInputs

log = logging.getLogger("polydraft.pipelines.stages.distill")


def generate_with_hf_processes(
    inputs: DistillInputs,
    ctx: StageContext,
    requests: list[Request],
    writer: RecordWriter,
    sampling: dict[str, Any],
    limit: int | None,
) -> dict[str, int]:
    """The hf backend in `distill.hf.processes` processes of this machine (`distill/engines.py`), each with
    its share of the cores and of the requests; what they write is counted into `writer`."""
    cfg, target = inputs.distill, inputs.target
    processes = cfg.hf.processes
    threads = max(1, usable_cores() // processes)
    engine = {
        "path": target.path, "revision": target.revision, "dtype": target.dtype,
        "trust_remote_code": target.trust_remote_code, "device": cfg.hf.device, "max_length": limit,
    }  # fmt: skip
    specs = engine_specs(inputs, ctx, writer, sampling, engine, processes, backend="hf")
    log.info("distill: %d hf processes of %d thread(s) each", processes, threads)
    return engine_results(specs, requests, [{"OMP_NUM_THREADS": str(threads)}] * processes, writer, ctx)


def engine_specs(
    inputs: DistillInputs,
    ctx: StageContext,
    writer: RecordWriter,
    sampling: dict[str, Any],
    engine: dict[str, Any],
    count: int,
    backend: str = "vllm",
    cpu_kv_cache_gib: float = 0.0,
    submit_size: int = 0,
) -> list[EngineSpec]:
    """`count` engine processes' specs, alike but for their index: the recipe's distill settings, the
    backend's `engine` arguments, the writer's record metadata."""
    cfg = inputs.distill
    return [
        EngineSpec(
            index=i,
            work_dir=str(ctx.work_dir),
            shard_index=cfg.shard_index,
            records_per_file=cfg.records_per_file,
            batch_size=cfg.batch_size,
            engine=engine,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            sampling=sampling,
            submit_size=submit_size,
            meta=writer.meta,
            seed=cfg.seed,
            backend=backend,
        )  # fmt: skip
        for i in range(count)
    ]


def engine_results(
    specs: list[EngineSpec],
    requests: list[Request],
    envs: list[dict[str, str]],
    writer: RecordWriter,
    ctx: StageContext,
) -> dict[str, int]:
    """Run the engine processes of `specs` over `requests` (`run_engines`), count what they wrote into
    `writer`; StageFailed, with every record written kept, when one fails."""
    leader = ctx.leader if len(specs) > len(envs) else None
    try:
        results = run_engines(
            specs, deal(requests, len(specs)), envs, writer.bar.update,
            leader.announce if leader is not None else None, leader.timeout if leader is not None else 600.0,
        )  # fmt: skip
    except EngineError as err:
        writer.absorb(writer.store.keys(), {}, 0, 0)
        raise StageFailed(
            f"distill: {err}\nThe records written are kept: rerun `polydraft run RECIPE --only distill` "
            "to generate the missing ones."
        ) from err
    failures = {key: why for result in results for key, why in result.failures.items()}
    writer.absorb(
        writer.store.keys(),
        failures,
        sum(r.written for r in results),
        sum(r.response_tokens for r in results),
    )
    return {"engines": len(specs)}


def generate_with_engines(
    inputs: DistillInputs,
    ctx: StageContext,
    requests: list[Request],
    writer: RecordWriter,
    sampling: dict[str, Any],
) -> dict[str, int]:
    """The vllm backend: `distill.vllm.data_parallel` engine processes (`distill/engines.py`), each on
    its own GPU group and its share of the requests, as many on every other node of the run as here;
    what they write is counted into `writer`."""
    if importlib.util.find_spec("vllm") is None:
        raise StageFailed(INSTALL_HINT)
    cfg, target, v = inputs.distill, inputs.target, inputs.distill.vllm
    try:
        gpus = visible_gpus()
        engines = engine_count(v.data_parallel, v.tensor_parallel_size, gpus)
        envs = engine_envs(engines, v.tensor_parallel_size, gpus)
    except EngineError as err:
        raise StageFailed(str(err)) from err
    nodes = ctx.leader.machines.nodes if ctx.leader is not None else 1
    engine = {
        "path": target.path, "revision": target.revision, "dtype": target.dtype,
        "trust_remote_code": target.trust_remote_code, "tensor_parallel_size": v.tensor_parallel_size,
        "max_model_len": v.max_model_len, "gpu_memory_utilization": v.gpu_memory_utilization, "seed": cfg.seed,
    }  # fmt: skip
    specs = engine_specs(
        inputs, ctx, writer, sampling, engine, engines * nodes,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib, submit_size=v.submit_size,
    )  # fmt: skip
    log.info(
        "distill: %d vLLM engine(s) of %d GPU(s) each on each of %d node(s)",
        engines, v.tensor_parallel_size if gpus else 0, nodes,
    )  # fmt: skip
    return engine_results(specs, requests, envs, writer, ctx)
