"""`runner.parallel_stages`: independent stages run side by side, never before their upstream stages, with a
share of the cores each; a failure stops what has not started and keeps what finished."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.run.runner import run_pipeline
from polydraft.pipelines.run.side_by_side import parallel_stages
from polydraft.pipelines.runtime.contract import Stage, StageFailed
from polydraft.pipelines.runtime.launch import accelerate_command
from tests.fake_stages import TARGET, fake_stages

RECIPE = """
target:
  path: org/target
data:
  pairs: [de-en]
eagle3:
  enabled: true
runner:
  parallel_stages: 2
tracking:
  mode: disabled
"""


@pytest.fixture
def recipe_path(tmp_path, monkeypatch):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    monkeypatch.setenv("FAKE_STAGE_LOG", str(tmp_path / "ran.log"))
    return path


def recorded(events: list[tuple[str, str, int | None]], lock: threading.Lock):
    """The fake stages, each recording (start / end, stage, its cpu_cores) in `events`."""

    def wrap(stage: Stage) -> Stage:
        def run(inputs, ctx):
            with lock:
                events.append(("start", stage.name, ctx.cpu_cores))
            try:
                return stage.run(inputs, ctx)
            finally:
                with lock:
                    events.append(("end", stage.name, ctx.cpu_cores))

        return dataclasses.replace(stage, run=run)

    return [wrap(s) for s in fake_stages()]


def test_independent_stages_run_at_once_and_none_before_its_upstream(recipe_path, tmp_path, monkeypatch):
    """eagle3 and pretrain wait for each other at a barrier: run one at a time, the first to arrive would
    wait alone and break it. Every stage starts after each of its upstream stages ended."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    barrier = threading.Barrier(2, timeout=60)
    events: list[tuple[str, str, int | None]] = []
    stages = recorded(events, threading.Lock())

    def meeting(stage: Stage) -> Stage:
        def run(inputs, ctx):
            barrier.wait()  # BrokenBarrierError if the other one never runs beside this one
            return stage.run(inputs, ctx)

        return dataclasses.replace(stage, run=run)

    stages = [meeting(s) if s.name in ("eagle3", "pretrain") else s for s in stages]
    recipe = load_recipe(recipe_path, [])
    outcomes = run_pipeline(recipe, tmp_path / "run", stages, TARGET, command="test")

    assert {o.name: o.status for o in outcomes} == {
        "distill": "ran", "pretrain": "ran", "finetune": "ran", "early_exit": "ran", "heads": "disabled",
        "eagle3": "ran", "calibrate": "ran", "measure": "ran", "export": "ran",
    }  # fmt: skip
    order = [(kind, name) for kind, name, _ in events]
    for stage in [s for s in stages if s.name != "heads"]:
        for upstream in stage.upstream:
            if upstream != "heads":
                assert order.index(("end", upstream)) < order.index(("start", stage.name)), (
                    stage.name,
                    upstream,
                )
    alone = [s.name for s in stages if not s.side_by_side and s.name != "heads"]
    assert alone == ["distill", "measure", "export"]
    for name in alone:  # nothing starts or ends while distill, measure or export runs
        start, end = order.index(("start", name)), order.index(("end", name))
        assert end == start + 1, (name, order[start : end + 1])
    starts = {name: cores for kind, name, cores in events if kind == "start"}
    assert [starts[name] for name in ("eagle3", "pretrain", *alone)] == [2, 2, None, None, None], (
        "each of the 2 stages side by side gets 2 of the 4 cores; one alone has every core"
    )
    manifests = {p.parent.name for p in (tmp_path / "run").glob("*/manifest.json")}
    assert manifests == {
        "distill",
        "pretrain",
        "finetune",
        "early_exit",
        "eagle3",
        "calibrate",
        "measure",
        "export",
    }


