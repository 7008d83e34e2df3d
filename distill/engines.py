"""Data-parallel engines: one vLLM process per group of `tensor_parallel_size` GPUs (or, for the `hf`
backend with `distill.hf.processes`, one transformers `generate` process per share of this machine's
cores), each answering its share of the pending requests and appending its records to the shared record
folder chunk by chunk.

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

On several nodes (`pipelines/runtime/nodes.py`) node 0 deals the requests over every node's engines, as many on
each node as on node 0: it starts its own, announces the others, and each other node starts its share
(`run_share`) on its own GPUs, writing into the shared run directory. How the nodes watch each other's
engines is `distill/node_share.py`'s (shared with the measure stage): while they run, that node rewrites
`node-R.alive` every second and writes each engine's exit status to `engine-E.exit` when it ends; node 0
waits for every engine, and a node whose heartbeat stands still for the node timeout (killed, lost) fails
the stage with the records of every engine kept, so a rerun deals out only what is missing. A node stops
its engines as soon as node 0 no longer waits for them.

Files of engine E in `<work_dir>/engines/`: `engine-E.json` (its settings), `engine-E.requests.jsonl` (its
requests), `engine-E.pid`, `engine-E.progress` (records written so far), `engine-E.log` (its output) and
`engine-E.result.json` (what it wrote and which samples failed), `engine-E.exit` (an other node's engine's
exit status), all rewritten by each run.
"""

from __future__ import annotations

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

from polydraft.distill.node_share import (
    RemoteProcess,
    fail_share,
    remote_processes,
    stopped_on_error,
    wait_all,
    watch_share,
    write_atomic,
)
from polydraft.distill.requests import Key, PromptItem, Request

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"


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
    backend: str = "vllm"
    """`vllm`, or `hf`: `engine` then holds `distill.hf_backend.load_model`'s arguments and `max_length`, and
    the process generates with transformers, `batch_size` rows a call."""


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
    """Environment overrides of each engine: its GPU group, or on a CPU machine its share of the cores
    (`cpu_threads`; one engine: vLLM's own binding, unless its engine core runs in its process)."""
    if gpus:
        size = tensor_parallel_size
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * size : (i + 1) * size])} for i in range(engines)]
    if engines == 1:
        return [cpu_threads() if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else {}]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < engines:
        raise EngineError(
            f"distill.vllm.data_parallel {engines} CPU engines need as many cores, {len(cores)} here"
        )
    share = len(cores) // engines
    return [cpu_threads(cores[i * share : (i + 1) * share]) for i in range(engines)]


def cpu_threads(cores: list[int] | None = None) -> dict[str, str]:
    """Environment of a CPU-build vLLM engine bound to `cores` (None: this process's cores but the last,
    which vLLM's own binding keeps for its scheduler): `VLLM_CPU_OMP_THREADS_BIND` and as many OpenMP
    threads. vLLM sets OMP_NUM_THREADS only for the worker processes it spawns; an engine core in the
    engine's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0) keeps OpenMP's default team of one thread per
    core on its bound cores, and beside one other busy process a call took 3-4 s instead of 0.35 s
    (measured on the demo target, 2 cores). Nothing when the user set the binding."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    if cores is None:
        cores = sorted(os.sched_getaffinity(0))
        cores = cores[:-1] if len(cores) > 1 else cores
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "OMP_NUM_THREADS": str(len(cores))}


def deal(requests: list[Request], engines: int) -> list[list[Request]]:
    """Requests dealt out round robin, so every engine gets a like mix of prompts and temperatures."""
    return [requests[i::engines] for i in range(engines)]


def _name(index: int) -> str:
    """Engine `index`'s name: its files are `<name>.<what>` (`<name>.exit` too, `distill/node_share.py`)."""
    return f"engine-{index}"


def _paths(work_dir: Path, index: int) -> dict[str, Path]:
    root = work_dir / ENGINES_DIR
    names = ("json", "requests.jsonl", "pid", "progress", "log", "result.json")
    return {name: root / f"{_name(index)}.{name}" for name in names}


