"""`measure.mixed`: every pair's held-out prompts interleaved, with each drafter alone, the multilingual
drafter, the routed per-language drafters (router time included) and the oracle, composed from the per-pair
groups' per-prompt results; rows per pair and overall, group files, and the decision between routed and
multilingual."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from polydraft.decoding.measurement.eval_inputs import EvalSet
from polydraft.decoding.measurement.mixed import (
    Composed,
    MixedGroup,
    MixedRow,
    decisions,
    group_of,
    markdown,
    mixed_traffic,
    read_groups,
)
from polydraft.decoding.measurement.results import PromptResult, read_rows, write_rows
from polydraft.pipelines.export.routing import LanguageRouter
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.schema import DataConfig, MeasureConfig, Recipe, SourceConfig, TargetConfig
from tests.decoding.test_decoding_measure import finetune_dir  # noqa: F401 (the module's drafters fixture)
from tests.decoding_helpers import single_thread_fixture
from tests.measure_setup import PAIRS, measure_context, measure_recipe, run_measure

single_thread = single_thread_fixture()


def _set(pair: str, count: int) -> EvalSet:
    return EvalSet(
        f"{pair}-set",
        pair,
        [torch.tensor([i]) for i in range(count)],
        [f"{pair} text {i}" for i in range(count)],
    )


def test_the_mixed_traffic_interleaves_each_pairs_prompts_of_the_repetition():
    sets = [_set("de-en", 6), _set("fr-en", 6), EvalSet("chat", None, [torch.tensor([9])], ["x"])]
    traffic = mixed_traffic(sets, [0, 1, 2], 1, 2, disjoint=True)
    # seed 1 of 3 with 2 prompts each: prompts 2 and 3 of each pair, alternating pairs; pair-less sets left
    # out; each the first or second prompt its pair's group of that repetition decoded
    assert [(p.pair, p.dataset, p.index, p.position, p.text) for p in traffic] == [
        ("de-en", "de-en-set", 2, 0, "de-en text 2"),
        ("fr-en", "fr-en-set", 2, 0, "fr-en text 2"),
        ("de-en", "de-en-set", 3, 1, "de-en text 3"),
        ("fr-en", "fr-en-set", 3, 1, "fr-en text 3"),
    ]
    assert len(mixed_traffic(sets, [0, 1, 2], 1, 2, disjoint=False)) == 12
    with pytest.raises(ValueError, match=r"at least two language pairs.*\['de-en'\]"):
        mixed_traffic(sets[:1], [0], 0, 2, disjoint=False)


def _results(*values: tuple[int, float]) -> list[PromptResult]:
    """(target calls, seconds) per request, 4 tokens each."""
    return [PromptResult(new_tokens=4, target_calls=c, wall_seconds=t) for c, t in values]


def test_rows_per_pair_use_that_pairs_share_of_the_same_generations(tmp_path):
    sets = [_set("de-en", 2), _set("fr-en", 2)]
    traffic = mixed_traffic(sets, [0], 0, 2, disjoint=False)  # de, fr, de, fr
    ar = Composed("ar", None, _results(*[(4, 1.0)] * 4), [True] * 4)
    # fast on German (4 tokens in 0.25 s, 1 call), slow on French (4 tokens in 2 s, 4 calls); its French row
    # did not match `ar`
    sd = Composed("de-en", 4, _results((1, 0.25), (4, 2.0), (1, 0.25), (4, 2.0)), [True, False, True, False])
    group = group_of([ar, sd], traffic, [], 0.0, 3)
    rows = {(r.method, r.traffic): r for r in group.rows}
    assert set(rows) == {(m, t) for m in ("ar", "de-en") for t in ("all", "de-en", "fr-en")}
    assert rows["de-en", "de-en"].speedup == pytest.approx(4.0)
    assert rows["de-en", "fr-en"].speedup == pytest.approx(0.5)
    assert rows["de-en", "all"].speedup == pytest.approx(4 / 4.5)  # 16 tokens in 4.5 s vs in 4 s
    assert rows["de-en", "de-en"].block_efficiency == 4.0 and rows["de-en", "fr-en"].block_efficiency == 1.0
    assert rows["de-en", "de-en"].matches_ar and not rows["de-en", "fr-en"].matches_ar
    assert not rows["de-en", "all"].matches_ar and rows["ar", "all"].matches_ar
    assert rows["de-en", "fr-en"].prompts == 2 and rows["de-en", "all"].draft_length == 4
    french = rows["de-en", "fr-en"].per_prompt  # that pair's requests, in order
    assert french is not None and [(p.target_calls, p.wall_seconds) for p in french] == [(4, 2.0), (4, 2.0)]
    assert all(r.matches_ar is None for r in group_of([ar, sd], traffic, [], 1.0, 3).rows)


def _groups(routed: list[list[float]], multilingual: list[list[float]]) -> list[MixedGroup]:
    """One group per repetition; per request of it, the seconds each choice took for 4 tokens (`ar`: 1 s)."""

    def row(method: str, seconds: list[float] | None) -> MixedRow:
        per_prompt = (
            None
            if seconds is None
            else [PromptResult(new_tokens=4, target_calls=2, wall_seconds=t) for t in seconds]
        )
        speedup = 1.0 if seconds is None else len(seconds) / sum(seconds)
        return MixedRow(
            method=method, traffic="all", temperature=0.0, seed=0, draft_length=4, prompts=4, new_tokens=4,
            block_efficiency=2.0, token_rate=1.0, speedup=speedup, matches_ar=True, per_prompt=per_prompt,
        )  # fmt: skip

    return [
        MixedGroup(temperature=0.0, seed=seed, requests=[], router_accuracy=1.0,
                   rows=[row("ar", None if r is None else [1.0] * len(r)), row("routed", r), row("multilingual", m)])
        for seed, (r, m) in enumerate(zip(routed, multilingual, strict=True))
    ]  # fmt: skip


def _seconds(speedups: list[float]) -> list[list[float]]:
    """Four requests per repetition, each at that repetition's speedup."""
    return [[1 / s] * 4 for s in speedups]


