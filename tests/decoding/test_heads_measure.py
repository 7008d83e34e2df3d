"""The measure stage with the heads stage's output: rows for bpd, medusa and their `+rescore` variants (one per
rescoring drafter), `ar`'s tokens at temperature 0, the rescoring's own cost recorded, the Tables A-D summary."""

from __future__ import annotations

import json

import pytest

from polydraft.decoding.measurement.results import RESULTS_FILE
from polydraft.models.heads import heads_for_target, save_heads
from polydraft.models.tiny import build_llama
from polydraft.pipelines.runtime.contract import StageFailed
from tests.decoding_helpers import single_thread_fixture
from tests.measure_setup import measure_context, measure_recipe, run_measure

single_thread = single_thread_fixture()
BLOCKWISE = ["ar", "bpd", "medusa", "bpd+rescore", "medusa+rescore"]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_tokenizer, tiny_target):
    """`heads/heads/` (3 Medusa heads as initialised) and one standalone drafter in `finetune/de-en/`."""
    root = tmp_path_factory.mktemp("run")
    heads = heads_for_target(tiny_target, "medusa", 3)
    save_heads(heads, root / "heads" / "heads", {"path": "tiny", "revision": None})
    tok = tiny_tokenizer
    drafter = build_llama(len(tok), 64, 1, 4, 128, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=3)  # fmt: skip
    drafter.save_pretrained(root / "finetune" / "de-en")
    tok.save_pretrained(root / "finetune" / "de-en")
    return {"heads": root / "heads", "finetune": root / "finetune"}


def test_blockwise_rows(tmp_path, tiny_target_dir, upstream):
    ctx = measure_context(tmp_path, upstream)
    recipe = measure_recipe(
        tiny_target_dir, decoders=BLOCKWISE, seeds=[0], medusa_tree=[[0], [1], [0, 0], [0, 0, 0]],
        rescore_top_k=3, rescore_beam_width=2,
    )  # fmt: skip
    run_measure(recipe, ctx, tiny_target_dir)
    rows = [json.loads(line) for line in (ctx.work_dir / RESULTS_FILE).read_text().splitlines()]
    # 2 sets x 2 temperatures x 1 seed; per group: ar, bpd, medusa, and each +rescore with the one drafter
    assert len(rows) == 4 * 5
    assert {r["method"] for r in rows} == {
        "ar", "bpd[heads] K=3", "medusa[heads] 4 nodes", "bpd+rescore[de-en] K=3", "medusa+rescore[de-en] 2x3"
    }  # fmt: skip
    for row in rows:
        if row["temperature"] == 0:
            assert row["matches_ar"] is True, row["method"]
        if row["decoder"] == "ar":
            continue
        assert row["drafter"] == "heads" and row["drafter_kind"] == "heads"
        assert row["block_efficiency"] >= 1.0 and row["target_calls"] >= 1
        if row["decoder"].endswith("+rescore"):
            assert row["rescorer"] == "de-en" and row["rescore_weight"] == 0.5
            assert row["rescore_seconds"] > 0 and row["rescore_ms_per_round"] > 0
        else:
            assert row["rescorer"] is None and row["rescore_seconds"] == 0
    summary = (ctx.work_dir / "summary.md").read_text()
    assert "## Blockwise decoders: block efficiency" in summary
    assert "| medusa+rescore[de-en] 2x3 |" in summary


def test_a_medusa_tree_with_a_missing_parent_is_refused(tmp_path, tiny_target_dir, upstream):
    recipe = measure_recipe(tiny_target_dir, decoders=BLOCKWISE, medusa_tree=[[0], [0, 1]])
    with pytest.raises(StageFailed, match="medusa_tree"):
        run_measure(recipe, measure_context(tmp_path, upstream), tiny_target_dir)
