"""The vllm backend: engine and sampling arguments, output parsing and the submission loop around a
stand-in engine, the install message; and the real CPU build of vLLM on the demo target, killed with
`kill -9` mid-run and rerun."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from polydraft.distill.engines import EngineError, deal, engine_count, engine_envs
from polydraft.distill.requests import PromptItem, Request, request_seed
from polydraft.distill.store import RecordStore, iter_records, record_files, record_key
from polydraft.distill.vllm_backend import (
    INSTALL_HINT,
    engine_inputs,
    engine_kwargs,
    generate_vllm,
    parse_output,
)
from polydraft.pipelines.runtime.contract import StageFailed
from tests.distill_setup import local_source, make_recipe, run_distill, translation_file
from tests.vllm_setup import PROJECT_ROOT, demo_target, engine_env, node_cores, require_vllm, stop_group


def _item(name: str, ids: list[int] | None) -> PromptItem:
    return PromptItem(id=name, source="s", pair="de-en", messages=[], prompt=f"prompt {name}", prompt_ids=ids)


def test_engine_arguments_follow_the_recipe():
    kwargs = engine_kwargs("lmsys/vicuna-7b-v1.3", "main", "auto", False, 2, 2048, 0.85, 7)
    assert kwargs == {
        "model": "lmsys/vicuna-7b-v1.3",
        "revision": "main",
        "dtype": "bfloat16",  # dtype auto loads bfloat16 on the GPU, as the other stages do
        "trust_remote_code": False,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
        "seed": 7,
        "generation_config": "vllm",  # no sampling defaults merged from the model's generation_config
        "max_model_len": 2048,
    }
    assert "max_model_len" not in engine_kwargs("m", None, "float16", True, 1, None, 0.9, 0)
    cpu = engine_kwargs("m", None, "auto", False, 1, 512, 0.9, 0, cpu_kv_cache_gib=0.5)
    assert cpu["dtype"] == "float32" and cpu["kv_cache_memory_bytes"] == 2**29
    assert cpu["enable_chunked_prefill"] is False and cpu["enforce_eager"] is True
    assert "gpu_memory_utilization" not in cpu


def test_requests_carry_token_ids_and_one_sampling_setting_per_prompt():
    requests = [Request(_item("a", [1, 5, 6]), 0.0, [0]), Request(_item("b", [1, 7]), 0.7, [1, 2])]
    prompts, params = engine_inputs(
        requests, top_p=0.95, max_new_tokens=32, stop=["</s>"], stop_token_ids=[2, 7], seed=3
    )
    assert prompts == [{"prompt_token_ids": [1, 5, 6]}, {"prompt_token_ids": [1, 7]}]
    assert params[0] == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 0.95,
        "max_tokens": 32,
        "stop": ["</s>"],
        "stop_token_ids": [2, 7],
        "seed": request_seed(3, ("a", 0.0, 0)),
    }
    assert params[1]["n"] == 2 and params[1]["seed"] == request_seed(3, ("b", 0.7, 1))
    with pytest.raises(ValueError, match="no token ids"):
        engine_inputs([Request(_item("c", None), 0.0, [0])], 1.0, 8, [], [], 0)


def _output(samples: list[tuple[str, list[int], str | None]]) -> SimpleNamespace:
    outputs = [SimpleNamespace(text=t, token_ids=tuple(ids), finish_reason=f) for t, ids, f in samples]
    return SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=outputs)


def test_output_parsing():
    first, second, aborted = parse_output(
        _output([("a b", [4, 5, 2], "stop"), ("c", [6], "length"), ("", [], "abort")])
    )
    assert (first.text, first.finish_reason, first.token_ids, first.prompt_tokens, first.response_tokens) == (
        "a b",
        "stop",
        [4, 5, 2],
        3,
        3,
    )
    assert second.finish_reason == "length" and second.response_tokens == 1
    assert isinstance(aborted, str) and "abort" in aborted


def test_submission_groups_one_temperature_per_call(monkeypatch):
    """All pending prompts of a temperature go in one `generate` call (or `submit_size` per call)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    calls = []

    class Engine:
        def generate(self, prompts, params, use_tqdm):
            calls.append((prompts, params))
            return [_output([(f"s{i}", [9, 2], "stop") for i in range(p["n"])]) for p in params]

    requests = [Request(_item(n, [1]), t, [0, 1] if t else [0]) for t in (0.0, 1.0) for n in "abc"]
    done, failed = [], []
    generate_vllm(
        Engine(), requests, top_p=1.0, max_new_tokens=4, stop=[], stop_token_ids=[], seed=0, submit_size=None,
        emit=lambda r, s, g: done.append((r.item.id, r.temperature, s, g.text)),
        fail=lambda r, s, why: failed.append(why),
    )  # fmt: skip
    assert [len(p) for p, _ in calls] == [3, 3]
    assert {p["temperature"] for p in calls[1][1]} == {1.0}
    assert len(done) == 3 + 6 and not failed
    assert ("b", 1.0, 1, "s1") in done

    calls.clear()
    generate_vllm(
        Engine(), requests, top_p=1.0, max_new_tokens=4, stop=[], stop_token_ids=[], seed=0, submit_size=2,
        emit=lambda *a: None, fail=lambda *a: None,
    )  # fmt: skip
    assert [len(p) for p, _ in calls] == [2, 1, 2, 1]