def test_a_stage_left_running_alone_gets_the_cores_of_the_chain_that_ended(
    recipe_path, tmp_path, monkeypatch
):
    """eagle3 starts beside pretrain with 2 of the 4 cores and waits until calibrate, the end of the chain
    beside it, has ended: then its cores file says 4, and it is gone from the stage folder once eagle3
    is done. The chain's stages, each beside eagle3, kept 2 (their files read at their start and end)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    chain_done = threading.Event()
    seen: dict[str, list[str]] = {}

    def watched(stage: Stage) -> Stage:
        def run(inputs, ctx):
            seen[stage.name] = [ctx.cores_file.read_text()]
            if stage.name == "eagle3":
                assert chain_done.wait(timeout=60)
                deadline = time.monotonic() + 60  # the runner writes it once calibrate's end is recorded
                while ctx.cores_file.read_text() != "4" and time.monotonic() < deadline:
                    time.sleep(0.01)
                seen["eagle3"].append(ctx.cores_file.read_text())
                return stage.run(inputs, ctx)
            result = stage.run(inputs, ctx)
            seen[stage.name].append(ctx.cores_file.read_text())
            if stage.name == "calibrate":
                chain_done.set()
            return result

        return dataclasses.replace(stage, run=run)

    side = ("pretrain", "finetune", "early_exit", "calibrate", "eagle3")
    stages = [watched(s) if s.name in side else s for s in fake_stages()]
    outcomes = run_pipeline(load_recipe(recipe_path, []), tmp_path / "run", stages, TARGET, command="test")
    assert {o.name: o.status for o in outcomes}["eagle3"] == "ran"
    assert seen == {name: ["2", "4"] if name == "eagle3" else ["2", "2"] for name in side}
    assert not list((tmp_path / "run").glob("*/.cores")), "no cores file left in a stage folder"


def test_distill_runs_alone_though_pretrain_could_start_beside_it(recipe_path, tmp_path):
    """pretrain reads nothing of distill's, but distill spreads its engines over every core: distill waits
    5 s for pretrain to start beside it, which it would within milliseconds if the runner let it; it never
    does, and pretrain starts once distill ended."""
    beside = threading.Event()

    def watched(stage: Stage) -> Stage:
        def run(inputs, ctx):
            if stage.name == "pretrain":
                beside.set()
                return stage.run(inputs, ctx)
            result = stage.run(inputs, ctx)  # distill
            seen = beside.wait(timeout=5)
            if seen:
                raise StageFailed("pretrain started while distill ran")
            return result

        return dataclasses.replace(stage, run=run)

    stages = [watched(s) if s.name in ("distill", "pretrain") else s for s in fake_stages()]
    outcomes = run_pipeline(load_recipe(recipe_path, []), tmp_path / "run", stages, TARGET, command="test")
    assert {o.name: o.status for o in outcomes}["pretrain"] == "ran" and beside.is_set()


def test_the_same_stages_run_with_the_same_keys_one_at_a_time_and_side_by_side(recipe_path, tmp_path):
    """The schedule changes no stage's inputs: one stage at a time, the same stages run, with the same
    configs, and `runner.parallel_stages` reruns nothing."""
    events: list[tuple[str, str, int | None]] = []
    lock = threading.Lock()
    configs = {}
    for parallel in (1, 2):
        recipe = load_recipe(recipe_path, [f"runner.parallel_stages={parallel}"])
        run_dir = tmp_path / f"run{parallel}"
        run_pipeline(recipe, run_dir, recorded(events, lock), TARGET, command="test")
        configs[parallel] = {
            p.parent.name: json.loads(p.read_text())["config"] for p in run_dir.glob("*/manifest.json")
        }
    assert configs[1] == configs[2]
    assert [c for _, _, c in events[: 2 * len(configs[1])]] == [None] * (2 * len(configs[1]))
    events.clear()
    recipe = load_recipe(recipe_path, ["runner.parallel_stages=1"])
    outcomes = run_pipeline(recipe, tmp_path / "run2", recorded(events, lock), TARGET, command="test")
    assert events == [] and {o.status for o in outcomes} == {"skipped (up to date)", "disabled"}


def test_a_failure_keeps_the_stage_running_beside_it_and_starts_nothing_after(
    recipe_path, tmp_path, monkeypatch
):
    """pretrain fails while eagle3 runs beside it; eagle3 goes on only once the runner has taken the failure
    in (it logs it). eagle3 finishes into a complete folder, pretrain's work stays in its .partial folder,
    early_exit (which waits only for distill and a free slot, which eagle3's end gives it) never starts,
    and the failure is raised."""
    monkeypatch.setenv("FAKE_STAGE_FAIL", "pretrain")
    barrier, noticed = threading.Barrier(2, timeout=60), threading.Event()

    class Notice(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("pretrain failed: no stage starts now; eagle3 still running"):
                noticed.set()

    def meeting(stage: Stage) -> Stage:
        def run(inputs, ctx):
            barrier.wait()  # both running
            if stage.name == "eagle3" and not noticed.wait(60):
                raise RuntimeError("the runner never said pretrain failed")
            return stage.run(inputs, ctx)

        return dataclasses.replace(stage, run=run)

    stages = [meeting(s) if s.name in ("eagle3", "pretrain") else s for s in fake_stages()]
    recipe = load_recipe(recipe_path, [])
    run_dir = tmp_path / "run"
    handler, side_log = Notice(), logging.getLogger("polydraft.pipelines.run.side_by_side")
    side_log.addHandler(handler)
    try:
        with pytest.raises(StageFailed, match="pretrain failed on purpose"):
            run_pipeline(recipe, run_dir, stages, TARGET, command="test")
    finally:
        side_log.removeHandler(handler)
    assert (run_dir / "eagle3" / "manifest.json").is_file()
    assert (run_dir / "pretrain.partial" / "part-1.txt").is_file() and not (run_dir / "pretrain").exists()
    assert sorted((tmp_path / "ran.log").read_text().split()) == ["distill", "eagle3", "pretrain"]


def test_in_process_and_several_nodes_run_one_stage_at_a_time(recipe_path):
    recipe = load_recipe(recipe_path, [])
    assert parallel_stages(recipe, None, in_process=False) == 2
    assert parallel_stages(recipe, None, in_process=True) == 1
    assert parallel_stages(recipe, object(), in_process=False) == 1


def test_a_training_launch_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    config = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / "single.yaml"

    def threads(cores: int | None) -> str:
        command = accelerate_command(config, None, "m", [], None, cores)
        return command[command.index("--num_cpu_threads_per_process") + 1]

    assert threads(None) == "4"
    assert threads(2) == "2"
    assert threads(1) == "1"
