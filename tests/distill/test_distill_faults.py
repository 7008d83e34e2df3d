"""`polydraft run --only distill` with the `openai` backend against two real local servers that each fail
40% of their requests (tests/fault_server.py: 500, 503, 429 with Retry-After, dropped connections, hangs
past the timeout, a 200 that is not JSON, no object, cut short or without choices) finishes in one run with every
(prompt, temperature, sample) record exactly once and holding the text the server sent for it; killed with
SIGKILL mid-run, one rerun gives the same."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from polydraft.distill.requests import request_seed
from polydraft.distill.store import iter_records, record_files, record_key
from tests.distill_setup import PROJECT_ROOT, local_source, translation_file
from tests.fault_server import FAULTS, FaultServer, answer_text

PROMPTS, TEMPERATURES, SAMPLES, SEED = 16, (0.7, 1.0), 2, 5
TIMEOUT = 0.4


def write_recipe(path: Path, target_dir: Path, data: Path, base_urls: list[str]) -> Path:
    recipe = {
        "target": {"path": str(target_dir)},
        "data": {"pairs": ["de-en"], "distill": [local_source(data)]},
        "distill": {
            "backend": "openai",
            "temperatures": list(TEMPERATURES),
            "samples_per_prompt": SAMPLES,
            "max_new_tokens": 4,
            "seed": SEED,
            "openai": {"base_urls": base_urls, "max_in_flight": 8, "request_timeout": TIMEOUT,
                       "max_retries": 12, "backoff": 0.02, "max_backoff": 0.1},
        },
        "tracking": {"mode": "disabled"},
    }  # fmt: skip
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def polydraft(recipe: Path, run_dir: Path) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("polydraft")), "run", str(recipe), "--quiet"]
    command += ["--only", "distill", "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def finished(process: subprocess.Popen) -> None:
    output = process.communicate(timeout=240)[0].decode()
    assert process.returncode == 0, output[-3000:]


def written(distill_dir: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in record_files(distill_dir))


def assert_every_record_once_with_the_servers_text(distill_dir: Path, data: Path, served: set[str]) -> None:
    records = list(iter_records(distill_dir))
    keys = [record_key(r) for r in records]
    expected = {
        (f"0:local:{data}/train/{i}", t, s)
        for i in range(PROMPTS)
        for t in TEMPERATURES
        for s in range(SAMPLES)
    }
    assert len(keys) == len(set(keys)), "a record was written twice"
    assert set(keys) == expected, "a record is missing"
    for record in records:
        text = record["response"]
        assert text in served, f"{record['id']}: {text!r} is not an answer the servers sent"
        seed, choice = map(int, re.fullmatch(r"\S+ T=\S+ seed=(\d+) choice=(\d+)", text).groups())
        # the answer to this prompt and temperature, to the request that asked for this sample
        assert text == answer_text(record["prompt"], record["temperature"], seed, choice)
        first = (record["prompt_id"], record["temperature"], record["sample_index"] - choice)
        assert seed == request_seed(SEED, first), record["id"]


def test_one_run_and_a_killed_run_with_one_rerun_finish_through_flaky_servers(tmp_path, tiny_target_dir):
    data = translation_file(tmp_path, PROMPTS)
    with FaultServer(0.4, 3 * TIMEOUT, seed=1) as one, FaultServer(0.4, 3 * TIMEOUT, seed=2) as two:
        recipe = write_recipe(tmp_path / "recipe.yaml", tiny_target_dir, data, [one.base_url, two.base_url])
        finished(polydraft(recipe, tmp_path / "once"))
        served = one.served | two.served
        assert_every_record_once_with_the_servers_text(tmp_path / "once" / "distill", data, served)

        killed = polydraft(recipe, tmp_path / "killed")
        partial = tmp_path / "killed" / "distill.partial"
        deadline = time.monotonic() + 120
        try:
            while killed.poll() is None and time.monotonic() < deadline:
                if written(partial) >= 20:
                    break
                time.sleep(0.02)
            assert killed.poll() is None, "the run ended before it could be killed"
        finally:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
        assert 0 < written(partial) < PROMPTS * len(TEMPERATURES) * SAMPLES
        finished(polydraft(recipe, tmp_path / "killed"))
        served = one.served | two.served
        assert_every_record_once_with_the_servers_text(tmp_path / "killed" / "distill", data, served)
        faults = one.counts + two.counts
    print("requests by outcome over both servers:", dict(faults))
    assert all(faults[f] > 0 for f in FAULTS), faults
    assert sum(faults[f] for f in FAULTS) >= 0.3 * sum(faults.values())
