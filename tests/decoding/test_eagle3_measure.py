"""The measure stage with EAGLE-3 heads: `eagle3` rows beside `sd`'s, in and out of domain, with their latency
model; in mixed traffic each head alone, the routed heads and the oracle, and the routed-vs-multilingual
decision for heads beside the drafters'; a head of another target refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.mixed import decisions, read_groups
from polydraft.decoding.measurement.results import read_rows
from polydraft.decoding.sampling import Sampling
from polydraft.models.eagle3 import save_eagle3
from polydraft.pipelines.runtime.contract import StageFailed
from tests.decoding.test_decoding_measure import finetune_dir  # noqa: F401 (the module's drafters fixture)
from tests.decoding_helpers import single_thread_fixture
from tests.eagle3_setup import fit_eagle3
from tests.measure_setup import PAIRS, measure_context, measure_recipe, run_measure

single_thread = single_thread_fixture()
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, tiny_target):
    """An eagle3 stage folder: a head per pair and a multilingual one, fitted to the tiny target's outputs."""
    folder = tmp_path_factory.mktemp("eagle3")
    target = CachedLM(tiny_target)
    sequence = torch.arange(5, 12)
    sequence = torch.cat(
        [
            sequence,
            torch.tensor(autoregressive(target, sequence, 20, Sampling(), torch.Generator(), set()).tokens),
        ]
    )
    for index, name in enumerate([*PAIRS, "multilingual"]):
        head = fit_eagle3(tiny_target, LAYERS, [sequence], steps=5 + 5 * index, seed=index)
        save_eagle3(head, folder / name, verifier="tiny", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3,
                    info={"pair": name, "aux_layers": LAYERS})  # fmt: skip
    return folder


def test_heads_are_measured_beside_the_drafters_and_in_mixed_traffic(
    tmp_path,
    tiny_target_dir,
    eagle3_dir,
    finetune_dir,  # noqa: F811
):
    finetuned = tmp_path / "finetune"
    shutil.copytree(finetune_dir, finetuned)
    shutil.copytree(finetuned / "fr-en", finetuned / "multilingual")
    recipe = measure_recipe(
        tiny_target_dir, decoders=["ar", "sd", "eagle3"], controls=["fixed", "beta_ts"], k_sweep=[],
        temperatures=[0.0], mixed=True, disjoint_prompts=True, eagle3_draft_length=2,
    )  # fmt: skip
    ctx = measure_context(tmp_path, {"finetune": finetuned, "eagle3": eagle3_dir})
    run_measure(recipe, ctx, tiny_target_dir)
    rows = [r for r in read_rows(ctx.work_dir / "results.jsonl") if r.decoder == "eagle3"]
    labels = {r.method for r in rows}
    assert labels == {f"eagle3[{n}] {c}" for n in (*PAIRS, "multilingual") for c in ("K=2", "beta_ts")}
    assert all(r.drafter_kind == "eagle3" and r.matches_ar for r in rows)
    for row in rows:  # each pair's head on its own pair is in domain, on the other out of it
        pair = row.drafter.removeprefix("eagle3-")
        expected = None if pair == "multilingual" else pair == row.dataset_pair
        assert row.in_domain is expected, row.method
        assert row.predicted_speedup is not None and row.block_efficiency >= 1.0
    latency = json.loads((ctx.work_dir / "latency.json").read_text())
    assert len(latency["rounds"]["eagle3-de-en"]["draft"]) >= 2

    methods = {r.method for g in read_groups(ctx.work_dir) for r in g.rows}
    heads = {f"eagle3-{n}" for n in (*PAIRS, "multilingual", "routed", "oracle")}
    assert heads <= methods and {"routed", "oracle", "multilingual"} <= methods
    for group in read_groups(ctx.work_dir):  # the router's choice is recorded once per request
        assert len(group.requests) == 2 * len(PAIRS)
        assert all(r.matches_ar for r in group.rows)
    names = {d.names for d in decisions(read_groups(ctx.work_dir))}
    assert names == {("routed", "multilingual"), ("eagle3-routed", "eagle3-multilingual")}
    assert "eagle3-routed" in (ctx.work_dir / "summary.md").read_text()


def test_a_head_of_another_target_is_refused(tmp_path, tiny_target_dir, eagle3_dir):
    other = tmp_path / "eagle3"
    shutil.copytree(eagle3_dir, other)
    config = json.loads((other / "de-en" / "config.json").read_text())
    config["target_hidden_size"] = 48
    (other / "de-en" / "config.json").write_text(json.dumps(config))
    recipe = measure_recipe(tiny_target_dir, decoders=["ar", "eagle3"], temperatures=[0.0], k_sweep=[])
    with pytest.raises((StageFailed, RuntimeError), match="another target|size mismatch"):
        run_measure(recipe, measure_context(tmp_path, {"eagle3": other}), tiny_target_dir)
