"""The vllm backend without vLLM: engine and sampling arguments, output parsing, the submission loop
around a stand-in engine (only vLLM's own `LLM.generate` is not run here), and the install message."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from distill.plan import PromptItem, Request, request_seed
from distill.vllm_backend import INSTALL_HINT, engine_inputs, engine_kwargs, generate_vllm, parse_output
from pipelines.stage import StageFailed
from tests.distill_setup import local_source, make_recipe, run_distill, translation_file


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


def test_requests_carry_token_ids_and_one_sampling_setting_per_prompt():
    requests = [Request(_item("a", [1, 5, 6]), 0.0, [0]), Request(_item("b", [1, 7]), 0.7, [1, 2])]
    prompts, params = engine_inputs(requests, top_p=0.95, max_new_tokens=32, stop=["</s>"], seed=3)
    assert prompts == [{"prompt_token_ids": [1, 5, 6]}, {"prompt_token_ids": [1, 7]}]
    assert params[0] == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 0.95,
        "max_tokens": 32,
        "stop": ["</s>"],
        "seed": request_seed(3, ("a", 0.0, 0)),
    }
    assert params[1]["n"] == 2 and params[1]["seed"] == request_seed(3, ("b", 0.7, 1))
    with pytest.raises(ValueError, match="no token ids"):
        engine_inputs([Request(_item("c", None), 0.0, [0])], 1.0, 8, [], 0)


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
        Engine(), requests, top_p=1.0, max_new_tokens=4, stop=[], seed=0, submit_size=None,
        emit=lambda r, s, g: done.append((r.item.id, r.temperature, s, g.text)),
        fail=lambda r, s, why: failed.append(why),
    )  # fmt: skip
    assert [len(p) for p, _ in calls] == [3, 3]
    assert {p["temperature"] for p in calls[1][1]} == {1.0}
    assert len(done) == 3 + 6 and not failed
    assert ("b", 1.0, 1, "s1") in done

    calls.clear()
    generate_vllm(
        Engine(), requests, top_p=1.0, max_new_tokens=4, stop=[], seed=0, submit_size=2,
        emit=lambda *a: None, fail=lambda *a: None,
    )  # fmt: skip
    assert [len(p) for p, _ in calls] == [2, 1, 2, 1]


def test_missing_vllm_is_a_clear_error(tmp_path, tiny_target_dir, monkeypatch):

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not
    recipe = make_recipe(tiny_target_dir, [local_source(translation_file(tmp_path, 1))], backend="vllm")
    with pytest.raises(StageFailed) as err:
        run_distill(recipe, tiny_target_dir, tmp_path / "run" / "distill")
    assert str(err.value) == INSTALL_HINT and "pip install -e .[vllm]" in str(err.value)
