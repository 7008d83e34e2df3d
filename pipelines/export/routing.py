"""Routing a request to a language's drafter from its prompt alone, before decoding starts.

polydraft trains one drafter per language pair (and, with `finetune.multilingual`, one on every pair);
a server that holds several must pick one per request. The router identifies the language of the
request's text and looks it up in a routing table (language -> drafter folder, and a fallback drafter
for a language the table lacks or an identification below the confidence threshold).

The identifier is py3langid (BSD-3-Clause, a maintained fork of langid.py: a naive Bayes model over
byte n-grams, 97 languages, shipped inside its 4.6 MB wheel, numpy only; nothing is downloaded at run
time). It is restricted to `CANDIDATES`, the source languages polydraft has pairs for plus English:
the 97-way model confuses short Chinese lines with Wu Chinese (`wuu`) and Japanese kanji lines with
Chinese, which the restriction removes (bench/results/routing.md). A request in a language outside the
candidates is identified as the nearest candidate: the confidence threshold is then the only guard.

Route on the text a user wrote: translation prompts carry seed 003's task prefix ("Translate German to
English: "), English boilerplate that `source_text` strips first (it names the language, but real
traffic has no such prefix, so the router must not lean on it).

The table is `routing.json` beside the exported drafters (`write_routing_table`, the export stage). A
serving process calls `load_router(path)` once and `router.route(text)` per request; `Route.drafter` is
a folder name relative to the table's folder (`router.folder(route)` gives its path), None for decoding
without a drafter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polydraft.data.prompts import LANGUAGE_NAMES, PAIRS

ROUTING_FILE = "routing.json"
"""The routing table's file name, beside the drafter folders it names."""
CANDIDATES = tuple(sorted({pair.split("-")[0] for pair in PAIRS} | {"en"}))
"""The languages the identifier chooses among: every source language of polydraft's pairs, and English."""
DEFAULT_THRESHOLD = 0.5
"""Below this confidence (py3langid's normalised probability over `CANDIDATES`) a request falls back."""
IDENTIFIER = "py3langid"

_PREFIX = re.compile(
    "^Translate (?:{names}) to (?:{names}): ".format(
        names="|".join(re.escape(name) for name in [*LANGUAGE_NAMES.values(), "English"])
    )
)


class RoutingTable(BaseModel):
    """`routing.json`: which drafter serves which language, and the fallback."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafters: dict[str, str]
    """Language code (ISO 639-1, one of `CANDIDATES`) -> drafter folder, relative to the table's folder."""
    fallback: str | None
    """The drafter for every other request (the multilingual one, say); None: decode without a drafter."""
    heads: dict[str, str] = {}
    """Language code -> EAGLE-3 head folder (for vLLM's `eagle3` method), relative to the table's folder."""
    heads_fallback: str | None = None
    """The head for every other request (the multilingual one); None: no head."""
    threshold: float = Field(default=DEFAULT_THRESHOLD, ge=0, le=1)
    """Identifications below this confidence go to the fallback."""
    identifier: str = IDENTIFIER
    """The language identifier the table was made for (its version is checked when loaded)."""
    identifier_version: str

    @model_validator(mode="after")
    def _check(self) -> RoutingTable:
        unknown = sorted((set(self.drafters) | set(self.heads)) - set(CANDIDATES))
        if unknown:
            raise ValueError(f"languages {unknown} are not among the identifier's {list(CANDIDATES)}")
        if self.identifier != IDENTIFIER:
            raise ValueError(f"identifier {self.identifier!r}: only {IDENTIFIER!r} is supported")
        return self


@dataclass(frozen=True)
class Route:
    """One routing decision: the language identified, its confidence, the drafter chosen."""

    language: str
    confidence: float
    drafter: str | None
    fallback: bool
    """True when the language is in neither map of the table or its confidence is below the threshold:
    the drafter and the head are the fallbacks."""
    head: str | None = None
    """The EAGLE-3 head folder for the request (None: the table names none)."""


def identifier_version() -> str:
    from importlib.metadata import version

    return version(IDENTIFIER)


