"""What the measure stage measures: the run's drafters and the evaluation prompt sets.

Drafters are discovered in the upstream stage folders that exist, so a run without some stage
measures what it has:
- `finetune/<pair>/`: one language-specific drafter per pair (a Hugging Face folder);
- `pretrain/model/`: the generic pretrained drafter (seed 003's P-only baseline), when asked for;
- `measure.extra_drafters`: any other Hugging Face folder or hub id (a published drafter, say); one whose
  last path part names a language pair (`.../finetune/de-en`) is that pair's drafter, so that
  `measure.cross_pairs` applies to it;
- `early_exit/head/`: the early-exit head for `eesd`;
- `eagle3/<pair>/` (and `eagle3/multilingual/`): the EAGLE-3 heads for `eagle3`, named `eagle3-<pair>`;
- `heads/heads/`: the blockwise proposal heads for `bpd`, `medusa` and their `+rescore` variants (which
  rescore with each standalone drafter above);
- `calibrate/<name>/`: a calibration model for the drafter called `<name>` (`early_exit` for the head),
  used by Cali-TS.

Eval sets come from `data.eval`; prompts are built exactly as the distill stage builds them
(`distill.prompt_format`: Vicuna v1.1, the tokenizer's chat template or the raw text; translation rows
get seed 003's task prefix; a `text` row's first `distill.text_prompt_tokens` tokens), so drafters are
measured on the prompt format they were trained on. Problems are ValueErrors naming the source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from polydraft.data.prompts import (
    PAIRS,
    build_prompt,
    chat_turns,
    encode_prompt,
    text_prefix,
    translation_messages,
)
from polydraft.data.sources import read_source

log = logging.getLogger(__name__)

P = TypeVar("P")
EAGLE3_PREFIX = "eagle3-"
"""An EAGLE-3 head's drafter name is this and its folder's (`eagle3-de-en`): pair drafters are named by
their pair already."""


@dataclass(frozen=True)
class DrafterSource:
    """A drafter to measure: where it is and what it was trained for."""

    name: str
    kind: str
    """`finetune`, `pretrain`, `extra` (standalone models), `early_exit` (the head for `eesd`), `eagle3`
    (an EAGLE-3 head) or `heads` (the blockwise proposal heads)."""
    path: str
    pair: str | None
    """The language pair it was finetuned on (None for generic drafters and the early-exit head)."""
    calibration: Path | None = None
    """Folder of its calibration model (Cali-TS), when the calibrate stage made one."""


def discover_drafters(
    upstream: dict[str, Path], extra: dict[str, str], include_pretrained: bool
) -> list[DrafterSource]:
    """The drafters present in the upstream stage folders, plus the configured extra ones."""
    found: list[DrafterSource] = []
    if "finetune" in upstream:
        for folder in sorted(Path(upstream["finetune"]).iterdir()):
            if (folder / "config.json").is_file():
                pair = folder.name if folder.name in PAIRS else None
                found.append(DrafterSource(folder.name, "finetune", str(folder), pair))
    pretrained = Path(upstream["pretrain"]) / "model" if "pretrain" in upstream else None
    if include_pretrained and pretrained is not None and (pretrained / "config.json").is_file():
        found.append(DrafterSource("pretrain", "pretrain", str(pretrained), None))
    for name, path in extra.items():
        found.append(DrafterSource(name, "extra", path, extra_pair(path)))
    head = Path(upstream["early_exit"]) / "head" if "early_exit" in upstream else None
    if head is not None and (head / "early_exit.json").is_file():
        found.append(DrafterSource("early_exit", "early_exit", str(head), None))
    if "eagle3" in upstream:
        for folder in sorted(Path(upstream["eagle3"]).iterdir()):
            if (folder / "config.json").is_file() and (folder / "eagle3.json").is_file():
                pair = folder.name if folder.name in PAIRS else None
                found.append(DrafterSource(f"{EAGLE3_PREFIX}{folder.name}", "eagle3", str(folder), pair))
    heads = Path(upstream["heads"]) / "heads" if "heads" in upstream else None
    if heads is not None and (heads / "heads.json").is_file():
        found.append(DrafterSource("heads", "heads", str(heads), None))
    names = [d.name for d in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"drafter names {duplicates} are used twice; rename measure.extra_drafters keys")
    if "calibrate" in upstream:
        root = Path(upstream["calibrate"])
        found = [
            DrafterSource(d.name, d.kind, d.path, d.pair, root / d.name)
            if (root / d.name / "calibration.json").is_file()
            else d
            for d in found
        ]
    return found


def extra_pair(path: str) -> str | None:
    """The language pair of an extra drafter: the last part of its path when that names a pair."""
    last = Path(path).name
    return last if last in PAIRS else None


@dataclass
class EvalSet:
    """One evaluation set: its name, language pair (translation sets) and tokenized prompts."""

    name: str
    pair: str | None
    prompts: list[torch.Tensor]
    texts: list[str] = field(default_factory=list)
    """Each prompt's last user turn as the user wrote it (what a language router sees)."""
    skipped_long: int = 0


