"""Data-parallel vLLM engines: one process per group of `tensor_parallel_size` GPUs, each answering its
share of the pending requests and appending its records to the shared record folder chunk by chunk.

Each engine is a process of its own (`python -m polydraft.distill.engines SPEC`) that sees only its GPUs
(`CUDA_VISIBLE_DEVICES`; on the CPU build, its own cores through `VLLM_CPU_OMP_THREADS_BIND`). It writes
its records to its own files (`shard<S>-engine<E>-part<P>.jsonl`), one `LLM.generate` call of
`submit_size` prompts at a time, so a crash or `kill -9` of an engine loses at most the chunk it was
generating; a rerun reads the keys every engine wrote and deals out only the missing ones. When an engine
ends, its process and its GPU memory go with it: the stage after distillation starts on free GPUs.

An engine leads a process group of its own, which vLLM's engine core and workers (spawned processes)
join. Whatever ends the stage, the whole group goes: a stopped stage kills each group, and an engine whose
parent died, even by `kill -9` of polydraft's main process alone, kills its group itself (a thread watches
its parent), so no engine core is left holding GPU memory for the rerun to fail on (vLLM's own
`PR_SET_PDEATHSIG` covers the process it is set in, not the engine core it spawns).

Files of engine E in `<work_dir>/engines/`: `engine-E.json` (its settings), `engine-E.requests.jsonl` (its
requests), `engine-E.pid`, `engine-E.progress` (records written so far), `engine-E.log` (its output) and
`engine-E.result.json` (what it wrote and which samples failed), all rewritten by each run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polydraft.distill.plan import Key, PromptItem, Request

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
POLL_SECONDS = 1.0


class EngineError(RuntimeError):
    """An engine process that failed; the records it wrote are kept."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine process needs besides its requests (written as `engine-E.json`)."""

    index: int
    work_dir: str
    shard_index: int
    records_per_file: int
    batch_size: int
    engine: dict[str, Any]
    """`distill.vllm_backend.engine_kwargs` arguments, less `cpu_kv_cache_gib`."""
    cpu_kv_cache_gib: float
    sampling: dict[str, Any]
    """top_p, max_new_tokens, stop, stop_token_ids, seed."""
    submit_size: int
    meta: dict[str, str]
    seed: int


@dataclass(frozen=True)
class EngineResult:
    written: int
    response_tokens: int
    failures: dict[Key, str]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them (without initialising CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def engine_count(data_parallel: int | None, tensor_parallel_size: int, gpus: list[str]) -> int:
    """Engines to start: `data_parallel`, or every visible GPU divided by `tensor_parallel_size` (one
    engine when there is no GPU: the CPU build). Asking for more GPUs than are visible is an error."""
    if data_parallel is None:
        return max(1, len(gpus) // tensor_parallel_size)
    if gpus and data_parallel * tensor_parallel_size > len(gpus):
        raise EngineError(
            f"distill.vllm.data_parallel {data_parallel} x tensor_parallel_size {tensor_parallel_size} needs "
            f"{data_parallel * tensor_parallel_size} GPUs, {len(gpus)} are visible ({','.join(gpus)})"
        )
    return data_parallel


def engine_envs(engines: int, tensor_parallel_size: int, gpus: list[str]) -> list[dict[str, str]]:
    """Environment overrides of each engine: its GPU group, or on a CPU machine its share of the cores."""
    if gpus:
        size = tensor_parallel_size
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * size : (i + 1) * size])} for i in range(engines)]
    if engines == 1:
        return [{}]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < engines:
        raise EngineError(
            f"distill.vllm.data_parallel {engines} CPU engines need as many cores, {len(cores)} here"
        )
    share = len(cores) // engines
    binds = [cores[i * share : (i + 1) * share] for i in range(engines)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, b))} for b in binds]


def deal(requests: list[Request], engines: int) -> list[list[Request]]:
    """Requests dealt out round robin, so every engine gets a like mix of prompts and temperatures."""
    return [requests[i::engines] for i in range(engines)]


