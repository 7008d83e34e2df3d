"""Exporting an EAGLE-3 head (`eagle3/<pair>/`): its staged folder, the facts its card states, polydraft's
own smoke checks and the card's head-specific sections.

The staged folder is the speculators format vLLM's `eagle3` method loads (`models.eagle3`): `config.json`
whose verifier names the public target (never a local path) and whose `speculative_tokens` is the K that
measured best, `model.safetensors` with `d2t` / `t2d`, and polydraft's `eagle3.json`. Before it is
published it must:
- load with polydraft's loader and fit the loaded target (vocabulary, width, feature layers);
- give, with polydraft's `eagle3` decoder at temperature 0, the target's own greedy output (the drafts it
  accepted are counted);
- when vLLM can run here, generate greedily in vLLM with the folder as the target's `eagle3` draft: the
  target's own output, and vLLM's acceptance counters above zero (a head vLLM read with another vocabulary
  map, feature layers or norm placement than polydraft trained would have all its drafts rejected). The
  caller runs that check in a subprocess (`pipelines.export.vllm_check`, `method="eagle3"`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from polydraft.models.eagle3 import INFO_FILE, WEIGHTS_FILE, load_eagle3, read_info
from polydraft.models.placement import input_device
from polydraft.pipelines.export.records import Eagle3Card, ExportResults, PublicTarget
from polydraft.pipelines.export.smoke import Check
from polydraft.train.stage_metrics import Eagle3HeadMetrics


def stage_eagle3(source: Path, staged: Path, target: PublicTarget, speculative_tokens: int) -> dict[str, Any]:
    """Copy the head, its config naming the public target and drafting `speculative_tokens` per round."""
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    verifier = config["speculators_config"]["verifier"]
    verifier["name_or_path"] = target.id or "path/to/the/target"
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = speculative_tokens
    for name in (WEIGHTS_FILE, INFO_FILE):
        if (source / name).is_file():  # a missing one fails the smoke check, by name
            shutil.copy2(source / name, staged / name)
    info = read_info(source)
    info["target"] = {"path": target.id, "revision": target.revision}
    (staged / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def eagle3_facts(config: dict[str, Any], folder: Path, speculative_tokens: int) -> Eagle3Card:
    """The head's shape (`config.json`), its draft vocabulary and training (`eagle3.json`)."""
    from safetensors import safe_open

    info = read_info(folder)
    metrics = Eagle3HeadMetrics.model_validate(info["training"])
    parameters = 0
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if key not in ("d2t", "t2d"):
                parameters += int(torch.tensor(handle.get_slice(key).get_shape()).prod())
    final, initial = metrics.final, metrics.initial
    return Eagle3Card(
        aux_layers=config["eagle_aux_hidden_state_layer_ids"],
        target_hidden_size=config["target_hidden_size"],
        draft_vocab_size=config["draft_vocab_size"],
        vocab=metrics.vocab,
        parameters=parameters,
        ttt_steps=info["ttt_steps"],
        steps=metrics.steps,
        tokens=metrics.tokens,
        train_loss=metrics.train_loss,
        top1_by_step=[s.top1 for s in final.steps] if final else None,
        expected_accepted=final.expected_accepted if final else None,
        initial_expected_accepted=initial.expected_accepted if initial else None,
        speculative_tokens=speculative_tokens,
    )


