"""Reading data sources: dotted field paths into mappings and lists, rows normalised per format."""

from __future__ import annotations

import pytest

from polydraft.data.sources import SourceError, field_value, normalise


def test_field_paths_walk_mappings_and_lists():
    row = {"prompt": ["first turn", "second turn"], "translation": {"de": "Hallo"}, "c": [{"v": 1}]}
    assert field_value(row, "prompt.0") == "first turn"
    assert field_value(row, "prompt.-1") == "second turn"
    assert field_value(row, "translation.de") == "Hallo"
    assert field_value(row, "c.0.v") == 1
    for missing in ("prompt.2", "prompt.-3", "prompt.x", "translation.fr", "translation.de.0", "nothing"):
        assert field_value(row, missing) is None, missing


def test_mt_bench_rows_give_their_first_turn_as_the_prompt():
    rows = [(0, {"prompt": ["Compose a travel blog post.", "Rewrite it."], "category": "writing"})]
    out = normalise(rows, "prompts", {"prompt": "prompt.0"}, None, "hf:mt_bench[train]", False, "mt")
    assert [r["prompt"] for r in out.rows] == ["Compose a travel blog post."]
    with pytest.raises(SourceError, match="row 0: field 'prompt.1.x' is missing or empty"):
        normalise(rows, "prompts", {"prompt": "prompt.1.x"}, None, "hf:mt_bench[train]", False, "mt")
