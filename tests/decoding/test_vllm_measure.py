"""The measure stage with `measure.vllm: require` on the real CPU build of vLLM (`decoding.measurement.vllm_measure` in
a subprocess): the demo target drafting for itself, where the greedy answer is known exactly (every vLLM
draft token accepted, output identical to vLLM's target alone), rows of both engines in one results.jsonl,
and a rerun that keeps them without starting vLLM again."""

from __future__ import annotations

import polydraft.pipelines.stages.measure as measure_stage
from polydraft.decoding.measurement.results import RESULTS_FILE, read_rows
from polydraft.decoding.measurement.vllm_report import engine_differences
from tests.measure_setup import PAIRS, measure_context, measure_recipe, run_measure
from tests.vllm_setup import demo_target, require_vllm


def test_measure_stage_adds_vllm_rows_beside_polydrafts(tmp_path, monkeypatch):
    require_vllm()
    target = demo_target()
    recipe = measure_recipe(
        target, decoders=["ar", "sd"], controls=["fixed"], k_sweep=[], temperatures=[0.0], seeds=[0],
        max_new_tokens=16, extra_drafters={"self": str(target)}, vllm="require", vllm_batch_sizes=[1, 2],
    )  # fmt: skip
    ctx = measure_context(tmp_path, {})
    run_measure(recipe, ctx, target)
    rows = read_rows(ctx.work_dir / RESULTS_FILE)
    vllm = [r for r in rows if r.engine == "vllm"]
    assert [(r.dataset, r.method) for r in vllm] == [(p, "sd[self] K=3 (vLLM)") for p in PAIRS]
    for row in vllm:
        assert row.device == "cpu" and row.engine_detail.startswith("vLLM 0.32.0") and row.group_rows == 1
        assert row.prompts == 2 and row.matches_ar is True  # greedy: identical to vLLM's target alone
        assert row.acceptance_per_position == [1.0, 1.0, 1.0] and row.acceptance_rate == 1.0
        assert row.mean_accepted_length == 3.0 and row.size_ratio == 1.0
        # the counters cover both batch-size passes; after the prefill every call yields up to 4 tokens
        assert row.block_efficiency == 2 * row.new_tokens / row.target_calls
        assert 2.0 < row.block_efficiency <= 4.0
        assert [b.batch_size for b in row.batch_rates] == [1, 2]
        assert all(b.with_drafter > 0 and b.without_drafter > 0 for b in row.batch_rates)
    own = {r.dataset: r for r in rows if r.engine == "polydraft" and r.method == "sd[self] K=3"}
    assert set(own) == set(PAIRS) and all(r.matches_ar for r in own.values())
    print({p: (own[p].block_efficiency, v.block_efficiency) for p, v in zip(PAIRS, vllm)})
    assert engine_differences(rows) == []
    assert "## vLLM beside polydraft's engine" in (ctx.work_dir / "summary.md").read_text()

    def no_engine(request):
        raise AssertionError("the rerun started vLLM again")

    monkeypatch.setattr(measure_stage, "measure_subprocess", no_engine)
    run_measure(recipe, ctx, target)
    assert read_rows(ctx.work_dir / RESULTS_FILE) == rows