def _log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _start(spec: EngineSpec, env: dict[str, str]) -> subprocess.Popen:
    """Start engine `spec.index` (its spec and requests already written) in a process group of its own."""
    paths = _paths(Path(spec.work_dir), spec.index)
    with open(paths["log"], "w", encoding="utf-8") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "polydraft.distill.engines", str(paths["json"])],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the engine's group: its engine core and workers join it
        )
    paths["pid"].write_text(str(process.pid))
    log.info("distill: engine %d (pid %d, %s) started", spec.index, process.pid, env)
    return process


def run_engines(
    specs: list[EngineSpec],
    shares: list[list[Request]],
    envs: list[dict[str, str]],
    progress: Callable[[int], None],
    announce: Callable[[dict[str, Any]], None] | None = None,
    node_timeout: float = 600.0,
) -> list[EngineResult]:
    """Start this node's engines (the first `len(envs)` specs), report records written as they land
    (`progress(n)` with the new ones), wait for all of them, and return their results. The other specs
    are the other nodes' engines, `len(envs)` per node in order: they are announced with `announce` and
    waited for through the shared folder. An engine that fails (or a node lost) lets the others finish
    (their records are kept), then raises EngineError naming it and the end of its log."""
    local = len(envs)
    for spec, share in zip(specs, shares, strict=True):
        paths = _paths(Path(spec.work_dir), spec.index)
        paths["json"].parent.mkdir(parents=True, exist_ok=True)
        for name in ("progress", "result.json"):
            paths[name].unlink(missing_ok=True)
        write_atomic(paths["json"], json.dumps(asdict(spec)))
        lines = (
            json.dumps({"item": asdict(r.item), "temperature": r.temperature, "samples": r.sample_indices})
            for r in share
        )
        write_atomic(paths["requests.jsonl"], "".join(line + "\n" for line in lines))
        log.info("distill: engine %d answers %d requests", spec.index, len(share))
    seen = [0] * len(specs)

    def report_progress() -> None:
        for spec in specs:
            path = _paths(Path(spec.work_dir), spec.index)["progress"]
            count = int(path.read_text() or 0) if path.exists() else 0
            if count > seen[spec.index]:
                progress(count - seen[spec.index])
                seen[spec.index] = count

    processes: list[subprocess.Popen | RemoteProcess] = []
    with stopped_on_error(processes):
        for spec, env in zip(specs[:local], envs, strict=True):
            processes.append(_start(spec, env))
        if len(specs) > local:
            assert announce is not None, "engines of other nodes need an announcement"
            root = Path(specs[0].work_dir) / ENGINES_DIR
            processes += remote_processes(root, [_name(s.index) for s in specs], local, node_timeout)
            announce({"kind": "engines", "engines_dir": str(root), "per_node": local, "engines": len(specs)})
        wait_all(processes, report_progress)
    results, failed = [], []
    for spec, process in zip(specs, processes, strict=True):
        paths = _paths(Path(spec.work_dir), spec.index)
        if isinstance(process, RemoteProcess) and process.lost:
            failed.append(f"engine {spec.index} on node {process.node}: {process.lost_why()}")
        elif process.returncode != 0 or not paths["result.json"].exists():
            failed.append(
                f"engine {spec.index} ({process.pid}) exited with {process.returncode}; "
                f"the end of {paths['log']}:\n{_log_tail(paths['log'])}"
            )
        else:
            raw = json.loads(paths["result.json"].read_text())
            failures = {(p, float(t), int(s)): why for p, t, s, why in raw["failures"]}
            results.append(EngineResult(raw["written"], raw["response_tokens"], failures))
    if failed:
        raise EngineError("\n".join(failed))
    return results


