"""The language router (`pipelines.export.routing`): the table, its file, the decisions."""

from __future__ import annotations

import json

import pytest

from polydraft.data.offline import offline_pairs
from polydraft.data.prompts import task_prefix
from polydraft.pipelines.export import routing
from polydraft.pipelines.export.records import ExportIndex, ExportRecord, PublicTarget
from polydraft.pipelines.export.routing_table import export_routing_table

NUMBERS = {"catalog": 0.0, "name": 0.0, "date": 0.0, "number": 1.0}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    table = routing.routing_table_for({"de-en": "drafter-de-en", "fr-en": "drafter-fr-en"}, "multilingual")
    routing.write_routing_table(folder / routing.ROUTING_FILE, table)
    return routing.load_router(folder)


def test_the_task_prefix_is_stripped_and_only_at_the_start():
    assert routing.source_text(task_prefix("de-en") + "zweiundvierzig") == "zweiundvierzig"
    assert (
        routing.source_text("Bitte: Translate German to English: x")
        == "Bitte: Translate German to English: x"
    )


@pytest.mark.parametrize("pair", ["de-en", "fr-en"])
def test_held_out_number_prompts_go_to_their_languages_drafter(router, pair):
    rows = offline_pairs(pair, "test", 20, (4, 8), kind_weights=NUMBERS)
    routes = [router.route(task_prefix(pair) + row["source"]) for row in rows]
    assert {r.drafter for r in routes} == {f"drafter-{pair}"} and not any(r.fallback for r in routes)
    assert router.folder(routes[0]) == router.root / f"drafter-{pair}"


def test_the_source_text_decides_not_the_prefix(router):
    # the prefix is not identified at all: the same language and confidence as the bare text
    assert router.identify(task_prefix("fr-en") + "zweiundvierzig") == router.identify("zweiundvierzig")
    route = router.route(task_prefix("de-en") + "quatre cent vingt et un\ntrois mille deux cent six")
    assert (route.language, route.drafter) == ("fr", "drafter-fr-en")


def test_a_language_without_a_drafter_or_an_unsure_one_falls_back(router):
    english = router.route("The quick brown fox jumps over the lazy dog, and then it runs away.")
    assert (english.language, english.drafter, english.fallback) == ("en", "multilingual", True)
    text = "zweiundvierzig\ndreihundertsieben"
    sure = router.route(text)
    unsure_table = router.table.model_copy(update={"threshold": min(1.0, sure.confidence + 1e-6)})
    unsure = routing.LanguageRouter(unsure_table).route(text)
    assert (sure.drafter, unsure.drafter, unsure.fallback) == ("drafter-de-en", "multilingual", True)


def test_a_bad_or_stale_table_is_refused_naming_the_file(tmp_path):
    path = tmp_path / routing.ROUTING_FILE
    with pytest.raises(ValueError, match="no routing table"):
        routing.load_routing_table(tmp_path)
    table = routing.routing_table_for({"de-en": "a"}, None).model_dump()
    path.write_text(json.dumps({**table, "drafters": {"es": "a"}}))
    with pytest.raises(ValueError, match=r"routing.json: not a routing table(?s:.*)\['es'\]"):
        routing.load_routing_table(path)
    path.write_text(json.dumps({**table, "identifier_version": "0.0.1"}))
    with pytest.raises(ValueError, match="made with py3langid 0.0.1"):
        routing.load_routing_table(path)


def test_two_pairs_from_one_language_cannot_be_routed():
    with pytest.raises(ValueError, match="share the source language 'de'"):
        routing.routing_table_for({"de-en": "a", "de-fr": "b"}, None)


def exported(*items: tuple[str, str | None, str]) -> ExportIndex:
    records = [
        ExportRecord(
            name=name,
            kind=kind,
            folder=name,
            pair=pair,
            repo_name=name,
            smoke_passed=True,
            measured=True,
            best_draft_length=None,
            headline=None,
        )  # fmt: skip
        for name, pair, kind in items
    ]
    return ExportIndex(target=PublicTarget(id=None, revision=None, label=None), items=records)


def test_the_exported_table_falls_back_to_the_multilingual_drafter_else_the_pretrained_one(tmp_path):
    pairs = [("de-en", "de-en", "drafter"), ("fr-en", "fr-en", "drafter"), ("early_exit", None, "early_exit")]
    generic = [("pretrain", None, "drafter")]
    table = export_routing_table(tmp_path, exported(*pairs, *generic, ("multilingual", None, "drafter")), 0.7)
    assert table == routing.load_routing_table(tmp_path)
    assert (table.drafters, table.fallback, table.threshold) == (
        {"de": "de-en", "fr": "fr-en"},
        "multilingual",
        0.7,
    )
    assert export_routing_table(tmp_path, exported(*pairs, *generic), 0.5).fallback == "pretrain"
    assert export_routing_table(tmp_path, exported(*pairs), 0.5).fallback is None
    (tmp_path / routing.ROUTING_FILE).unlink()
    assert export_routing_table(tmp_path, exported(*generic), 0.5) is None
    assert not (tmp_path / routing.ROUTING_FILE).exists()
