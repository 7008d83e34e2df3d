"""The measure stage on two loopback nodes: two `polydraft run` processes (node ranks 0 and 1 of a
multi-machine accelerate config) on one shared run directory, one measure process each, measure every
(eval set, temperature, seed) group exactly once, decoding what one node does; node 1 killed mid-way takes
its measure process along, node 0 fails naming it once its heartbeat stood still for the node timeout,
keeping every finished group, and a rerun of both nodes measures only the missing groups."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polydraft.decoding.measurement.results import RESULTS_FILE, ResultRow, read_rows
from polydraft.pipelines.run.recipe import load_recipe
from tests.decoding_helpers import single_thread_fixture
from tests.distill_setup import free_port
from tests.measure_setup import measure_context, run_measure, write_drafters
from tests.pipelines.test_multinode import MULTINODE
from tests.vllm_setup import PROJECT_ROOT, stop_group

RECIPE = """
target: {{path: {target}}}
data:
  pairs: [de-en, fr-en]
  eval:
    - {{kind: offline, split: test, pair: de-en}}
    - {{kind: offline, split: test, pair: fr-en}}
distill: {{enabled: false}}
pretrain: {{enabled: false}}
finetune: {{enabled: false}}
early_exit: {{enabled: false}}
heads: {{enabled: false}}
calibrate: {{enabled: false}}
export: {{enabled: false}}
measure:
  num_prompts: 2
  max_new_tokens: 6
  temperatures: [0.0, 1.0]
  seeds: [0, 1]
  decoders: [ar, sd, rsd_s]
  controls: [fixed]
  draft_length: 3
  beam_width: 2
  beam_depth: 2
  include_pretrained: false
  latency_repeats: 1
  extra_drafters: {{de-en: {drafters}/de-en, fr-en: {drafters}/fr-en}}
