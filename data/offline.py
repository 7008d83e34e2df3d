"""An offline parallel corpus of real text, for the demo and the tests (no network needed).

Entries come from packages installed with the `offline` extra:
- gettext catalogs shipped by Django and Sphinx (English message -> its translation),
- CLDR territory and language names from babel,
- dates written out in full by babel's CLDR formats,
- numbers spelled out by num2words (de, fr, ru, ja; num2words has no Chinese).
Samples join several entries, one per line, so that answers are long enough for drafting to matter.
Every pair between these languages and English, either way, and between two of them is served: X->en as
the catalogs and CLDR give them, en->X the same entries reversed, X->Y two entries joined on what they
share (a catalog message on its English original, a name on its code, the same date or number).
Entries are split into train and test by a hash of their non-English text (the source's, for X->Y), so
held-out samples never share an entry with training samples, and an entry is held out for de-en exactly
when it is for en-de and de-fr.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import glob
import hashlib
import io
import os
import random
from dataclasses import dataclass

LOCALE_DIRS = {"de": ["de"], "fr": ["fr"], "ru": ["ru"], "ja": ["ja"], "zh": ["zh_Hans", "zh_CN"]}
MAX_ENTRY_CHARS = 160
KINDS = ("catalog", "name", "date", "number")


@dataclass(frozen=True)
class Entry:
    source: str
    target: str
    kind: str


def _missing(package: str) -> ImportError:
    return ImportError(
        f"the offline corpus needs `{package}`: install the offline extra, `pip install -e .[offline]`"
    )


def _split_of(text: str, test_fraction: float) -> str:
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return "test" if digest / 2**64 < test_fraction else "train"


@functools.lru_cache(maxsize=8)
def catalog_entries(lang: str) -> tuple[Entry, ...]:
    """English -> `lang` message pairs from the gettext catalogs of Django and Sphinx."""
    try:
        import django
        import sphinx
        from babel.messages.pofile import read_po
    except ImportError as err:
        raise _missing(err.name or "babel") from err
    roots = [os.path.dirname(django.__file__), os.path.dirname(sphinx.__file__)]
    files = sorted(
        f
        for root in roots
        for locale in LOCALE_DIRS[lang]
        for f in glob.glob(f"{root}/**/locale/{locale}/LC_MESSAGES/*.po", recursive=True)
    )
    pairs: dict[str, str] = {}
    for path in files:
        # some catalogs carry more plural forms than they declare; babel prints a warning for each
        with (
            open(path, "rb") as handle,
            contextlib.redirect_stderr(io.StringIO()),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            catalog = read_po(handle)
        for message in catalog:
            english, translated = message.id, message.string
            if isinstance(english, tuple | list):
                english, translated = english[0], translated[0] if translated else ""
            if not english or not translated or message.fuzzy:
                continue
            english, translated = " ".join(english.split()), " ".join(translated.split())
            if 0 < len(english) <= MAX_ENTRY_CHARS and len(translated) <= MAX_ENTRY_CHARS:
                pairs.setdefault(translated, english)
    return tuple(Entry(source=s, target=t, kind="catalog") for s, t in sorted(pairs.items()))


@functools.lru_cache(maxsize=8)
def joined_catalog(lang: str, into: str) -> tuple[Entry, ...]:
    """`lang` -> `into` messages: the two languages' catalog translations of the same English message."""
    english = {}
    for entry in catalog_entries(into):
        english.setdefault(entry.target, entry.source)
    pairs: dict[str, str] = {}
    for entry in catalog_entries(lang):
        if entry.target in english:
            pairs.setdefault(entry.source, english[entry.target])
    return tuple(Entry(source=s, target=t, kind="catalog") for s, t in sorted(pairs.items()))


@functools.lru_cache(maxsize=8)
def name_entries(lang: str, into: str = "en") -> tuple[Entry, ...]:
    """CLDR names of territories and languages, in `lang` and in `into` (English by default)."""
    try:
        from babel import Locale
    except ImportError as err:
        raise _missing("babel") from err
    here, english = Locale.parse(lang), Locale.parse(into)
    entries: dict[str, str] = {}
    for table in ("territories", "languages"):
        theirs, ours = getattr(here, table), getattr(english, table)
        for code, name in sorted(theirs.items()):
            if code in ours and name and ours[code] and not code.isdigit():
                entries.setdefault(name, ours[code])
    return tuple(Entry(source=s, target=t, kind="name") for s, t in sorted(entries.items()))


def date_entry(lang: str, rng: random.Random, into: str = "en") -> Entry:
    try:
        from babel.dates import format_date
    except ImportError as err:
        raise _missing("babel") from err
    day = datetime.date(1900, 1, 1) + datetime.timedelta(days=rng.randrange(200 * 366))
    style = rng.choice(["full", "long"])
    return Entry(format_date(day, style, locale=lang), format_date(day, style, locale=into), "date")


def number_entry(lang: str, rng: random.Random, into: str = "en") -> Entry | None:
    if "zh" in (lang, into):
        return None
    value = rng.choice([rng.randrange(10, 100), rng.randrange(100, 10_000), rng.randrange(10_000, 1_000_000)])
    return Entry(_spelled(value, lang), _spelled(value, into), "number")


@functools.lru_cache(maxsize=2**18)
def _spelled(value: int, lang: str) -> str:
    """`value` in words (num2words is most of the corpus' generation time; a value recurs across splits,
    pairs and the stages of one process)."""
    try:
        from num2words import num2words
    except ImportError as err:
        raise _missing("num2words") from err
    return num2words(value, lang=lang)