def prompt_messages(
    row: dict[str, Any], format: str, tokenizer: Any, text_prompt_tokens: int
) -> list[dict[str, str]]:
    """The conversation a row asks the target to continue: as distill builds it (translation rows get
    seed 003's task prefix; a chat row's first user turn, with what precedes it; a text row's first
    `text_prompt_tokens` tokens)."""
    if format == "translation":
        return translation_messages(row["pair"], row["source"])
    if format == "prompts":
        return [{"role": "user", "content": row["prompt"]}]
    if format == "text":
        return [{"role": "user", "content": text_prefix(tokenizer, row["text"], text_prompt_tokens)}]
    if format == "chat":
        turns = chat_turns(row["conversations"])
        if not turns:
            raise ValueError(f"chat row {row['id']} has no user turn")
        return turns[0][1]
    raise ValueError(f"`{format}` rows are not prompts (use translation, chat, prompts or text sources)")


def prompt_ids(messages: list[dict[str, str]], prompt_format: str, tokenizer: Any) -> list[int]:
    """Token ids of the prompt, with distill's `build_prompt` and `encode_prompt`."""
    return encode_prompt(tokenizer, build_prompt(messages, prompt_format, tokenizer))


def set_name(
    pair: str | None, format: str, name: str | None, path: str | None, kind: str, taken: set[str]
) -> str:
    """A translation set is named after its pair, any other after its dataset config or file; a number is
    appended when the name is taken."""
    base = pair if format == "translation" and pair else (name or Path(path or kind).stem)
    name, index = base, 2
    while name in taken:
        name, index = f"{base}-{index}", index + 1
    return name


def load_eval_sets(
    sources: list[dict[str, Any]],
    prompt_format: str,
    text_prompt_tokens: int,
    num_prompts: int,
    max_prompt_tokens: int,
    tokenizer: Any,
) -> list[EvalSet]:
    """`num_prompts` prompts of each source (`read_source` keyword arguments, shuffled with their seed),
    tokenized; prompts longer than `max_prompt_tokens` are skipped and counted."""
    if not sources:
        raise ValueError(
            "data.eval is empty; add evaluation sets, e.g. "
            "`data.eval: [{kind: offline, format: translation, split: test, pair: de-en}]` (one per pair)"
        )
    sets: list[EvalSet] = []
    for source in sources:
        # read extra rows: prompts longer than max_prompt_tokens are skipped
        limit = source["limit"] if source["limit"] is not None else 2 * num_prompts
        rows = read_source(**{**source, "limit": limit}).rows
        name = set_name(
            source["pair"],
            source["format"],
            source["name"],
            source["path"],
            source["kind"],
            {s.name for s in sets},
        )
        eval_set = EvalSet(name, source["pair"], [])
        for row in rows:
            messages = prompt_messages(row, source["format"], tokenizer, text_prompt_tokens)
            ids = prompt_ids(messages, prompt_format, tokenizer)
            if len(ids) > max_prompt_tokens:
                eval_set.skipped_long += 1
                continue
            eval_set.prompts.append(torch.tensor(ids, dtype=torch.long))
            eval_set.texts.append(messages[-1]["content"])
            if len(eval_set.prompts) == num_prompts:
                break
        if not eval_set.prompts:
            raise ValueError(f"eval set {eval_set.name} has no prompt of at most {max_prompt_tokens} tokens")
        if eval_set.skipped_long:
            log.warning(
                "measure: %s: skipped %d prompts longer than %d tokens",
                eval_set.name,
                eval_set.skipped_long,
                max_prompt_tokens,
            )
        sets.append(eval_set)
    return sets


def repetition_prompts(
    prompts: list[P], seeds: list[int], seed: int, num_prompts: int, disjoint: bool
) -> list[P]:
    """The prompts one seed decodes: all of them, or (`disjoint`) the seed's own slice of `num_prompts`
    (the i-th seed of `seeds` gets prompts i * num_prompts onwards), so seeds repeat over other prompts."""
    if not disjoint:
        return prompts
    index = seeds.index(seed)
    chosen = prompts[index * num_prompts : (index + 1) * num_prompts]
    if len(chosen) < num_prompts:
        raise ValueError(
            f"{len(prompts)} eval prompts are too few for {len(seeds)} disjoint repetitions of {num_prompts}"
        )
    return chosen
