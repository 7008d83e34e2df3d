"""The `openai` backend: against a real `transformers serve` process on 127.0.0.1, against a server
that is not there, and with one of two data-parallel servers down (then a rerun retries just those)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from polydraft.distill.openai_backend import (
    PATHS,
    REQUEST_OPTIONS,
    MalformedAnswer,
    backoff_delay,
    parse_body,
    parse_response,
    request_body,
    retry_after,
    retryable,
)
from polydraft.distill.requests import PromptItem, Request
from polydraft.distill.store import iter_records, record_key
from polydraft.pipelines.runtime.contract import StageFailed
from tests.distill_setup import free_port, local_source, make_recipe, run_distill, translation_file

SECRET = "sk-polydraft-test-secret-0123456789"


@pytest.fixture(scope="module")
def served_model(tmp_path_factory, tiny_target_dir):
    """`transformers serve` on a copy of the tiny target whose generation_config samples (the server
    only samples when `do_sample` is true there); yields (model folder, base URL)."""
    root = tmp_path_factory.mktemp("served")
    model = root / "model"
    shutil.copytree(tiny_target_dir, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "do_sample": True}))
    hf_home = root / "hf_home"
    (hf_home / "hub").mkdir(parents=True)  # /v1/models lists the hub cache, which must exist
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    log_file = open(root / "serve.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [str(cli), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base_url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"transformers serve did not start: {(root / 'serve.log').read_text()[-2000:]}"
                )
            time.sleep(0.25)
        yield model, f"{base_url}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()


def openai_recipe(model: Path, data: Path, temperatures: tuple[float, ...] = (0.7, 1.0), **openai):
    return make_recipe(
        model,
        [local_source(data)],
        backend="openai",
        temperatures=list(temperatures),
        samples_per_prompt=2,
        max_new_tokens=6,
        openai={"max_in_flight": 4, **openai},
    )


def test_transformers_serve_two_temperatures_two_samples(tmp_path, served_model, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from polydraft.data.prompts import encode_prompt

    model, base_url = served_model
    monkeypatch.setenv("POLYDRAFT_TEST_KEY", SECRET)
    data = translation_file(tmp_path, 2)
    recipe = openai_recipe(model, data, base_urls=[base_url], api_key_env="POLYDRAFT_TEST_KEY")
    work = tmp_path / "run" / "distill"
    with caplog.at_level(logging.DEBUG):
        result = run_distill(recipe, model, work)

    records = list(iter_records(work))
    keys = [record_key(r) for r in records]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2
    assert {(t, s) for _, t, s in keys} == {(0.7, 0), (0.7, 1), (1.0, 0), (1.0, 1)}
    assert (
        result.metrics["records_per_temperature"]["0.7"] == 4
        and result.metrics["records_per_temperature"]["1"] == 4
    )
    # the server ignores `n`: the missing samples went as separate requests, with their own seeds
    assert result.metrics["server"]["n_fallbacks"] >= 1
    for prompt_id in {k[0] for k in keys}:
        samples = [r for r in records if r["prompt_id"] == prompt_id and r["temperature"] == 1.0]
        assert samples[0]["seed"] != samples[1]["seed"]
        assert samples[0]["response"] != samples[1]["response"]
    assert all(0 < r["response_tokens"] <= 6 for r in records)
    # the completions endpoint saw exactly the tokens the hf backend would feed (BOS + prompt)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert all(r["prompt_tokens"] == len(encode_prompt(tokenizer, r["prompt"])) for r in records)
    assert all("token_ids" not in r for r in records)  # transformers serve cannot return them
    assert all(r["backend"] == "openai" and r["model"] == str(model) for r in records)
    # the API key is never written anywhere
    written = "".join(p.read_text(encoding="utf-8") for p in work.rglob("*") if p.is_file())
    assert SECRET not in written and SECRET not in caplog.text and SECRET not in json.dumps(result.metrics)


def test_chat_endpoint_records_the_template_the_server_applies(tmp_path, served_model):
    from transformers import AutoTokenizer

    from polydraft.data.prompts import encode_prompt

    model, base_url = served_model
    data = translation_file(tmp_path, 2)
    recipe = make_recipe(
        model,
        [local_source(data)],
        backend="openai",
        prompt_format="chat_template",
        temperatures=[0.0],
        max_new_tokens=4,
        openai={"base_urls": [base_url], "endpoint": "chat"},
    )
    work = tmp_path / "run" / "distill"
    run_distill(recipe, model, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for record in iter_records(work):
        assert record["prompt"] == tokenizer.apply_chat_template(
            record["messages"], tokenize=False, add_generation_prompt=True
        )
        # the server tokenized the rendered template as it is, without adding a BOS token (vLLM does
        # the same for chat requests): a quirk the README warns about
        assert record["prompt_tokens"] == len(
            tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        )
        assert record["prompt_tokens"] == len(encode_prompt(tokenizer, record["prompt"])) - 1


def test_unreachable_server_fails_clearly_after_the_retries(tmp_path, tiny_target_dir):

    data = translation_file(tmp_path, 3)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    recipe = openai_recipe(
        tiny_target_dir, data, base_urls=[dead], max_retries=2, backoff=0.01, max_backoff=0.02
    )
    work = tmp_path / "run" / "distill"
    with pytest.raises(StageFailed) as err:
        run_distill(recipe, tiny_target_dir, work)
    message = str(err.value)
    assert "12 of 12 records failed" in message and "--only distill" in message
    # the aiohttp transport calls a refused connection a timeout; the reason names the real cause
    assert "ConnectionRefusedError" in message and "3 attempt(s)" in message
    failures = [json.loads(line) for line in (work / "failures.jsonl").read_text().splitlines()]
    assert len(failures) == 12 and all("ConnectionRefusedError" in f["reason"] for f in failures)


def test_one_dead_server_of_two_then_rerun_retries_only_the_failed(tmp_path, served_model):

    model, base_url = served_model
    data = translation_file(tmp_path, 4)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    work = tmp_path / "run" / "distill"
    both = openai_recipe(model, data, (1.0,), base_urls=[base_url, dead], max_in_flight=2, max_retries=0)
    with pytest.raises(StageFailed, match="rerun `polydraft run RECIPE --only distill`"):
        run_distill(both, model, work)
    kept = {record_key(r) for r in iter_records(work)}
    failed = [json.loads(line) for line in (work / "failures.jsonl").read_text().splitlines()]
    assert kept and failed and len(kept) + len(failed) == 4 * 2
    assert not kept & {(f["prompt_id"], f["temperature"], f["sample_index"]) for f in failed}

    # the dead server is dropped from the recipe (an operational change): the rerun resumes
    result = run_distill(openai_recipe(model, data, (1.0,), base_urls=[base_url]), model, work)
    keys = [record_key(r) for r in iter_records(work)]
    assert len(keys) == len(set(keys)) == 8
    assert result.metrics["generated_this_run"] == len(failed)
    assert not (work / "failures.jsonl").exists()


def _request(temperature: float, indices: list[int]) -> Request:
    item = PromptItem(
        id="0:a", source="s", pair="de-en", messages=[{"role": "user", "content": "x"}], prompt="P"
    )
    return Request(item, temperature, indices)


def test_request_building_and_answer_parsing():
    from polydraft.distill.openai_backend import ServerSettings

    settings = ServerSettings(["u"], "m", "completions", SECRET, 1, 1.0, 0, 0.0, 0.0, 1, True)
    body = request_body(
        _request(0.7, [1, 2]), [1, 2], settings, top_p=0.9, max_new_tokens=5, stop=["\n"], seed=3
    )
    assert body["prompt"] == "P" and body["n"] == 2 and body["stop"] == ["\n"]
    assert body["return_token_ids"] is True and "messages" not in body
    assert SECRET not in repr(settings) and SECRET not in str(settings)  # the key stays out of logs
    payload = {
        "choices": [
            {"index": 1, "text": "b", "finish_reason": "length", "token_ids": [5, 6]},
            {"index": 0, "text": "a", "finish_reason": "stop", "token_ids": [4, 2]},
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 4},
    }
    first, second = parse_response(payload, "completions", return_token_ids=True)
    assert (first.text, first.finish_reason, first.token_ids, first.prompt_tokens) == ("a", "stop", [4, 2], 7)
    assert second.response_tokens == 2
    del payload["choices"][0]["token_ids"]
    with pytest.raises(ValueError, match="no token_ids") as err:
        parse_response(payload, "completions", return_token_ids=True)
    assert not retryable(err.value)  # the recipe asks what the server cannot give: no retry helps
    # a 200 that is no usable answer is a server fault, retried
    for broken in ({"choices": []}, {"id": "x"}, {"choices": [{"index": 0, "finish_reason": "stop"}]}):
        with pytest.raises(MalformedAnswer) as err:
            parse_response(broken, "completions", return_token_ids=False)
        assert retryable(err.value)
    # the raw body of a 200: not JSON, or JSON that is no object, is a server fault too
    for broken in (b'{"choices": [{"text": "unfinish', b'["not", "an", "object"]', b"null"):
        with pytest.raises((json.JSONDecodeError, MalformedAnswer)) as err:
            parse_body(broken, "completions", return_token_ids=False)
        assert retryable(err.value), broken
    good = json.dumps({**payload, "choices": payload["choices"][1:]}).encode()
    assert parse_body(good, "completions", return_token_ids=True)[0].token_ids == [4, 2]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_request_sent_is_the_one_create_sends(endpoint):
    """`client.post` with the body built here sends the JSON and headers that `client.completions.create`
    (`client.chat.completions.create`) sends with the same arguments and `extra_body` for vLLM's field."""
    import asyncio

    import httpx2
    import openai

    from polydraft.distill.openai_backend import ServerSettings

    answer = {"id": "x", "object": "text_completion", "created": 0, "model": "m", "choices": []}
    sent: list[httpx2.Request] = []

    def transport(request: httpx2.Request) -> httpx2.Response:
        sent.append(request)
        return httpx2.Response(200, json=answer)

    settings = ServerSettings(["u"], "m", endpoint, SECRET, 1, 1.0, 0, 0.0, 0.0, 1, True)
    request = _request(0.7, [0, 1])
    request.item.messages.append({"role": "assistant", "content": "y"})
    body = request_body(request, [0, 1], settings, top_p=0.9, max_new_tokens=5, stop=["\n", "</s>"], seed=3)
    create_kwargs = {k: v for k, v in body.items() if k != "return_token_ids"}

    async def both() -> None:
        http = httpx2.AsyncClient(transport=httpx2.MockTransport(transport))
        client = openai.AsyncOpenAI(base_url="http://h/v1", api_key=SECRET, max_retries=0, http_client=http)
        resource = client.completions if endpoint == "completions" else client.chat.completions
        await resource.create(**create_kwargs, extra_body={"return_token_ids": True})
        await client.post(PATHS[endpoint], cast_to=bytes, body=body, options=REQUEST_OPTIONS)
        await client.close()

    asyncio.run(both())
    created, posted = sent
    assert (posted.method, posted.url) == (created.method, created.url)
    assert posted.url.path == f"/v1{PATHS[endpoint]}"
    assert json.loads(posted.content) == json.loads(created.content) == body  # keys in another order
    ignored = {"x-stainless-retry-count", "x-stainless-read-timeout", "idempotency-key"}
    assert {k: v for k, v in posted.headers.items() if k not in ignored} == {
        k: v for k, v in created.headers.items() if k not in ignored
    }
    assert posted.headers["authorization"] == f"Bearer {SECRET}"