def _entry(kind: str, lang: str, into: str, rng: random.Random) -> Entry | None:
    """One `lang` -> `into` entry of `kind` (neither language English: joined through English)."""
    if kind == "catalog":
        return rng.choice(catalog_entries(lang) if into == "en" else joined_catalog(lang, into))
    if kind == "name":
        return rng.choice(name_entries(lang, into))
    if kind == "date":
        return date_entry(lang, rng, into)
    return number_entry(lang, rng, into)


def _pick(
    lang: str, split: str, test_fraction: float, rng: random.Random, weights: list[float], into: str = "en"
) -> Entry:
    """One `lang` -> `into` entry of the given split: a kind drawn with `weights` (in KINDS order), then an
    entry of it. An English source reads the `into` -> English entries reversed."""
    while True:
        kind = rng.choices(KINDS, weights)[0]
        if lang == "en":
            found = _entry(kind, into, "en", rng)
            entry = None if found is None else Entry(found.target, found.source, found.kind)
        else:
            entry = _entry(kind, lang, into, rng)
        if (
            entry is not None
            and _split_of(entry.target if lang == "en" else entry.source, test_fraction) == split
        ):
            return entry


def offline_pairs(
    pair: str,
    split: str,
    num_samples: int,
    entries_per_sample: tuple[int, int] = (2, 4),
    test_fraction: float = 0.1,
    seed: int = 0,
    kind_weights: dict[str, float] | None = None,
) -> list[dict[str, str]]:
    """Translation samples for `pair` (e.g. `de-en`, `en-de`, `de-fr`): `{"id", "source", "target"}`, entries
    one per line.

    `kind_weights` (catalog, name, date, number; default all 1) sets how often each kind of entry is drawn.
    The samples are drawn one after the other from one generator per set of the other arguments, so the
    first n samples are the same whatever `num_samples` asks for more; each is drawn once per process
    (stages read the same split several times: a distill source, the open rows, the eval set) and returned
    as a new dict each call.
    """
    weights = tuple(sorted((kind_weights or {}).items()))
    samples = _stream(pair, split, tuple(entries_per_sample), test_fraction, seed, weights).first(num_samples)
    return [dict(sample) for sample in samples]


class _Samples:
    """The samples of one pair and split drawn so far, and the generator that draws the next ones."""

    def __init__(
        self,
        pair: str,
        split: str,
        entries_per_sample: tuple[int, int],
        test_fraction: float,
        seed: int,
        kind_weights: tuple[tuple[str, float], ...],
    ) -> None:
        lang, _, into = pair.partition("-")
        languages = [*LOCALE_DIRS, "en"]
        if lang not in languages or into not in languages or lang == into:
            raise ValueError(
                f"the offline corpus has pairs between two different languages of {sorted(languages)} "
                f"(e.g. de-en, en-de, de-fr), not {pair!r}"
            )
        if split not in ("train", "test"):
            raise ValueError(f"offline split must be `train` or `test`, not {split!r}")
        self.pair, self.split, self.lang, self.into = pair, split, lang, into
        self.entries_per_sample, self.test_fraction = entries_per_sample, test_fraction
        self.weights = [dict(kind_weights).get(kind, 1.0) for kind in KINDS]
        self.rng = random.Random(f"{pair}/{split}/{seed}")
        self.samples: list[dict[str, str]] = []

    def first(self, count: int) -> list[dict[str, str]]:
        """The first `count` samples, drawing those not drawn yet (a held-out split keeps about one entry
        in ten it draws, so drawing only what is read saves most of the time)."""
        low, high = self.entries_per_sample
        while len(self.samples) < count:
            entries = [
                _pick(self.lang, self.split, self.test_fraction, self.rng, self.weights, self.into)
                for _ in range(self.rng.randint(low, high))
            ]
            self.samples.append(
                {
                    "id": f"offline/{self.pair}/{self.split}/{len(self.samples)}",
                    "source": "\n".join(e.source for e in entries),
                    "target": "\n".join(e.target for e in entries),
                }
            )
        return self.samples[:count]


@functools.lru_cache(maxsize=32)
def _stream(
    pair: str,
    split: str,
    entries_per_sample: tuple[int, int],
    test_fraction: float,
    seed: int,
    kind_weights: tuple[tuple[str, float], ...],
) -> _Samples:
    return _Samples(pair, split, entries_per_sample, test_fraction, seed, kind_weights)


def offline_texts(langs: list[str], num_documents: int, seed: int = 0) -> list[dict[str, str]]:
    """Generic documents for pretraining: each document is a run of English or foreign entries (of one of
    `langs` besides English, whose entries give the English side; English alone: every foreign one's)."""
    rng = random.Random(f"texts/{','.join(langs)}/{seed}")
    foreign = [lang for lang in langs if lang != "en"] or list(LOCALE_DIRS)
    documents = []
    for index in range(num_documents):
        lang = rng.choice(foreign)
        entries = [_pick(lang, "train", 0.1, rng, [1.0] * len(KINDS)) for _ in range(rng.randint(3, 8))]
        side = rng.choice(["source", "target"])
        documents.append(
            {"id": f"offline/text/{index}", "text": "\n".join(getattr(e, side) for e in entries)}
        )
    return documents
