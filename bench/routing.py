"""The language router on held-out prompts: accuracy per pair and time per request.

Prompts are the offline corpus' held-out (`test`) samples as the measure stage builds its eval sets'
user turns: seed 003's task prefix + the source text (4 to 8 entries, one per line). Two sets: the
demo's (spelled-out numbers, de-en and fr-en, as recipes/demo/demo.yaml's `data.eval`) and every pair
with every kind of entry (catalog messages, names, dates, numbers). For each prompt the router
(`pipelines.export.routing`, py3langid restricted to its candidate languages) routes the text; a
prompt is right when its pair's drafter is chosen. `unrestricted` is py3langid's 97-language model on
the same texts, for the record of why the router restricts it. Time per request: `router.route` (prefix
stripped, identified, looked up), the mean over a set's prompts, mean ± std over `--repeats` passes.

    python bench/routing.py            # writes bench/results/routing.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from polydraft.data.offline import offline_pairs  # noqa: E402
from polydraft.data.prompts import TO_ENGLISH as PAIRS  # noqa: E402
from polydraft.data.prompts import task_prefix  # noqa: E402
from polydraft.pipelines.export import routing  # noqa: E402

NUMBERS = {"catalog": 0.0, "name": 0.0, "date": 0.0, "number": 1.0}


def prompts(pair: str, count: int, kinds: dict[str, float] | None) -> list[str]:
    # the measure stage's eval rows: offline test split, 4-8 entries (data.offline.entries_per_sample)
    rows = offline_pairs(pair, "test", count, (4, 8), 0.1, 0, kinds)
    return [task_prefix(pair) + row["source"] for row in rows]


def measure(router: routing.LanguageRouter, pair: str, texts: list[str], repeats: int) -> dict[str, object]:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    unrestricted = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    routes = [router.route(text) for text in texts]
    right = sum(r.drafter == pair for r in routes)
    fallbacks = sum(r.fallback for r in routes)
    wide = sum(unrestricted.classify(routing.source_text(t))[0] == pair.split("-")[0] for t in texts)
    per_request = []
    for _ in range(repeats):
        start = time.perf_counter()
        for text in texts:
            router.route(text)
        per_request.append((time.perf_counter() - start) / len(texts) * 1e3)
    return {
        "pair": pair,
        "n": len(texts),
        "accuracy": right / len(texts),
        "fallback": fallbacks / len(texts),
        "min_conf": min(r.confidence for r in routes),
        "unrestricted": wide / len(texts),
        "ms": (statistics.mean(per_request), statistics.stdev(per_request)),
    }


def table(rows: list[dict[str, object]]) -> list[str]:
    lines = [
        "| pair | prompts | routed right | fell back | min confidence | unrestricted model right | ms / request |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mean, std = r["ms"]  # type: ignore[misc]
        lines.append(
            f"| {r['pair']} | {r['n']} | {r['accuracy']:.3f} | {r['fallback']:.3f} | {r['min_conf']:.3f} "
            f"| {r['unrestricted']:.3f} | {mean:.3f} ± {std:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=400, help="held-out prompts per pair")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "bench" / "results" / "routing.md")
    args = parser.parse_args()
    drafters = {pair: pair for pair in PAIRS}
    start = time.perf_counter()
    router = routing.LanguageRouter(routing.routing_table_for(drafters, None))
    load_s = time.perf_counter() - start
    demo = [measure(router, p, prompts(p, args.count, NUMBERS), args.repeats) for p in ("de-en", "fr-en")]
    every = [measure(router, p, prompts(p, args.count, None), args.repeats) for p in PAIRS]
    lines = [
        "# The language router on held-out prompts (`python bench/routing.py`)",
        "",
        f"py3langid {routing.identifier_version()}, restricted to {', '.join(routing.CANDIDATES)}, "
        f"threshold {routing.DEFAULT_THRESHOLD}; routing table: every pair's source language -> its "
        f"drafter, no fallback drafter. Loading the identifier: {load_s:.2f} s (once per process). "
        f"{args.count} held-out prompts per pair (offline `test` split, task prefix + 4-8 source lines); "
        f"ms / request: mean over the prompts, mean ± std over {args.repeats} passes, on this machine's "
        "shared CPU.",
        "",
        "## The demo's traffic (spelled-out numbers)",
        "",
        *table(demo),
        "",
        "## Every pair, every kind of entry (catalog messages, names, dates, numbers)",
        "",
        *table(every),
        "",
    ]
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
