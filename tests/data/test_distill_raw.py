"""`distill.prompt_format: raw` for base targets: the prompt is the text itself; `text` sources become
document beginnings cut at a token boundary; open `text` rows join the mix with an empty prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from polydraft.data.mix import read_mix
from polydraft.data.prompts import VICUNA_SYSTEM, build_prompt, encode_prompt, text_prefix
from polydraft.data.sources import SourceRows
from polydraft.distill.requests import open_rows, prompt_items
from polydraft.distill.store import iter_records
from polydraft.pipelines.run.recipe import RecipeError, load_recipe
from polydraft.pipelines.runtime.contract import PROJECT_ROOT
from polydraft.train.data import encode_rows, encode_texts
from polydraft.train.losses import IGNORE_INDEX
from tests.distill_setup import make_recipe, run_distill, write_jsonl

DOCUMENTS = [
    "Der Bahnhof liegt am Rande der Stadt, und der Zug nach Berlin fährt jede Stunde ab.",
    "La maison est vieille mais le jardin est beau, plein de fleurs et d'arbres fruitiers.",
    "Guten Morgen, heute regnet es den ganzen Tag, deshalb bleiben wir zu Hause und lesen.",
]


def test_raw_prompt_is_the_text_itself(tiny_tokenizer):
    text = "Once upon a time, in a small village"
    assert build_prompt([{"role": "user", "content": text}], "raw") == text
    assert build_prompt([{"role": "user", "content": text}], "raw", tiny_tokenizer) == text
    with pytest.raises(ValueError, match="not a conversation"):
        build_prompt([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "raw")

    rows = SourceRows("local:p.jsonl[train]", [{"id": "a", "prompt": text}])
    items, _ = prompt_items(rows, "prompts", 0, "raw", tiny_tokenizer, False, set(), 128)
    assert items[0].prompt == text and VICUNA_SYSTEM not in items[0].prompt
    # the same prompt in the vicuna format is wrapped, so `raw` is what changed it
    vicuna, _ = prompt_items(rows, "prompts", 0, "vicuna", tiny_tokenizer, False, set(), 128)
    assert vicuna[0].prompt.startswith(VICUNA_SYSTEM)


def test_text_source_becomes_prefixes_cut_at_a_token_boundary(tiny_tokenizer):
    tok, n = tiny_tokenizer, 8
    rows = SourceRows(
        "local:t.jsonl[train]",
        [{"id": str(i), "text": d} for i, d in enumerate(DOCUMENTS)] + [{"id": "short", "text": "Hallo"}],
    )
    items, invalid = prompt_items(rows, "text", 0, "raw", tok, False, set(), n)
    assert invalid.count == 0 and len(items) == 4
    for item, document in zip(items[:3], DOCUMENTS, strict=True):
        ids = tok(document, add_special_tokens=False)["input_ids"]
        assert len(ids) > n
        assert document.startswith(item.prompt) and item.prompt != document
        # exactly the document's first n tokens: re-encoding the prompt gives them back
        assert tok(item.prompt, add_special_tokens=False)["input_ids"] == ids[:n]
        assert encode_prompt(tok, item.prompt) == [tok.bos_token_id, *ids[:n]]
    assert items[3].prompt == "Hallo"  # a document shorter than n tokens is sent whole


def test_text_prefix_never_cuts_a_character_in_half(tiny_tokenizer):
    # the tokenizer was trained on German and French: each Japanese character is three byte tokens
    tok, text = tiny_tokenizer, "日本語のテキストです"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 3 * len(text) and tok.decode(ids[:8]).endswith("\ufffd")
    prefix = text_prefix(tok, text, 8)
    assert prefix == "日本" and tok(prefix, add_special_tokens=False)["input_ids"] == ids[:6]


def test_open_text_rows_have_an_empty_prompt_and_train_on_every_token(tiny_tokenizer):
    tok = tiny_tokenizer
    rows = SourceRows("local:o.jsonl[train]", [{"id": "d0", "text": DOCUMENTS[0]}])
    (row,) = open_rows(rows, "text", 0, "raw", tok)
    assert (row["id"], row["pair"], row["origin"]) == ("open0:d0", "chat", "open")
    assert row["prompt"] == "" and row["response"] == DOCUMENTS[0]

    example = encode_texts(tok, [(row["prompt"], row["response"])], 512)[0]
    text_ids = tok(DOCUMENTS[0], add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == [tok.bos_token_id, *text_ids, tok.eos_token_id]
    # BOS is context only; every token of the document and the EOS carry loss
    assert example["labels"] == [IGNORE_INDEX, *text_ids, tok.eos_token_id]


def test_hf_backend_end_to_end_with_raw_prompts(tmp_path, tiny_target_dir, tiny_tokenizer):

    tok = tiny_tokenizer
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"q": "Der Zug nach Berlin"}, {"q": "La maison"}])
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": d} for d in DOCUMENTS])
    opened = write_jsonl(tmp_path / "open.jsonl", [{"body": d} for d in DOCUMENTS])
    recipe = make_recipe(
        tiny_target_dir,
        [
            {"kind": "local", "format": "prompts", "path": str(prompts), "fields": {"prompt": "q"}},
            {"kind": "local", "format": "text", "path": str(texts)},
        ],
        prompt_format="raw",
        text_prompt_tokens=6,
        temperatures=[0.0],
        max_new_tokens=4,
        open_fraction=0.4,
        eval_fraction=0.0,
        data={"open": [{"kind": "local", "format": "text", "path": str(opened), "fields": {"text": "body"}}]},
    )
    work = tmp_path / "run" / "distill"
    result = run_distill(recipe, tiny_target_dir, work)
    assert result.metrics["records"] == 5 and result.metrics["failures"] == 0

    records = {r["prompt_id"]: r for r in iter_records(work)}
    assert {records[f"0:local:{prompts}/train/{i}"]["prompt"] for i in range(2)} == {
        "Der Zug nach Berlin",
        "La maison",
    }
    prefixes = {text_prefix(tok, d, 6) for d in DOCUMENTS}
    assert {r["prompt"] for r in records.values() if r["prompt_id"].startswith("1:")} == prefixes
    for record in records.values():
        assert VICUNA_SYSTEM not in record["prompt"] and "USER:" not in record["prompt"]
        assert record["prompt_tokens"] == len(encode_prompt(tok, record["prompt"]))

    mix = read_mix(work, "chat", "train")
    distilled = [r for r in mix if r["origin"] == "distill"]
    open_mix = [r for r in mix if r["origin"] == "open"]
    assert len(distilled) == 5 and len(open_mix) == 2  # open_fraction 0.4 x 5 records
    assert {r["prompt"] for r in distilled} == {r["prompt"] for r in records.values()}
    assert all(r["prompt"] == "" and r["response"] in DOCUMENTS for r in open_mix)
    # the trainers read both kinds: distilled rows are supervised on the answer only
    examples, dropped = encode_rows(tok, distilled + open_mix, max_length=64)
    assert dropped == 0 and len(examples) == 7
    assert all(e["input_ids"][0] == tok.bos_token_id and e["labels"][0] == IGNORE_INDEX for e in examples)


def write_recipe(tmp_path: Path, data: str, prompt_format: str = "raw") -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"target: {{path: org/base-model}}\ndata:\n  pairs: [de-en]\n{data}distill: {{prompt_format: {prompt_format}}}\n",
        encoding="utf-8",
    )
    return path


def test_raw_with_translation_or_chat_sources_is_a_clear_error(tmp_path):
    translation = "  distill:\n    - {kind: hf, path: wmt16, name: de-en, pair: de-en}\n"
    with pytest.raises(RecipeError, match=r"`raw`.*data\.distill\[0\] \(wmt16\) is a `translation` source"):
        load_recipe(write_recipe(tmp_path, translation))
    chat = "  open:\n    - {kind: hf, format: chat, path: sharegpt}\n"
    with pytest.raises(RecipeError, match=r"data\.open\[0\] \(sharegpt\) is a `chat` source"):
        load_recipe(write_recipe(tmp_path, chat))
    evaluation = "  eval:\n    - {kind: offline, split: test, pair: de-en}\n"
    with pytest.raises(RecipeError, match=r"data\.eval\[0\] \(offline\) is a `translation` source"):
        load_recipe(write_recipe(tmp_path, evaluation))
    # the same sources are fine with a chat format, and text/prompts sources with raw
    assert load_recipe(write_recipe(tmp_path, translation, "vicuna")).distill.prompt_format == "vicuna"
    text = "  distill:\n    - {kind: hf, format: text, path: slim}\n"
    assert load_recipe(write_recipe(tmp_path, text)).distill.text_prompt_tokens == 128


def test_measure_builds_raw_prompts_from_text_and_prompt_sources(tmp_path, tiny_tokenizer):
    from polydraft.pipelines.schema import Recipe
    from polydraft.pipelines.schema.inputs import EvalPrompts

    texts = write_jsonl(tmp_path / "eval_texts.jsonl", [{"text": DOCUMENTS[0]}])
    questions = write_jsonl(tmp_path / "eval_q.jsonl", [{"question": "How many trains leave?"}])
    recipe = Recipe.model_validate(
        {
            "target": {"path": "org/base-model"},
            "data": {
                "pairs": ["de-en"],
                "eval": [
                    {"kind": "local", "format": "text", "path": str(texts)},
                    {
                        "kind": "local",
                        "format": "prompts",
                        "path": str(questions),
                        "fields": {"prompt": "question"},
                    },
                ],
            },
            "distill": {"prompt_format": "raw", "text_prompt_tokens": 5},
        }
    )
    text_set, question_set = EvalPrompts.of(recipe).load(1, 64, tiny_tokenizer)
    expected = encode_prompt(tiny_tokenizer, text_prefix(tiny_tokenizer, DOCUMENTS[0], 5))
    assert text_set.prompts[0].tolist() == expected and len(expected) == 6  # BOS + 5 tokens
    assert question_set.prompts[0].tolist() == encode_prompt(tiny_tokenizer, "How many trains leave?")


@pytest.mark.parametrize("name", ["llama-2-13b", "codellama-13b", "llama-2-70b"])
def test_base_eesd_recipes_continue_raw_slimpajama(name):
    recipe = load_recipe(PROJECT_ROOT / "recipes" / "eesd" / f"{name}.yaml")
    assert recipe.distill.prompt_format == "raw"
    (source,) = recipe.data.distill
    (kept,) = recipe.data.open
    assert (source.format, source.path) == (kept.format, kept.path) == ("text", "cerebras/SlimPajama-627B")
    assert recipe.distill.open_fraction > 0
    assert all(s.format in ("prompts", "text") for s in recipe.data.eval)


@pytest.mark.parametrize(
    ("name", "prompt_format"), [("vicuna-13b", "vicuna"), ("llama-2-70b-chat", "chat_template")]
)
def test_chat_eesd_recipes_keep_their_chat_format(name, prompt_format):
    recipe = load_recipe(PROJECT_ROOT / "recipes" / "eesd" / f"{name}.yaml")
    assert recipe.distill.prompt_format == prompt_format
    assert {s.format for s in recipe.data.distill} == {s.format for s in recipe.data.open} == {"chat"}


def test_hf_answer_text_keeps_the_space_a_sentencepiece_decode_drops():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from polydraft.distill.hf_backend import answer_text

    # Llama's tokenizer marks a word start with `▁` and drops it on the first token it decodes
    words = ["<unk>", "▁The", "▁cat", "▁sat", "▁on", "▁the", "▁mat"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    ids = tok("The cat sat on the mat", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[4:]) == "the mat"  # what decoding the answer alone gives
    assert answer_text(tok, ids[:4], ids[4:]) == " the mat"
    assert tok.decode(ids[:4]) + answer_text(tok, ids[:4], ids[4:]) == "The cat sat on the mat"