def run_share(event: dict[str, Any], rank: int, gone: Callable[[], str | None]) -> None:
    """Node `rank`'s share of node 0's engines (an `engines` announcement): start them on this node's
    GPUs and watch them for node 0 (`distill.node_share.watch_share`) until they end or node 0 no longer
    waits for them (`gone()` says why)."""
    root, per = Path(event["engines_dir"]), int(event["per_node"])
    indices = list(range(rank * per, (rank + 1) * per))
    if indices[-1] >= int(event["engines"]):
        raise EngineError(f"node {rank}: node 0 dealt {event['engines']} engines, none to this node")
    specs = [EngineSpec(**json.loads((root / f"{_name(i)}.json").read_text())) for i in indices]
    try:
        gpus = visible_gpus()
        envs = engine_envs(per, specs[0].engine["tensor_parallel_size"], gpus)
    except EngineError as err:  # node 0 reports it with the end of each engine's log
        for spec in specs:
            _paths(root.parent, spec.index)["log"].write_text(f"node {rank}: {err}\n")
        fail_share(root, [_name(i) for i in indices])
        return
    processes = [(_name(spec.index), _start(spec, env)) for spec, env in zip(specs, envs, strict=True)]
    watch_share(root, rank, processes, gone)


# ----------------------------------------------------------------------------- inside an engine process


class _ProgressFile:
    """The `bar` of the engine's RecordWriter: the count of records written, for the stage to read."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0

    def update(self, n: int) -> None:
        self.count += n
        write_atomic(self.path, str(self.count))


WATCH_SECONDS = 0.2


def die_with_parent() -> None:
    """When the process that started this one dies, even by `kill -9`, this one kills its process group
    (itself and what it spawned: vLLM's engine core and workers); it must lead that group
    (`start_new_session=True`): a daemon thread watches the parent; on Linux the kernel also
    sends SIGTERM at once (`PR_SET_PDEATHSIG`), which this handler turns into the same group kill."""
    parent = os.getppid()

    def kill_group(*_: Any) -> None:
        if os.getpgid(0) == os.getpid():  # leading its group: its children go with it
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

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

    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = EngineSpec(**json.loads(Path((argv or sys.argv[1:])[0]).read_text()))
    paths = _paths(Path(spec.work_dir), spec.index)
    requests = []
    with open(paths["requests.jsonl"], encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            requests.append(Request(PromptItem(**row["item"]), row["temperature"], row["samples"]))
    store = RecordStore(Path(spec.work_dir), spec.shard_index, spec.records_per_file, engine=spec.index)
    writer = RecordWriter(
        store, spec.meta, spec.seed, spec.batch_size, set(), _ProgressFile(paths["progress"]), lambda m: None
    )
    try:
        if spec.backend == "hf":
            _generate_hf(spec, requests, writer)
        else:
            _generate_vllm(spec, requests, writer)
    finally:
        writer.flush()
        store.close()
    failures = [[*key, why] for key, why in writer.failures.items()]
    result = {"written": writer.written, "response_tokens": writer.response_tokens, "failures": failures}
    write_atomic(paths["result.json"], json.dumps(result))


def _generate_vllm(spec: EngineSpec, requests: list[Request], writer: Any) -> None:
    from polydraft.distill.vllm_backend import engine_kwargs, generate_vllm, import_vllm, on_cpu

    vllm = import_vllm()
    kwargs = engine_kwargs(**spec.engine, cpu_kv_cache_gib=spec.cpu_kv_cache_gib if on_cpu() else None)
    generate_vllm(
        vllm.LLM(**kwargs),
        requests,
        submit_size=spec.submit_size,
        emit=writer.emit,
        fail=writer.fail,
        show_progress=False,
        after_chunk=writer.flush,
        **spec.sampling,
    )


def _generate_hf(spec: EngineSpec, requests: list[Request], writer: Any) -> None:
    import torch

    from polydraft.distill.hf_backend import generate_hf, load_model
    from polydraft.models.loading import load_tokenizer

    engine = dict(spec.engine)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    tokenizer = load_tokenizer(engine["path"], engine["revision"], engine["trust_remote_code"])
    max_length = engine.pop("max_length")
    model = load_model(**engine)
    generate_hf(
        model, tokenizer, requests, batch_size=spec.batch_size, emit=writer.emit, max_length=max_length,
        after_batch=writer.flush, **spec.sampling,
    )  # fmt: skip


if __name__ == "__main__":
    main()