def _paths(work_dir: Path, index: int) -> dict[str, Path]:
    root = work_dir / ENGINES_DIR
    names = ("json", "requests.jsonl", "pid", "progress", "log", "result.json")
    return {name: root / f"engine-{index}.{name}" for name in names}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop an engine and every process of its group (the engine core and workers it spawned)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_engines(
    specs: list[EngineSpec],
    shares: list[list[Request]],
    envs: list[dict[str, str]],
    progress: Callable[[int], None],
) -> list[EngineResult]:
    """Start one process per spec, report records written as they land (`progress(n)` with the new ones),
    wait for all of them, and return their results. An engine that fails lets the others finish (their
    records are kept), then raises EngineError naming it and the end of its log."""
    processes: list[subprocess.Popen] = []
    seen = [0] * len(specs)
    try:
        for spec, share, env in zip(specs, shares, envs, strict=True):
            paths = _paths(Path(spec.work_dir), spec.index)
            paths["json"].parent.mkdir(parents=True, exist_ok=True)
            for name in ("progress", "result.json"):
                paths[name].unlink(missing_ok=True)
            _write_atomic(paths["json"], json.dumps(asdict(spec)))
            lines = (
                json.dumps(
                    {"item": asdict(r.item), "temperature": r.temperature, "samples": r.sample_indices}
                )
                for r in share
            )
            _write_atomic(paths["requests.jsonl"], "".join(line + "\n" for line in lines))
            with open(paths["log"], "w", encoding="utf-8") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "polydraft.distill.engines", str(paths["json"])],
                    env={**os.environ, **env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the engine's group: its engine core and workers join it
                )
            processes.append(process)
            paths["pid"].write_text(str(process.pid))
            log.info(
                "distill: engine %d (pid %d, %s) answers %d requests",
                spec.index,
                process.pid,
                env,
                len(share),
            )
        while True:
            running = [p.poll() is None for p in processes]
            for spec in specs:
                path = _paths(Path(spec.work_dir), spec.index)["progress"]
                count = int(path.read_text() or 0) if path.exists() else 0
                if count > seen[spec.index]:
                    progress(count - seen[spec.index])
                    seen[spec.index] = count
            if not any(running):
                break
            time.sleep(POLL_SECONDS)
    except BaseException:
        for process in processes:
            _stop(process)
        raise
    results, failed = [], []
    for spec, process in zip(specs, processes, strict=True):
        paths = _paths(Path(spec.work_dir), spec.index)
        if process.returncode != 0 or not paths["result.json"].exists():
            failed.append(
                f"engine {spec.index} (pid {process.pid}) exited with {process.returncode}; "
                f"the end of {paths['log']}:\n{_log_tail(paths['log'])}"
            )
            continue
        raw = json.loads(paths["result.json"].read_text())
        failures = {(p, float(t), int(s)): why for p, t, s, why in raw["failures"]}
        results.append(EngineResult(raw["written"], raw["response_tokens"], failures))
    if failed:
        raise EngineError("\n".join(failed))
    return results


# ----------------------------------------------------------------------------- inside an engine process


class _ProgressFile:
    """The `bar` of the engine's RecordWriter: the count of records written, for the stage to read."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0

    def update(self, n: int) -> None:
        self.count += n
        _write_atomic(self.path, str(self.count))


WATCH_SECONDS = 0.2


def _die_with_parent() -> None:
    """When the stage that started this engine dies, even by `kill -9`, the engine kills its process group
    (itself, vLLM's engine core and workers): a daemon thread watches the parent; on Linux the kernel also
    sends SIGTERM at once (`PR_SET_PDEATHSIG`), which this handler turns into the same group kill."""
    parent = os.getppid()

    def kill_group(*_: Any) -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        kill_group()

    signal.signal(signal.SIGTERM, kill_group)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> None:
    from polydraft.distill.store import RecordStore, RecordWriter
    from polydraft.distill.vllm_backend import engine_kwargs, generate_vllm, import_vllm, on_cpu

    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = EngineSpec(**json.loads(Path((argv or sys.argv[1:])[0]).read_text()))
    paths = _paths(Path(spec.work_dir), spec.index)
    requests = []
    with open(paths["requests.jsonl"], encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            requests.append(Request(PromptItem(**row["item"]), row["temperature"], row["samples"]))
    vllm = import_vllm()
    kwargs = engine_kwargs(**spec.engine, cpu_kv_cache_gib=spec.cpu_kv_cache_gib if on_cpu() else None)
    llm = vllm.LLM(**kwargs)
    store = RecordStore(Path(spec.work_dir), spec.shard_index, spec.records_per_file, engine=spec.index)
    writer = RecordWriter(
        store, spec.meta, spec.seed, spec.batch_size, set(), _ProgressFile(paths["progress"]), lambda m: None
    )
    try:
        generate_vllm(
            llm,
            requests,
            submit_size=spec.submit_size,
            emit=writer.emit,
            fail=writer.fail,
            show_progress=False,
            after_chunk=writer.flush,
            **spec.sampling,
        )
    finally:
        writer.flush()
        store.close()
    failures = [[*key, why] for key, why in writer.failures.items()]
    result = {"written": writer.written, "response_tokens": writer.response_tokens, "failures": failures}
    _write_atomic(paths["result.json"], json.dumps(result))


if __name__ == "__main__":
    main()