launch: {{accelerate_config: {config}}}
tracking: {{mode: disabled}}
"""
GROUPS = 8
"""2 eval sets x 2 temperatures x 2 seeds."""

single_thread = single_thread_fixture()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_target_dir, tiny_tokenizer, tiny_target) -> Path:
    """The tiny measure recipe of two nodes: ar, sd and rsd_s with two drafters, every other stage off."""
    folder = tmp_path_factory.mktemp("two-nodes")
    drafters = write_drafters(folder / "drafters", tiny_tokenizer, tiny_target)
    config = folder / "multinode.yaml"
    config.write_text(MULTINODE.format(port=free_port()))
    path = folder / "recipe.yaml"
    path.write_text(RECIPE.format(target=tiny_target_dir, drafters=drafters, config=config))
    return path


@pytest.fixture(scope="module")
def one_node(recipe, tmp_path_factory, tiny_target_dir) -> list[ResultRow]:
    """What the stage measures on one node (one process, in this one)."""
    ctx = measure_context(tmp_path_factory.mktemp("one-node"), {})
    run_measure(load_recipe(recipe), ctx, tiny_target_dir)
    return read_rows(ctx.work_dir / RESULTS_FILE)


def _node(recipe: Path, run_dir: Path, rank: int, timeout: int, log: Path) -> subprocess.Popen:
    """`polydraft run RECIPE` as node `rank` of two (loopback), its output in `log` (not --quiet: each
    measure process logs the groups it was dealt)."""
    command = [sys.executable, "-m", "polydraft.pipelines.cli.main", "run", str(recipe), "--run-dir", str(run_dir),
               "--node-rank", str(rank), "--node-timeout", str(timeout)]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=out, stderr=out, start_new_session=True)


def _two_nodes(recipe: Path, run_dir: Path, logs: Path, timeout: int) -> list[subprocess.Popen]:
    """Node 1, then node 0 once node 1 has written its card (so node 0's short timeout is for the measure)."""
    card = run_dir / "nodes" / "node-1.json"
    card.unlink(missing_ok=True)  # an earlier run's
    follower = _node(recipe, run_dir, 1, 300, logs / "node1.log")
    deadline = time.time() + 120
    while time.time() < deadline and not card.exists() and follower.poll() is None:
        time.sleep(0.1)
    assert card.exists(), (logs / "node1.log").read_text()
    return [_node(recipe, run_dir, 0, timeout, logs / "node0.log"), follower]


def _finish(nodes: list[subprocess.Popen], logs: Path) -> None:
    try:
        assert nodes[0].wait(timeout=300) == 0, (logs / "node0.log").read_text()
        assert nodes[1].wait(timeout=60) == 0, (logs / "node1.log").read_text()
    finally:
        for node in nodes:
            stop_group(node, signal.SIGKILL)
    assert "node 1 of 2: joined 1 launch(es)" in (logs / "node1.log").read_text()


def _decoded(rows: list[ResultRow]) -> dict:
    """What decoding produced, per group and method (not its timings)."""
    return {
        (r.group, r.method): (r.new_tokens, r.target_calls, r.block_efficiency, r.matches_ar, r.eos_stops)
        for r in rows
    }


def _groups(rows: list[ResultRow]) -> list[tuple]:
    """The groups of `rows`, each once, in their order."""
    return list(dict.fromkeys(r.group for r in rows))


def _part_groups(log: Path) -> int:
    """The groups the measure process of `log` was dealt in the last run that appended to it (its line
    `measure: process R of 2, N groups`)."""
    return int(log.read_text().rsplit(" of 2, ", 1)[1].split(" groups")[0])


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_node_killed_mid_way_fails_the_stage_naming_it_and_the_rerun_measures_the_rest(
    recipe, one_node, tmp_path
):
    """Node 1's `polydraft run` is killed (SIGKILL, its process only) once its measure process has loaded:
    that process dies with it, node 0's process finishes its groups, and node 0 fails within its node
    timeout (10 s) naming node 1, its groups kept. The rerun of both nodes measures node 1's groups only,
    dealt over both nodes, every group once, as one node decodes them, and leaves nothing of the processes'
    parts, exit files and heartbeats."""
    run_dir, work = tmp_path / "run", tmp_path / "run" / "measure.partial"
    nodes = _two_nodes(recipe, run_dir, tmp_path, timeout=10)
    try:
        deadline = time.time() + 300
        while (
            time.time() < deadline and nodes[0].poll() is None and not (work / "latency.part1.json").exists()
        ):
            time.sleep(0.05)
        assert (work / "latency.part1.json").exists(), (tmp_path / "node0.log").read_text()
        measuring = _children(nodes[1].pid)
        assert len(measuring) == 1, measuring  # node 1's measure process
        nodes[1].kill()  # node 1's polydraft process only: its measure process must go with it
        killed = time.time()
        while time.time() < killed + 10 and _alive(measuring[0]):
            time.sleep(0.1)
        assert not _alive(measuring[0]), "node 1's measure process outlived its node"
        assert nodes[0].wait(timeout=120) != 0, "node 0 ignored the lost node"
        print(f"node 0 failed {time.time() - killed:.1f} s after node 1 was killed")
    finally:
        for node in nodes:
            stop_group(node, signal.SIGKILL)
    out = (tmp_path / "node0.log").read_text()
    assert "measure: process 1 of 2 on node 1: the node stopped answering" in out, out
    assert "stood still for 10 s" in out and "Every finished group is kept" in out
    kept = read_rows(work / RESULTS_FILE)
    order = _groups(one_node)  # the groups in the order they are dealt: node 0's are the even ones
    assert set(order[0::2]) <= set(_groups(kept)), "node 0's process did not finish its groups"
    assert len(_groups(kept)) < GROUPS, "node 1 finished its groups before it was killed"
    assert len(kept) == len(set((r.group, r.method) for r in kept))
    dates = {r.group: r.date for r in kept}

    logs = tmp_path / "rerun"
    logs.mkdir()
    _finish(_two_nodes(recipe, run_dir, logs, timeout=300), logs)
    rows = read_rows(run_dir / "measure" / RESULTS_FILE)
    assert len(rows) == len(one_node) and _decoded(rows) == _decoded(one_node)  # every group once
    assert {r.group: r.date for r in rows if r.group in dates} == dates  # the kept groups not measured again
    missing = GROUPS - len(dates)  # dealt round-robin again: node 1's process gets every second one
    assert _part_groups(run_dir / "measure" / "measure.part1.log") == missing // 2 > 0
    assert _part_groups(run_dir / "measure" / "measure.part0.log") == missing - missing // 2
    # nothing left of the processes' parts and of the nodes' exit files and heartbeats
    assert not list((run_dir / "measure").glob("results.part*"))
    assert not list((run_dir / "measure").glob("*.exit")) + list((run_dir / "measure").glob("*.alive"))