def test_missing_vllm_is_a_clear_error(tmp_path, tiny_target_dir, monkeypatch):

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not
    recipe = make_recipe(tiny_target_dir, [local_source(translation_file(tmp_path, 1))], backend="vllm")
    with pytest.raises(StageFailed) as err:
        run_distill(recipe, tiny_target_dir, tmp_path / "run" / "distill")
    assert str(err.value) == INSTALL_HINT and "pip install -e .[vllm]" in str(err.value)


# ----------------------------------------------------------------------------- the real engine (CPU build)

RECORD_FIELDS = {
    "id", "prompt_id", "source", "pair", "messages", "reference", "prompt", "temperature", "sample_index",
    "seed", "response", "finish_reason", "prompt_tokens", "response_tokens", "backend", "model",
    "model_revision", "token_ids",
}  # fmt: skip
"""What the hf backend writes (`distill.store.RecordWriter`), token ids included."""


def _group_alive(group: int) -> bool:
    """Whether a running process (not a zombie waiting to be reaped) is in process group `group`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
            return True
    return False


def assert_transformers_greedy(target, records, max_new_tokens: int) -> None:
    """Each record's tokens are the ones transformers' greedy `generate` gives its prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polydraft.data.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    for record in records:
        ids = torch.tensor([encode_prompt(tokenizer, record["prompt"])])
        assert record["prompt_tokens"] == ids.shape[1]
        out = model.generate(
            ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        assert record["token_ids"] == out[0, ids.shape[1] :].tolist()


# ----------------------------------------------------------------------------- data-parallel engines


def test_engines_take_every_visible_gpu_group_unless_told():
    gpus = [str(i) for i in range(8)]
    assert engine_count(None, 1, gpus) == 8
    assert engine_count(None, 2, gpus) == 4
    assert engine_count(None, 4, []) == 1  # the CPU build: one engine unless told
    assert engine_count(3, 2, gpus) == 3
    with pytest.raises(EngineError, match="needs 10 GPUs, 8 are visible"):
        engine_count(5, 2, gpus)
    envs = engine_envs(4, 2, gpus)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3", "4,5", "6,7"]
    requests = [Request(_item(str(n), [1]), 0.0, [0]) for n in range(7)]
    shares = deal(requests, 3)
    assert sorted(r.item.id for share in shares for r in share) == sorted(r.item.id for r in requests)
    assert [len(s) for s in shares] == [3, 2, 2]


def test_cpu_engines_get_their_cores_and_as_many_openmp_threads(monkeypatch):
    """On the CPU build each engine is bound to its share of the cores with OMP_NUM_THREADS to match (an
    engine core in its engine's process otherwise keeps OpenMP's default team: `cpu_threads`); one engine
    keeps vLLM's own binding, but for an engine core in its process; a binding the user set is kept."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_envs(2, 1, []) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3", "OMP_NUM_THREADS": "2"},
    ]
    assert engine_envs(1, 1, []) == [{}]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_envs(1, 1, []) == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1,2", "OMP_NUM_THREADS": "3"}]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1-2")
    assert engine_envs(1, 1, []) == [{}] and engine_envs(2, 1, []) == [{}, {}]


def _progress(work, index: int) -> int:
    path = work / "engines" / f"engine-{index}.progress"
    return int(path.read_text() or 0) if path.exists() else 0


def _node(
    recipe: Path, run_dir: Path, config: Path, rank: int, log: Path, multiprocessing: bool
) -> subprocess.Popen:
    """`polydraft run RECIPE --only distill` as node `rank` of two (loopback), its output in `log`; with
    `multiprocessing` its engine runs vLLM's engine core and worker in two more processes."""
    command = [sys.executable, "-m", "polydraft.pipelines.cli.main", "run", str(recipe), "--only", "distill",
               f"launch.accelerate_config={config}", "--run-dir", str(run_dir), "--node-rank", str(rank),
               "--node-timeout", "30", "--quiet"]  # fmt: skip
    env = {**engine_env(multiprocessing), **node_cores(rank)}
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=out, start_new_session=True
        )


