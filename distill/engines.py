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

On several nodes (`pipelines/nodes.py`) node 0 deals the requests over every node's engines, as many on
each node as on node 0: it starts its own, announces the others, and each other node starts its share
(`run_share`) on its own GPUs, writing into the shared run directory. While they run, that node rewrites
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

from polydraft.distill.requests import Key, PromptItem, Request

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
    names = ("json", "requests.jsonl", "pid", "progress", "log", "result.json", "exit")
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


class _Remote:
    """An engine another node runs, seen from node 0: ended when its `engine-E.exit` appears; lost (exit
    status None, `lost` set) when its node's `node-R.alive` stands still for `timeout` seconds."""

    def __init__(self, spec: EngineSpec, node: int, timeout: float):
        self.paths = _paths(Path(spec.work_dir), spec.index)
        self.alive = self.paths["json"].parent / f"node-{node}.alive"
        self.node, self.timeout = node, timeout
        self.returncode: int | None = None
        self.lost = False
        self.beat, self.seen = None, time.monotonic()
        self.pid = f"node {node}"

    def poll(self) -> int | None:
        if self.paths["exit"].exists():
            self.returncode = int(self.paths["exit"].read_text() or 1)
            return self.returncode
        beat = self.alive.read_text() if self.alive.exists() else None
        if beat != self.beat:
            self.beat, self.seen = beat, time.monotonic()
        self.lost = time.monotonic() - self.seen > self.timeout
        return -1 if self.lost else None


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
        for name in ("progress", "result.json", "exit"):
            paths[name].unlink(missing_ok=True)
        _write_atomic(paths["json"], json.dumps(asdict(spec)))
        lines = (
            json.dumps({"item": asdict(r.item), "temperature": r.temperature, "samples": r.sample_indices})
            for r in share
        )
        _write_atomic(paths["requests.jsonl"], "".join(line + "\n" for line in lines))
        log.info("distill: engine %d answers %d requests", spec.index, len(share))
    processes: list[Any] = []
    seen = [0] * len(specs)
    try:
        for spec, env in zip(specs[:local], envs, strict=True):
            processes.append(_start(spec, env))
        if len(specs) > local:
            assert announce is not None, "engines of other nodes need an announcement"
            root = Path(specs[0].work_dir) / ENGINES_DIR
            for node in range(1, len(specs) // local):
                (root / f"node-{node}.alive").unlink(missing_ok=True)
            announce({"kind": "engines", "engines_dir": str(root), "per_node": local, "engines": len(specs)})
            processes += [
                _Remote(spec, i // local, node_timeout) for i, spec in enumerate(specs) if i >= local
            ]
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
        for process in processes[:local]:
            _stop(process)
        raise
    results, failed = [], []
    for spec, process in zip(specs, processes, strict=True):
        paths = _paths(Path(spec.work_dir), spec.index)
        if getattr(process, "lost", False):
            failed.append(
                f"engine {spec.index} on node {process.node}: the node stopped answering (its heartbeat "
                f"{process.alive} stood still for {node_timeout:.0f} s); is its `polydraft run` still running?"
            )
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
    GPUs, beat `node-R.alive` while they run, write each one's exit status to `engine-E.exit` as it ends.
    When `gone()` says why node 0 no longer waits for them, stop them and return."""
    root, per = Path(event["engines_dir"]), int(event["per_node"])
    indices = list(range(rank * per, (rank + 1) * per))
    if indices[-1] >= int(event["engines"]):
        raise EngineError(f"node {rank}: node 0 dealt {event['engines']} engines, none to this node")
    specs = [EngineSpec(**json.loads((root / f"engine-{i}.json").read_text())) for i in indices]
    alive, beat = root / f"node-{rank}.alive", 0
    try:
        gpus = visible_gpus()
        envs = engine_envs(per, specs[0].engine["tensor_parallel_size"], gpus)
    except EngineError as err:  # node 0 reports it with the end of each engine's log
        for spec in specs:
            _paths(root.parent, spec.index)["log"].write_text(f"node {rank}: {err}\n")
            _write_atomic(_paths(root.parent, spec.index)["exit"], "1")
        return
    processes = [_start(spec, env) for spec, env in zip(specs, envs, strict=True)]
    written = [False] * per
    try:
        while not all(written):
            beat += 1
            _write_atomic(alive, str(beat))
            for k, process in enumerate(processes):
                if not written[k] and process.poll() is not None:
                    _write_atomic(_paths(root.parent, specs[k].index)["exit"], str(process.returncode))
                    written[k] = True
            if not all(written) and (why := gone()) is not None:
                log.warning("distill: node %d stops engines %s: %s", rank, indices, why)
                return
            time.sleep(POLL_SECONDS)
    finally:
        for process in processes:
            if process.poll() is None:
                _stop(process)


# ----------------------------------------------------------------------------- inside an engine process


class _ProgressFile:
    """The `bar` of the engine's RecordWriter: the count of records written, for the stage to read."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0

    def update(self, n: int) -> None:
        self.count += n
        _write_atomic(self.path, str(self.count))


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
    from polydraft.distill.vllm_backend import engine_kwargs, generate_vllm, import_vllm, on_cpu

    die_with_parent()
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