def test_the_decision_pairs_each_request_under_both_choices():
    # routed 2x on every request, multilingual 1.25x-2x: request by request routed is never slower
    (won,) = decisions(_groups([[0.5] * 8] * 3, [[0.5, 0.8, 0.6, 0.7, 0.5, 0.8, 0.6, 0.7]] * 3))
    assert won.winner == "routed" and won.interval is not None and won.interval.low > 0
    assert won.interval.prompts == 24 and "routed per-language drafters won" in won.text()
    # a request fast under one choice is slow under the other: the same overall speedups, nothing decided
    fast, slow = [0.5, 0.8] * 4, [0.8, 0.5] * 4
    (tie,) = decisions(_groups([fast] * 3, [slow] * 3))
    assert tie.winner is None and tie.interval is not None and tie.interval.low < 0 < tie.interval.high
    assert "holds 0" in tie.text() and f"{tie.interval.detectable:.3f}" in tie.text()
    # repetitions far apart (2x, 1.1x, 3.3x) but routed a little faster on every request: the spread of
    # the repetitions' speedups (twice its pooled std is ~2.2) hides a difference the pairs show
    walls = [[0.5] * 8, [0.9] * 8, [0.3] * 8]
    (paired,) = decisions(_groups(walls, [[t + 0.02 for t in rep] for rep in walls]))
    assert paired.winner == "routed" and paired.interval is not None and paired.interval.low > 0
    (lost,) = decisions(_groups([[0.8] * 8] * 2, [[0.5] * 7 + [0.6]] * 2))
    assert lost.winner == "multilingual" and "the multilingual drafter won" in lost.text()
    (old,) = decisions(_groups([None], [None]))  # groups measured before per-request values were kept
    assert old.winner is None and old.interval is None and "no per-request speedups" in old.text()
    assert decisions(_groups([[1.0]], [[1.0]])[:0]) == []