@torch.inference_mode()
def eagle3_checks(
    folder: Path, target: Any, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int], k: int
) -> list[Check]:
    """Every check of an exported head except the real vLLM generation."""
    from polydraft.decoding.control import FixedK
    from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
    from polydraft.decoding.engine import autoregressive
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling

    missing = [name for name in ("config.json", WEIGHTS_FILE, INFO_FILE) if not (folder / name).is_file()]
    files = Check("files", "fail", f"missing {', '.join(missing)}") if missing else Check(
        "files", "pass", f"config.json, {WEIGHTS_FILE} (with d2t, t2d) and {INFO_FILE} present"
    )  # fmt: skip
    try:
        head = load_eagle3(folder, input_device(target), target.dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return [files, Check("load", "fail", f"load_eagle3 failed: {err}")]
    text = target.config.get_text_config(decoder=True)
    if (head.config.vocab_size, head.target_hidden_size) != (text.vocab_size, text.hidden_size) or max(
        head.aux_layers
    ) >= text.num_hidden_layers:
        return [
            files,
            Check("load", "fail", "the head was made for another target (vocabulary, width or layers)"),
        ]
    greedy, plain = Sampling(0.0), CachedLM(target, profile=False)
    featured = CachedLM(target, profile=False, aux_layers=head.aux_layers)
    drafter = Eagle3Drafter(head, target.get_input_embeddings(), profile=False)
    generator = torch.Generator(device=input_device(target))
    accepted = drafted = 0
    for index, prompt in enumerate(prompts):
        alone = autoregressive(plain, prompt, max_new_tokens, greedy, generator, eos_ids).tokens
        got = eagle3_decode(featured, drafter, prompt, max_new_tokens, greedy, FixedK(k), generator, eos_ids)
        if got.tokens != alone:
            return [
                files,
                Check("eagle3_greedy", "fail", f"prompt {index}: `eagle3` output differs from the target's"),
            ]
        accepted += sum(r.accepted for r in got.rounds)
        drafted += sum(r.drafted for r in got.rounds)
    load = Check(
        "load",
        "pass",
        f"load_eagle3: feature layers {head.aux_layers}, draft vocabulary {head.draft_vocab_size} of "
        f"{head.config.vocab_size}",
    )
    greedy_check = Check(
        "eagle3_greedy",
        "pass",
        f"{len(prompts)} prompts x up to {max_new_tokens} new tokens: polydraft's `eagle3` (K={k}) gives the "
        f"target's own greedy output; {accepted} of {drafted} draft tokens accepted",
    )
    return [files, load, greedy_check]


# ----------------------------------------------------------------------------- the card


def intro(info: ExportResults, target: str) -> str:
    card = info.eagle3
    assert card is not None
    vocab = card.vocab
    coverage = f"{100 * vocab.coverage_heldout:.1f}%" if vocab.coverage_heldout is not None else "-"
    what = f"{info.pair} translation" if info.pair else "every pair's translation (multilingual)"
    return (
        f"An EAGLE-3 draft head (arXiv 2503.01840) for {target}, trained for {what} on the target's own "
        f"answers: the target's states entering layers {card.aux_layers}, fused by a linear layer, feed one "
        f"decoder layer whose other input is the next token's embedding; a norm and an lm head over a draft "
        f"vocabulary of {card.draft_vocab_size} tokens chosen from this language's answers ({coverage} of "
        f"its held-out answer tokens; {_num(card.parameters)} parameters, the target's embeddings shared). "
        "vLLM serves it with its `eagle3` speculative method; polydraft decodes with it as `eagle3`."
    )


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def training_lines(info: ExportResults) -> list[str]:
    card = info.eagle3
    assert card is not None
    vocab = card.vocab
    steps = ", ".join(f"{v:.3f}" for v in card.top1_by_step) if card.top1_by_step else "-"
    return [
        f"- Training-time test over {card.ttt_steps} draft steps (each step's forward KL to the target's "
        f"distribution restricted to the draft vocabulary, weighted 0.8^i); {_num(card.steps)} optimizer "
        f"steps over {_num(card.tokens)} tokens, final train loss {_num(card.train_loss)}; the target's "
        "features computed on the fly by the frozen target.",
        f"- Draft vocabulary: {vocab.size} tokens ({vocab.kept} special and byte tokens always kept), chosen "
        f"from {_num(vocab.answer_tokens)} tokens of self-distilled answers; coverage {_num(vocab.coverage_train)} "
        f"of those, {_num(vocab.coverage_heldout)} of the held-out answers' tokens.",
        f"- Held-out top-1 agreement with the target's greedy token, draft step by step: {steps}; expected "
        f"accepted drafts per round of {card.ttt_steps} (were the steps independent) "
        f"{_num(card.expected_accepted)} (as initialised: {_num(card.initial_expected_accepted)}).",
    ]


def usage_lines(info: ExportResults, repo_id: str, target: str) -> list[str]:
    card = info.eagle3
    assert card is not None
    prompt, k = info.prompt, card.speculative_tokens
    speculative = f'{{"method": "eagle3", "model": "{repo_id}", "num_speculative_tokens": {k}}}'
    return [
        "## Usage",
        "",
        f"Use the prompt format it was trained on (`{prompt.format}`). K={k} drafts per round is the K that "
        "measured best (the folder's `config.json` says so too).",
        "",
        "vLLM:",
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f"prompt = {prompt.example!r}",
        f'llm = LLM(model="{target}", speculative_config={speculative})',
        "print(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=256))[0].outputs[0].text)",
        "```",
        "",
        f"or `vllm serve {target} --speculative-config '{speculative}'`. One server per language's head; "
        "`routing.json` of the run's export says which head serves which language.",
        "",
    ]
