"""Small local copies of every hub dataset a shipped recipe names, laid out as their repositories are and
with their real schema (config and split names, columns, nesting, file formats, as each dataset card
documents them), in a `$POLYDRAFT_HUB_MIRROR` folder (`models.folders.mirrored`).

Each copy is a few rows of made-up text; what is real is the shape: a wrong config, split, revision or
field path in a recipe fails on these copies as it would on the hub. Sources (dataset cards and file trees
on the hub, read 2026-11): `wmt/wmt14|16|19` (parquet per config, `translation: {xx, en}`; wmt19 has no
test split), `haoranxu/WMT22-Test` (10 configs, no `ja-en`) and `haoranxu/WMT23-Test` (`ja-en` among 15,
the column named after the config), `Hoshikuzu/JParaCrawl` (`translation: {en, ja}`, train only),
`Aeala/ShareGPT_Vicuna_unfiltered` (two JSON arrays of `{id, conversations: [{from, value}]}`),
`allenai/c4` (`en/c4-<split>.*.json.gz`), `cerebras/SlimPajama-627B` (`<split>/chunkN/*.jsonl.zst`, no
configs: splits from the folders), `openai/gsm8k` (`main`, `socratic`), `google-research-datasets/nq_open`,
`openai/openai_humaneval`, `abisee/cnn_dailymail` (`1.0.0`, `2.0.0`, `3.0.0`), `HuggingFaceH4/mt_bench_prompts`
(`prompt` a list of turns) and `EdinburghNLP/xsum` (a loading script on `main`, which `datasets` 4 refuses;
parquet at `refs/convert/parquet`, config `default`).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import yaml

ROWS = 4


def _translation(pair: str, key: str = "translation") -> list[dict[str, Any]]:
    lang, other = pair.split("-")
    return [{key: {lang: f"{lang} sentence {i}", other: f"{other} sentence {i}"}} for i in range(ROWS)]


def _parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list[dict[str, Any]], compress: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if compress == "gzip":
        text = gzip.compress(text)
    elif compress == "zstd":
        import zstandard

        text = zstandard.ZstdCompressor().compress(text)
    path.write_bytes(text)


def _configs(folder: Path, configs: dict[str, dict[str, str]]) -> None:
    """The README header that maps config -> split -> data files (how a hub dataset without a script
    declares them)."""
    header = [
        {"config_name": name, "data_files": [{"split": s, "path": p} for s, p in splits.items()]}
        for name, splits in configs.items()
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(
        "---\n" + yaml.safe_dump({"configs": header}) + "---\n", encoding="utf-8"
    )


def _parquet_configs(folder: Path, tables: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Parquet files `<config>/<split>-00000-of-00001.parquet` and the README that maps them."""
    configs = {}
    for config, splits in tables.items():
        configs[config] = {}
        for split, rows in splits.items():
            relative = f"{config}/{split}-00000-of-00001.parquet"
            _parquet(folder / relative, rows)
            configs[config][split] = relative
    _configs(folder, configs)