def test_retry_classification_and_backoff():
    import httpx
    import openai

    request = httpx.Request("POST", "http://x/v1/completions")

    def status_with(code: int, headers: dict[str, str]) -> openai.APIStatusError:
        response = httpx.Response(code, request=request, headers=headers)
        return openai.APIStatusError("e", response=response, body=None)

    def status(code: int) -> openai.APIStatusError:
        return status_with(code, {})

    assert retryable(openai.APIConnectionError(request=request))
    assert retryable(openai.APITimeoutError(request=request))
    assert all(retryable(status(c)) for c in (408, 429, 500, 503))
    assert not any(retryable(status(c)) for c in (400, 401, 404, 422))
    assert retryable(json.JSONDecodeError("Unterminated string", '{"choices": [{"text": "a', 22))
    assert not retryable(ValueError("a wrong setting"))
    limited = (
        {"Retry-After": "2"},
        {"retry-after-ms": "150"},
        {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"},
    )
    waits = [retry_after(status_with(429, h)) for h in limited]
    assert waits == [2.0, 0.15, 0.0] and retry_after(status(500)) == 0.0
    rng = random.Random(0)
    delays = [backoff_delay(a, 1.0, 8.0, rng) for a in range(6)]
    assert all(2**a / 2 <= d <= 2**a for a, d in enumerate(delays[:4]))
    assert all(4.0 <= d <= 8.0 for d in delays[4:])  # capped