def source_text(text: str) -> str:
    """`text` without seed 003's task prefix ("Translate German to English: "), if it starts with one."""
    return _PREFIX.sub("", text, count=1)


class LanguageRouter:
    """Routes request texts with a routing table (`route`), the identifier loaded once (~1 s)."""

    def __init__(self, table: RoutingTable, root: Path | None = None):
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        self.table, self.root = table, root
        self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self._identifier.set_languages(list(CANDIDATES))

    def identify(self, text: str) -> tuple[str, float]:
        """(language code, confidence) of `text`'s source text."""
        language, confidence = self._identifier.classify(source_text(text))
        return language, float(confidence)

    def route(self, text: str) -> Route:
        """The drafter for a request whose user turn is `text` (not the chat-formatted prompt: its
        system text would be identified too)."""
        language, confidence = self.identify(text)
        table = self.table
        known = language in table.drafters or language in table.heads
        if not known or confidence < table.threshold:
            return Route(language, confidence, table.fallback, True, table.heads_fallback)
        drafter = table.drafters.get(language, table.fallback)
        return Route(language, confidence, drafter, False, table.heads.get(language, table.heads_fallback))

    def folder(self, route: Route, head: bool = False) -> Path | None:
        """The chosen drafter's folder, or with `head` the chosen EAGLE-3 head's (relative to the table's
        folder when it was loaded from a file)."""
        name = route.head if head else route.drafter
        if name is None:
            return None
        return (self.root / name) if self.root is not None else Path(name)


def load_routing_table(path: Path | str) -> RoutingTable:
    """Read and check `routing.json` (a folder holding it, or the file). ValueError naming the file when
    it is malformed or was made with another identifier version (its identifications could differ)."""
    path = Path(path)
    if path.is_dir():
        path = path / ROUTING_FILE
    try:
        table = RoutingTable.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ValueError(f"{path}: no routing table (the export stage writes {ROUTING_FILE})") from err
    except ValueError as err:
        raise ValueError(f"{path}: not a routing table: {err}") from err
    installed = identifier_version()
    if table.identifier_version != installed:
        raise ValueError(
            f"{path}: made with {IDENTIFIER} {table.identifier_version}, {installed} is installed; "
            f"install that version (`pip install {IDENTIFIER}=={table.identifier_version}`)"
        )
    return table


def load_router(path: Path | str) -> LanguageRouter:
    """A router from `routing.json` (or its folder), the drafter folders resolved beside it."""
    path = Path(path)
    table = load_routing_table(path)
    return LanguageRouter(table, path if path.is_dir() else path.parent)


def write_routing_table(path: Path, table: RoutingTable) -> None:
    path.write_text(table.model_dump_json(indent=2) + "\n", encoding="utf-8")


def by_language(pair_folders: dict[str, str]) -> dict[str, str]:
    """{"de-en": folder} -> {"de": folder}. ValueError when two pairs share a source language (the router
    sees only the request's language, not the wanted target language)."""
    out: dict[str, str] = {}
    for pair, folder in sorted(pair_folders.items()):
        language = pair.split("-")[0]
        if language in out:
            raise ValueError(
                f"pairs {sorted(p for p in pair_folders if p.startswith(language + '-'))} "
                f"share the source language {language!r}: a router cannot tell them apart"
            )
        out[language] = folder
    return out


def routing_table_for(
    pair_drafters: dict[str, str],
    fallback: str | None,
    threshold: float = DEFAULT_THRESHOLD,
    pair_heads: dict[str, str] | None = None,
    heads_fallback: str | None = None,
) -> RoutingTable:
    """The table for drafters (and EAGLE-3 heads) trained per pair (`{"de-en": "<folder>"}`): each pair's
    source language routes to its drafter and its head. ValueError when two pairs share a source language."""
    return RoutingTable(
        drafters=by_language(pair_drafters), fallback=fallback, heads=by_language(pair_heads or {}),
        heads_fallback=heads_fallback, threshold=threshold, identifier_version=identifier_version(),
    )  # fmt: skip