def build_mirror(root: Path) -> Path:
    """Write every dataset under `root/datasets/`; returns `root`."""
    data = root / "datasets"
    for repo, pairs, splits in (
        ("wmt/wmt16", ["de-en", "ru-en"], ["train", "validation", "test"]),
        ("wmt/wmt14", ["fr-en"], ["train", "validation", "test"]),
        ("wmt/wmt19", ["zh-en"], ["train", "validation"]),
    ):
        _parquet_configs(data / repo, {p: {s: _translation(p) for s in splits} for p in pairs})
    wmt22 = ["cs-en", "de-en", "is-en", "ru-en", "zh-en", "en-cs", "en-de", "en-is", "en-ru", "en-zh"]
    _parquet_configs(data / "haoranxu/WMT22-Test", {p: {"test": _translation(p, p)} for p in wmt22})
    wmt23 = ["de-en", "he-en", "is-en", "ja-en", "ru-en", "uk-en", "zh-en", "en-cs", "en-de", "en-ja"]
    _parquet_configs(data / "haoranxu/WMT23-Test", {p: {"test": _translation(p, p)} for p in wmt23})
    jparacrawl = [{"translation": {"en": f"English {i}", "ja": f"日本語 {i}"}} for i in range(ROWS)]
    _parquet(data / "Hoshikuzu/JParaCrawl/data/train-00000-of-00001.parquet", jparacrawl)
    _configs(data / "Hoshikuzu/JParaCrawl", {"default": {"train": "data/train-*.parquet"}})

    sharegpt = data / "Aeala/ShareGPT_Vicuna_unfiltered"
    sharegpt.mkdir(parents=True)
    for name, first in (("ShareGPT_V4.3_unfiltered_cleaned_split.json", 0), ("ShareGPT_2023.05.04v0_Wasteland_Edition.json", 10)):  # fmt: skip
        rows = [
            {"id": f"conv{first + i}_0", "conversations": [
                {"from": "human", "value": f"question {first + i}"}, {"from": "gpt", "value": f"answer {first + i}"}]}
            for i in range(ROWS)
        ]  # fmt: skip
        rows.insert(1, {"id": f"conv{first}_1", "conversations": []})  # empty rows exist: skip_invalid
        (sharegpt / name).write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")  # one JSON array

    c4 = [{"text": f"document {i}", "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"} for i in range(ROWS)]  # fmt: skip
    _jsonl(data / "allenai/c4/en/c4-train.00000-of-01024.json.gz", c4, "gzip")
    _jsonl(data / "allenai/c4/en/c4-validation.00000-of-00008.json.gz", c4, "gzip")
    _configs(data / "allenai/c4", {"en": {"train": "en/c4-train.*.json.gz", "validation": "en/c4-validation.*.json.gz"}})  # fmt: skip

    slim = [{"text": f"document {i}", "meta": {"redpajama_set_name": "RedPajamaC4"}} for i in range(ROWS)]
    for split, file in (("train", "example_train_0"), ("validation", "example_holdout_0"), ("test", "example_holdout_0")):  # fmt: skip
        _jsonl(data / "cerebras/SlimPajama-627B" / split / "chunk1" / f"{file}.jsonl.zst", slim, "zstd")

    gsm8k = [{"question": f"question {i}", "answer": f"steps\n#### {i}"} for i in range(ROWS)]
    _parquet_configs(
        data / "openai/gsm8k", {c: {"train": gsm8k, "test": gsm8k} for c in ("main", "socratic")}
    )
    nq = [{"question": f"question {i}", "answer": [f"answer {i}"]} for i in range(ROWS)]
    _parquet_configs(data / "google-research-datasets/nq_open", {"nq_open": {"train": nq, "validation": nq}})
    humaneval = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "    return 0\n",
         "test": "def check(f): pass\n", "entry_point": f"f{i}"}
        for i in range(ROWS)
    ]  # fmt: skip
    _parquet_configs(data / "openai/openai_humaneval", {"openai_humaneval": {"test": humaneval}})
    cnn = [
        {"article": f"article {i}", "highlights": f"highlights {i}", "id": f"{i:040x}"} for i in range(ROWS)
    ]
    _parquet_configs(
        data / "abisee/cnn_dailymail", {v: {s: cnn for s in ("train", "validation", "test")} for v in ("1.0.0", "2.0.0", "3.0.0")}
    )  # fmt: skip
    mt_bench = [
        {"prompt": [f"turn one {i}", f"turn two {i}"], "prompt_id": 1000 + i, "category": "writing", "reference": []}
        for i in range(ROWS)
    ]  # fmt: skip
    _parquet(data / "HuggingFaceH4/mt_bench_prompts/data/train-00000-of-00001.parquet", mt_bench)

    xsum = data / "EdinburghNLP/xsum"
    xsum.mkdir(parents=True)
    (xsum / "xsum.py").write_text("# the loading script the hub's main branch holds\n", encoding="utf-8")
    rows = [{"document": f"document {i}", "summary": f"summary {i}", "id": str(i)} for i in range(ROWS)]
    _parquet_configs(data / "EdinburghNLP/xsum@refs%2Fconvert%2Fparquet", {"default": {s: rows for s in ("train", "validation", "test")}})  # fmt: skip
    return root
