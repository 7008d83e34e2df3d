"""The measure stage on a tiny run: rows, losslessness checks, summary and plots, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from polydraft.decoding.measurement.results import RESULTS_FILE, read_rows
from polydraft.models.tiny import build_llama
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.schema import DataConfig, MeasureConfig, SourceConfig
from tests.decoding_helpers import single_thread_fixture
from tests.measure_setup import PAIRS, measure_context, measure_recipe, run_measure, write_drafters

single_thread = single_thread_fixture()


@pytest.fixture(scope="module")
def finetune_dir(tmp_path_factory, tiny_tokenizer, tiny_target):
    """Two 'finetuned' drafters (`write_drafters`), and a file next to them that is not one."""
    folder = write_drafters(tmp_path_factory.mktemp("finetune"), tiny_tokenizer, tiny_target)
    (folder / "de-en.metrics.json").write_text("{}")  # files next to the drafters are ignored
    return folder


def test_measure_writes_rows_summary_and_plots_and_resumes(tmp_path, tiny_target_dir, finetune_dir):
    ctx = measure_context(tmp_path, {"finetune": finetune_dir})
    result = run_measure(measure_recipe(tiny_target_dir), ctx, tiny_target_dir)
    rows = [json.loads(line) for line in (ctx.work_dir / RESULTS_FILE).read_text().splitlines()]
    # 2 sets x 2 temperatures x 2 seeds; per group: ar + 2 drafters x (sd K=3, sd K=2, sd beta_ts, rsd_c, rsd_s, assisted)
    assert len(rows) == 8 * 13
    methods = {r["method"] for r in rows}
    assert methods == {"ar"} | {
        f"{d}[{p}] {s}"
        for p in PAIRS
        for d, s in [
            ("sd", "K=3"),
            ("sd", "K=2"),
            ("sd", "beta_ts"),
            ("rsd_c", "2-1"),
            ("rsd_s", "2x2"),
            ("assisted", "K=3"),
        ]
    }
    for row in rows:
        assert row["prompts"] == 2 and row["group_rows"] == 13
        # each prompt kept, in the group's order, for comparisons paired by prompt
        assert len(row["per_prompt"]) == 2
        assert sum(p["new_tokens"] for p in row["per_prompt"]) == row["new_tokens"]
        assert sum(p["target_calls"] for p in row["per_prompt"]) == row["target_calls"]
        assert sum(p["wall_seconds"] for p in row["per_prompt"]) == pytest.approx(row["wall_seconds"])
        assert row["hardware"] and row["date"] and row["device"] == "cpu"
        if row["temperature"] == 0:
            assert row["matches_ar"] is True, row["method"]
        else:
            assert row["matches_ar"] is None
        if row["decoder"] == "ar":
            assert row["speedup"] == 1.0 and row["block_efficiency"] == 1.0 and row["drafter"] is None
        else:
            assert row["in_domain"] == (row["drafter_pair"] == row["dataset_pair"])
            assert 0 < row["size_ratio"] < 1 and row["speedup"] > 0
        if row["decoder"] in ("sd", "rsd_c", "rsd_s"):
            assert row["acceptance_rate"] is not None and row["target_calls"] >= 1
        if row["decoder"] == "ar":
            assert row["predicted_speedup"] == 1.0  # one target step per token
        elif row["decoder"] == "assisted":
            assert row["predicted_speedup"] is None  # transformers' loop reports no rounds
        else:
            assert row["predicted_speedup"] > 0
    latency = json.loads((ctx.work_dir / "latency.json").read_text())
    # sd drafts up to K = max(3, 2, Beta-TS's cap 10); trees of up to 2 + 2 (rsd_c 2-1) or 4 (rsd_s 2x2) nodes
    assert sorted(map(int, latency["target"]["chain"])) == [1]
    assert sorted(map(int, latency["target"]["tree"])) == [2, 3, 4, 5]
    assert sorted(latency["drafters"]) == PAIRS and latency["drafters"]["de-en"]["tree"].keys() == {"1", "2"}
    rounds = latency["rounds"]["de-en"]
    assert sorted(map(int, rounds["verify"])) == list(range(1, 12)) and len(rounds["draft"]) == 10
    sweep = [r for r in rows if r["method"] == "sd[de-en] K=2"]
    assert {r["draft_length"] for r in sweep} == {2} and {r["control"] for r in sweep} == {"fixed"}
    summary = (ctx.work_dir / "summary.md").read_text()
    assert "## Wall-clock speedup over ar" in summary and "| sd[de-en] K=3 |" in summary
    assert "(n = 2 repetitions)" in summary and " (predicted " in summary
    assert "de-en T=0" in summary and "Every method produced exactly `ar`'s tokens" in summary
    for plot in ("block_efficiency.png", "speedup.png", "speedup_vs_k.png"):
        assert (ctx.work_dir / plot).read_bytes()[:4] == b"\x89PNG"
    assert any(m["method"] == "sd[de-en] K=3" and m["speedup"] for m in result.metrics["methods"])

    # a run killed while appending: the last group is torn; a rerun measures only that group again
    text = (ctx.work_dir / RESULTS_FILE).read_text()
    lines = text.splitlines(keepends=True)
    (ctx.work_dir / RESULTS_FILE).write_text("".join(lines[:-5]) + lines[-5][:20])
    assert len(read_rows(ctx.work_dir / RESULTS_FILE)) == 7 * 13
    run_measure(measure_recipe(tiny_target_dir), ctx, tiny_target_dir)
    again = [json.loads(line) for line in (ctx.work_dir / RESULTS_FILE).read_text().splitlines()]
    assert len(again) == 8 * 13
    assert again[: 7 * 13] == rows[: 7 * 13]  # finished groups were not measured again
    assert {r["dataset"] for r in again[7 * 13 :]} == {rows[-1]["dataset"]}


def test_extra_trees_are_measured_each_as_a_row_of_its_own(tmp_path, tiny_target_dir, finetune_dir):
    """seed 002 Exp2: several trees of one target budget B (node count) side by side, at one budget."""
    ctx = measure_context(tmp_path, {"finetune": finetune_dir})
    recipe = measure_recipe(
        tiny_target_dir, temperatures=[0.3], seeds=[0], decoders=["ar", "sd", "rsd_c", "rsd_s"],
        controls=["fixed"], k_sweep=[], draft_length=4, cross_pairs=False, branching=[2, 1],
        rsd_c_trees=[[2, 2], [3, 1], [2, 1]], beam_width=2, beam_depth=2, rsd_s_trees=[[3, 2], [2, 2]],
    )  # fmt: skip
    run_measure(recipe, ctx, tiny_target_dir)
    trees = {(r.decoder, r.tree) for r in read_rows(ctx.work_dir / RESULTS_FILE) if r.tree is not None}
    # each label once: the repeated [2, 1] and [2, 2] are not measured twice
    assert trees == {("rsd_c", "2-1"), ("rsd_c", "2-2"), ("rsd_c", "3-1"), ("rsd_s", "2x2"), ("rsd_s", "3x2")}


def test_extra_drafters_in_a_pair_folder_follow_cross_pairs(tmp_path, tiny_target_dir, finetune_dir):
    """An extra drafter at `.../de-en` is the de-en drafter: without cross_pairs it is measured on de-en
    only, and its rows carry the pair; one in a folder of another name is measured on every set."""
    generic = tmp_path / "generic"
    generic.symlink_to(finetune_dir / "fr-en", target_is_directory=True)
    ctx = measure_context(tmp_path, {})
    extras = {"mine_de": str(finetune_dir / "de-en"), "other": str(generic)}
    recipe = measure_recipe(
        tiny_target_dir, temperatures=[0.0], seeds=[0], decoders=["ar", "sd"], controls=["fixed"], k_sweep=[],
        cross_pairs=False, extra_drafters=extras,
    )  # fmt: skip
    run_measure(recipe, ctx, tiny_target_dir)
    rows = [r for r in read_rows(ctx.work_dir / RESULTS_FILE) if r.decoder == "sd"]
    measured = sorted((r.drafter, r.dataset, r.drafter_pair) for r in rows)
    assert measured == [("mine_de", "de-en", "de-en"), ("other", "de-en", None), ("other", "fr-en", None)]


def test_measure_without_drafters_runs_ar_only(tmp_path, tiny_target_dir):
    ctx = measure_context(tmp_path, {})
    run_measure(measure_recipe(tiny_target_dir, temperatures=[0.0], seeds=[0]), ctx, tiny_target_dir)
    rows = read_rows(ctx.work_dir / RESULTS_FILE)
    assert [r.method for r in rows] == ["ar", "ar"]


def test_measure_refuses_a_drafter_with_another_vocabulary(tmp_path, tiny_target_dir, tiny_tokenizer):
    folder = tmp_path / "finetune" / "de-en"
    build_llama(len(tiny_tokenizer) + 7, 32, 1, 2, 64).save_pretrained(folder)
    ctx = measure_context(tmp_path, {"finetune": folder.parent})
    with pytest.raises(StageFailed, match="must use the target's vocabulary"):
        run_measure(measure_recipe(tiny_target_dir), ctx, tiny_target_dir)


def test_measure_needs_eval_sets(tmp_path, tiny_target_dir):
    bad = measure_recipe(tiny_target_dir)
    bad = bad.model_copy(update={"data": DataConfig(pairs=PAIRS)})
    with pytest.raises(StageFailed, match="data.eval is empty"):
        run_measure(bad, measure_context(tmp_path, {}), tiny_target_dir)


def test_measure_config_errors():
    with pytest.raises(ValueError, match="must include `ar`"):
        MeasureConfig(decoders=["sd"])
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        MeasureConfig(k_sweep=[0])
    with pytest.raises(ValueError, match="beta_prior"):
        MeasureConfig(beta_prior=[1.0])
    with pytest.raises(ValueError, match=r"rsd_s_trees: each tree is \[W, L\]"):
        MeasureConfig(rsd_s_trees=[[2, 3, 1]])


def test_eval_prompts_are_built_like_distill_prompts(tmp_path, tiny_tokenizer):
    """Chat rows give their first user turn in the Vicuna format; over-long prompts are skipped, counted."""
    from polydraft.data.prompts import build_prompt, encode_prompt
    from polydraft.pipelines.schema.inputs import EvalPrompts

    rows = [
        {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi"}]},
        {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "human", "value": "Name a colour"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = SourceConfig(kind="local", format="chat", path=str(path), name="chat")
    base = measure_recipe(tmp_path)
    recipe = base.model_copy(update={"data": DataConfig(pairs=PAIRS, eval=[source])})
    sets = EvalPrompts.of(recipe).load(5, 200, tiny_tokenizer)
    (chat,) = sets
    assert chat.name == "chat" and chat.pair is None and chat.skipped_long == 1
    expected = [
        encode_prompt(tiny_tokenizer, build_prompt([{"role": "user", "content": text}], "vicuna"))
        for text in ("Hello there", "Name a colour")
    ]
    assert sorted(p.tolist() for p in chat.prompts) == sorted(expected)


def test_measure_names_the_decoder_a_target_cannot_run(tmp_path, tiny_tokenizer):
    """Trees past a sliding window are refused: the stage fails saying which decoder to drop."""
    from transformers import MistralConfig, MistralForCausalLM

    tok = tiny_tokenizer
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=64, sliding_window=8,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    target_dir, finetune = tmp_path / "target", tmp_path / "finetune"
    for folder in (target_dir, finetune / "de-en"):
        MistralForCausalLM(config).save_pretrained(folder)
        tok.save_pretrained(folder)
    ctx = measure_context(tmp_path, {"finetune": finetune})
    with pytest.raises(StageFailed, match="remove `rsd_s` from measure.decoders"):
        run_measure(
            measure_recipe(target_dir, decoders=["ar", "rsd_s"], temperatures=[0.0], seeds=[0]),
            ctx,
            target_dir,
        )


def test_disjoint_prompts_give_each_seed_its_own_prompts(tmp_path, tiny_target_dir, monkeypatch):
    import polydraft.pipelines.stages.measure as stage
    from polydraft.decoding.measurement.eval_inputs import repetition_prompts

    decoded = []
    group = stage.measure_group

    def recording(build, prompts, warmed):
        decoded.append([p.tolist() for p in prompts])
        return group(build, prompts, warmed)

    monkeypatch.setattr(stage, "measure_group", recording)
    settings = {"temperatures": [0.0], "seeds": [5, 6, 7], "num_prompts": 2, "disjoint_prompts": True}
    ctx = measure_context(tmp_path, {})
    run_measure(measure_recipe(tiny_target_dir, **settings), ctx, tiny_target_dir)
    assert len(decoded) == 6 and all(len(prompts) == 2 for prompts in decoded)
    for first in (0, 3):  # per eval set: 3 seeds x 2 prompts, 6 different prompts
        seen = [tuple(p) for prompts in decoded[first : first + 3] for p in prompts]
        assert len(set(seen)) == 6
    assert {r.seed for r in read_rows(ctx.work_dir / RESULTS_FILE)} == {5, 6, 7}
    prompts = [torch.tensor([i]) for i in range(5)]
    assert repetition_prompts(prompts, [5, 6], 6, 2, True) == prompts[2:4]
    assert repetition_prompts(prompts, [5, 6], 6, 2, False) == prompts
    with pytest.raises(ValueError, match="too few for 3 disjoint repetitions of 2"):
        repetition_prompts(prompts, [5, 6, 7], 7, 2, True)


def _decoded(rows) -> dict:
    """What decoding produced, per group and method (not its timings)."""
    return {
        (r.group, r.method): (r.new_tokens, r.target_calls, r.block_efficiency, r.matches_ar, r.eos_stops)
        for r in rows
    }


def test_two_measure_processes_decode_what_one_does_and_a_rerun_keeps_their_groups(
    tmp_path, tiny_target_dir, finetune_dir
):
    """measure.processes=2: the groups dealt to two processes (each its own copy of the target), gathered
    into results.jsonl; a kill leaves each process's finished groups in its part file for the rerun."""
    upstream = {"finetune": finetune_dir}
    decoders = {"decoders": ["ar", "sd", "rsd_s"], "controls": ["fixed"], "k_sweep": []}
    one_ctx = measure_context(tmp_path / "one", upstream)
    run_measure(measure_recipe(tiny_target_dir, **decoders), one_ctx, tiny_target_dir)
    one = read_rows(one_ctx.work_dir / RESULTS_FILE)
    two_ctx = measure_context(tmp_path / "two", upstream)
    recipe = measure_recipe(tiny_target_dir, **decoders, processes=2)
    run_measure(recipe, two_ctx, tiny_target_dir)
    path = two_ctx.work_dir / RESULTS_FILE
    two = read_rows(path)
    assert len(two) == len(one) == 8 * 5  # 8 groups x (ar + sd and rsd_s with each of 2 drafters)
    assert _decoded(two) == _decoded(one)
    logs = sorted(p.name for p in two_ctx.work_dir.glob("measure.part*.log"))
    assert logs == ["measure.part0.log", "measure.part1.log"]
    assert not list(two_ctx.work_dir.glob("results.part*")) and (two_ctx.work_dir / "latency.json").is_file()
    # a kill: results.jsonl has 3 groups, process 1's part file 2 more and half of a third
    groups = sorted({r.group for r in two}, key=str)
    kept, part = groups[:3], groups[3:5]
    path.write_text("".join(r.model_dump_json() + "\n" for r in two if r.group in kept))
    torn = [r for r in two if r.group == groups[5]][:2]
    (two_ctx.work_dir / "results.part1.jsonl").write_text(
        "".join(r.model_dump_json() + "\n" for r in [*(r for r in two if r.group in part), *torn])
    )
    before = {r.group: r.date for r in two}
    run_measure(recipe, two_ctx, tiny_target_dir)
    again = read_rows(path)
    assert _decoded(again) == _decoded(one)
    assert len(again) == len(one)  # every group once
    kept_dates = {r.group: r.date for r in again if r.group in kept + part}
    assert kept_dates == {g: before[g] for g in kept + part}  # finished groups were not decoded again


def test_processes_that_end_well_without_rows_fail_the_stage(tmp_path, tiny_target_dir, monkeypatch):
    """Measure processes that exit 0 but write no rows (a process that skipped its groups): the stage fails
    naming a group without rows, instead of completing with groups missing."""
    import subprocess
    import sys

    from polydraft.pipelines.runtime.contract import StageFailed
    from polydraft.pipelines.stages import measure as stage

    def idle(spec_path, rank, processes, local_rank, per_node, per_copy):
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(stage, "_start", idle)
    recipe = measure_recipe(tiny_target_dir, decoders=["ar"], controls=["fixed"], k_sweep=[], processes=2)
    with pytest.raises(StageFailed, match=r"8 group\(s\) have no rows after every process ended well"):
        run_measure(recipe, measure_context(tmp_path, {}), tiny_target_dir)