def test_a_recipe_with_mixed_traffic_needs_two_eval_pairs(tmp_path):
    with pytest.raises(ValueError, match=r"measure.mixed interleaves.*1 pair\(s\) \['de-en'\]"):
        Recipe(
            target=TargetConfig(path=str(tmp_path)),
            data=DataConfig(pairs=PAIRS, eval=[SourceConfig(kind="offline", split="test", pair="de-en")]),
            measure=MeasureConfig(mixed=True),
        )


@pytest.fixture(scope="module")
def with_multilingual(tmp_path_factory, finetune_dir):  # noqa: F811
    folder = tmp_path_factory.mktemp("finetune-multilingual")
    for name in PAIRS:
        shutil.copytree(finetune_dir / name, folder / name)
    shutil.copytree(finetune_dir / "fr-en", folder / "multilingual")
    return folder


def _recipe(target_dir):
    return measure_recipe(
        target_dir,
        decoders=["ar", "sd"],
        controls=["fixed"],
        k_sweep=[],
        mixed=True,
        disjoint_prompts=True,
    )


def test_mixed_traffic_rows_router_cost_summary_and_rerun(
    tmp_path, tiny_target_dir, with_multilingual, monkeypatch
):
    import polydraft.pipelines.stages.measure as measure_stage

    route = LanguageRouter.route

    def slow(self, text):  # at least 50 ms per request: the routed wall time must hold it
        time.sleep(0.05)
        return route(self, text)

    monkeypatch.setattr(LanguageRouter, "route", slow)
    decoded = []
    measure_group = measure_stage.measure_group

    def counted(build, prompts, warmed):
        decoded.append(len(prompts))
        return measure_group(build, prompts, warmed)

    monkeypatch.setattr(measure_stage, "measure_group", counted)
    ctx = measure_context(tmp_path, {"finetune": with_multilingual})
    run_measure(_recipe(tiny_target_dir), ctx, tiny_target_dir)
    # the per-pair groups only (2 sets x 2 temperatures x 2 repetitions of 2 prompts): nothing decoded again
    assert decoded == [2] * 8
    per_pair = {
        (r.dataset_pair, r.temperature, r.seed, r.drafter): r
        for r in read_rows(ctx.work_dir / "results.jsonl")
    }
    groups = read_groups(ctx.work_dir)
    assert sorted((g.temperature, g.seed) for g in groups) == [(0.0, 0), (0.0, 1), (1.0, 0), (1.0, 1)]
    methods = ["ar", "de-en", "fr-en", "multilingual", "routed", "oracle"]
    for group in groups:
        assert [(r.pair, r.index) for r in group.requests] == [
            ("de-en", 2 * group.seed), ("fr-en", 2 * group.seed), ("de-en", 2 * group.seed + 1),
            ("fr-en", 2 * group.seed + 1),
        ]  # fmt: skip
        assert [r.drafter for r in group.requests] == [r.pair for r in group.requests]
        assert group.router_accuracy == 1.0 and all(r.router_ms >= 50 for r in group.requests)
        rows = {(r.method, r.traffic): r for r in group.rows}
        assert set(rows) == {(m, t) for m in methods for t in ("all", *PAIRS)}
        for pair in PAIRS:  # each pair's share is that pair's own group of the repetition, value for value
            for method in ("ar", "de-en", "fr-en", "multilingual"):
                source = per_pair[pair, group.temperature, group.seed, None if method == "ar" else method]
                row = rows[method, pair]
                assert row.per_prompt == source.per_prompt and row.new_tokens == source.new_tokens
                assert row.block_efficiency == pytest.approx(source.block_efficiency)
                assert row.token_rate == pytest.approx(source.token_rate)
                assert row.matches_ar == source.matches_ar
            oracle, routed = rows["oracle", pair].per_prompt, rows["routed", pair].per_prompt
            assert oracle == per_pair[pair, group.temperature, group.seed, pair].per_prompt
            assert routed is not None and oracle is not None
            for request, r, o in zip(
                [q for q in group.requests if q.pair == pair], routed, oracle, strict=True
            ):
                assert r.wall_seconds == pytest.approx(o.wall_seconds + request.router_ms / 1000)
        assert rows["ar", "all"].speedup == 1.0 and rows["routed", "de-en"].prompts == 2
        routed = rows["routed", "all"]
        assert routed.token_rate is not None and routed.token_rate <= routed.new_tokens / (4 * 0.05)
        if group.temperature == 0:
            assert all(r.matches_ar for r in group.rows)
        else:
            assert all(r.matches_ar is None for r in group.rows)
        assert rows["routed", "all"].new_tokens == sum(rows["routed", p].new_tokens for p in PAIRS)
    summary = (ctx.work_dir / "summary.md").read_text()
    assert "## Mixed-language traffic" in summary and "| routed |" in summary and "Decision rule:" in summary
    assert "100.0% ± 0.0% of the requests to their own pair's drafter, 0 of 8 to the fallback" in summary

    # a rerun composes every group again from results.jsonl, a missing or broken file too, decoding nothing
    files = sorted((ctx.work_dir / "mixed").glob("*.json"))
    files[0].unlink()
    files[-1].write_text(files[-1].read_text()[:50])
    with pytest.raises(ValueError, match="not a mixed-traffic group"):
        read_groups(ctx.work_dir)
    run_measure(_recipe(tiny_target_dir), ctx, tiny_target_dir)
    assert decoded == [2] * 8 and all(p.is_file() for p in files)
    assert [g.rows[0] for g in read_groups(ctx.work_dir)] == [g.rows[0] for g in groups]  # `ar`, all traffic

    # rows measured before per-prompt values were kept: a clear error, the rows kept
    rows = read_rows(ctx.work_dir / "results.jsonl")
    write_rows(ctx.work_dir / "results.jsonl", [r.model_copy(update={"per_prompt": None}) for r in rows])
    with pytest.raises(
        StageFailed, match=r"has no per-prompt values .*delete results.jsonl to measure again"
    ):
        run_measure(_recipe(tiny_target_dir), ctx, tiny_target_dir)
    assert len(read_rows(ctx.work_dir / "results.jsonl")) == len(rows)