def test_two_nodes_four_temperatures_one_node_killed_then_rerun_give_every_record_once(tmp_path):
    """Two loopback nodes (`polydraft run --node-rank 0/1` on one shared run directory), one CPU engine
    each, half of the requests each, at four temperatures with two samples at T > 0. Node 1's engine runs
    vLLM's engine core and worker in two more processes; its `polydraft run` is killed with SIGKILL (its
    process only, as a scheduler or a user's `kill -9` does) once its engine has written records: within
    30 s no process of that engine's group is left (the engine core would otherwise keep its memory and go
    on generating), node 0's engine finishes its share, and node 0 fails saying node 1 stopped answering,
    keeping every record. The rerun of both nodes generates exactly the missing ones, on both nodes: the
    records of the other backends, with vLLM's token ids, the greedy ones the target's greedy answers."""
    require_vllm()
    from polydraft.pipelines.run.recipe import dump_recipe
    from tests.distill_setup import free_port
    from tests.pipelines.test_multinode import MULTINODE

    target = demo_target()
    data = translation_file(tmp_path, 6)
    vllm = {"max_model_len": 512, "submit_size": 2, "cpu_kv_cache_gib": 0.25, "data_parallel": 1}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_recipe(make_recipe(
        target, [local_source(data)], backend="vllm", temperatures=[0.0, 0.3, 0.7, 1.0], samples_per_prompt=2,
        max_new_tokens=24, batch_size=1, vllm=vllm,
    )))  # fmt: skip
    config = tmp_path / "multinode.yaml"
    config.write_text(MULTINODE.format(port=free_port()))
    expected = {(f"0:local:{data}/train/{i}", t, s) for i in range(6) for t, s in
                [(0.0, 0), (0.3, 0), (0.3, 1), (0.7, 0), (0.7, 1), (1.0, 0), (1.0, 1)]}  # fmt: skip
    run_dir = tmp_path / "run"
    work = run_dir / "distill.partial"

    nodes = [_node(recipe, run_dir, config, rank, tmp_path / f"node{rank}.log", rank == 1) for rank in (0, 1)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and nodes[0].poll() is None and _progress(work, 1) < 2:
            time.sleep(0.05)
        assert nodes[0].poll() is None and _progress(work, 1) >= 2, (tmp_path / "node0.log").read_text()
        group = int((work / "engines" / "engine-1.pid").read_text())  # the engine leads its own group
        nodes[1].kill()  # node 1's polydraft process only: its engine must go with it
        gone = time.time() + 30
        while time.time() < gone and _group_alive(group):
            time.sleep(0.2)
        assert not _group_alive(group), "node 1's engine outlived its node"
        assert nodes[0].wait(timeout=300) != 0, "node 0 ignored the lost node"
    finally:
        for node in nodes:
            stop_group(node, signal.SIGKILL)
    out = (tmp_path / "node0.log").read_text()
    assert "engine 1 on node 1: the node stopped answering" in out, out
    assert "The records written are kept" in out
    RecordStore(work, 0, 1).repair()  # a torn last line, if the kill hit a write
    before = [record_key(r) for r in iter_records(work)]
    # an engine that outlives its node goes on generating, so a killed node leaves records to do
    assert len(before) == len(set(before)) and 0 < len(before) < len(expected)
    engine0 = {
        record_key(r) for p in record_files(work) if "-engine00-" in p.name for r in iter_records_of(p)
    }
    assert len(engine0) == len(expected) // 2, "node 0's engine did not finish its share"

    sizes = {p.name: p.stat().st_size for p in record_files(work)}
    nodes = [_node(recipe, run_dir, config, rank, tmp_path / f"rerun{rank}.log", False) for rank in (0, 1)]
    try:
        assert nodes[0].wait(timeout=300) == 0, (tmp_path / "rerun0.log").read_text()
        assert nodes[1].wait(timeout=60) == 0, (tmp_path / "rerun1.log").read_text()
    finally:
        for node in nodes:
            stop_group(node, signal.SIGKILL)
    done = run_dir / "distill"
    records = list(iter_records(done))
    keys = [record_key(r) for r in records]
    assert len(keys) == len(set(keys)), "a record was written twice"
    assert set(keys) == expected, "a record is missing"
    grown = {p.name.split("-part")[0] for p in record_files(done) if p.stat().st_size > sizes.get(p.name, 0)}
    assert grown == {"shard00000-engine00", "shard00000-engine01"}, "the rerun did not use both nodes"

    # the records of the other backends, with vLLM's token ids
    assert all(set(r) == RECORD_FIELDS for r in records)
    assert all(r["backend"] == "vllm" and r["model"] == str(target) for r in records)
    assert all(r["response_tokens"] == len(r["token_ids"]) <= 24 for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    by_key = {record_key(r): r for r in records}
    prompts = {k[0] for k in keys}
    assert all(by_key[(p, 1.0, 0)]["seed"] != by_key[(p, 1.0, 1)]["seed"] for p in prompts)
    assert sum(by_key[(p, 1.0, 0)]["token_ids"] != by_key[(p, 1.0, 1)]["token_ids"] for p in prompts) >= 3

    # the greedy records are the target's own greedy tokens, as one transformers process computes them
    greedy = [r for r in records if r["temperature"] == 0.0]
    assert len(greedy) == 6
    assert_transformers_greedy(target, greedy, 24)


def iter_records_of(path):
    with open(path, "rb") as handle:
        yield from (json.loads(line) for line in handle)


LIFETIME_CHILD = """
import subprocess, sys, time
from polydraft.distill.engines import die_with_parent
die_with_parent()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(grandchild.pid, flush=True)
time.sleep(120)
"""
LIFETIME_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE,
                         text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
child.wait()
"""


def test_a_process_that_dies_with_its_parent_takes_its_children_along():
    """What every vLLM process polydraft starts (distill's engines, measure's and the export's vLLM runs)
    does: its parent killed with SIGKILL, it kills its group, the processes it spawned included (vLLM's
    engine core); the kernel's PR_SET_PDEATHSIG alone would take the process and leave its children."""
    parent = subprocess.Popen(
        [sys.executable, "-c", LIFETIME_PARENT, LIFETIME_CHILD], cwd=PROJECT_ROOT, env=engine_env(),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child, grandchild = (int(pid) for pid in parent.stdout.readline().split())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and (_alive(child) or _alive(grandchild)):
        time.sleep(0.1)
    assert not _alive(child) and not _alive(grandchild)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