def test_mixed_traffic_needs_every_drafter_on_every_pair_and_the_fixed_control():
    with pytest.raises(ValueError, match="measure.cross_pairs is false"):
        MeasureConfig(mixed=True, cross_pairs=False)
    with pytest.raises(ValueError, match=r"has no `fixed`"):
        MeasureConfig(mixed=True, controls=["beta_ts"])
    assert MeasureConfig(mixed=True).cross_pairs


def test_mixed_traffic_without_pair_drafters_fails_the_stage(tmp_path, tiny_target_dir):
    ctx = measure_context(tmp_path, {})
    with pytest.raises(StageFailed, match="per-pair drafters or EAGLE-3 heads, but the finetune and eagle3"):
        run_measure(_recipe(tiny_target_dir), ctx, tiny_target_dir)


def test_the_summary_reports_each_pair_and_the_overall_cells():
    text = markdown(_groups(_seconds([1.6, 1.7, 1.8]), _seconds([1.2, 1.3, 1.4])))
    assert "| routed | 2.00 ± 0.00 | 1.70 ± 0.10 |" in text
    assert "- the routed per-language drafters won" in text


def test_the_run_summary_prints_the_mixed_traffic_section(tmp_path):
    from polydraft.decoding.measurement.mixed import write_group
    from polydraft.pipelines.run.summary import results_summary
    from tests.export_setup import measure_rows

    (tmp_path / "measure").mkdir()
    (tmp_path / "measure" / "results.jsonl").write_text(
        "".join(r.model_dump_json() + "\n" for r in measure_rows())
    )
    assert "Mixed-language traffic" not in results_summary(tmp_path)
    for group in _groups(_seconds([1.6, 1.7, 1.8]), _seconds([1.2, 1.3, 1.4])):
        write_group(tmp_path / "measure", group)
    text = results_summary(tmp_path)
    assert "## Mixed-language traffic" in text and "| routed | 2.00 ± 0.00 | 1.70 ± 0.10 |" in text
    assert "- the routed per-language drafters won (routed 1.70 ± 0.10x vs multilingual 1.30 ± 0.10x" in text
