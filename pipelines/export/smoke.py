"""Smoke checks of an exported folder, run before anything leaves the machine.

A standalone drafter's folder must:
- hold what a Hugging Face model folder needs (config, weights, tokenizer, generation config);
- reload with `AutoModelForCausalLM.from_pretrained` and ship the target's tokenizer and vocabulary;
- pass the rules of vLLM's draft-model mode (`speculative_config={"method": "draft_model", ...}`), as
  vLLM checks them when it builds its `SpeculativeConfig` and `DraftModelProposer`: the same vocabulary
  size as the target, an architecture in vLLM's model registry, a text-only model without M-RoPE; its
  context is capped at the smaller of its own and the target's, and it runs with the target's tensor
  parallel size (so that size must divide its attention heads);
- give, as transformers' `assistant_model`, exactly the target's own greedy output on a few prompts;
- when vllm is installed (a GPU build with a GPU, or the CPU build), generate greedily with vLLM: the
  target alone, then the target with the drafter as its draft model; the tokens must be identical
  (`pipelines.export.vllm_check`, every folder of the export in one subprocess).

An early-exit head's folder must attach to the loaded target (`models.early_exit.attach_exit_head`)
and give, with polydraft's `eesd` decoder at temperature 0, exactly the target's greedy output; its
calibration model, when it has one, must load and fit the target's hidden size.

Each check is a `Check` (pass / fail / warn / skipped, with a message that says what is wrong);
a folder passes when no check failed.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polydraft.models.placement import input_device

# Architectures of vLLM's text-generation registry (vllm/model_executor/models/registry.py) that small
# drafters use; checked against vLLM's own registry instead whenever vllm is importable.
VLLM_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "GPT2LMHeadModel",
        "GPTNeoXForCausalLM",
        "OPTForCausalLM",
    }
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class Check:
    name: str
    status: str
    """`pass`, `fail`, `warn` (works, with a caveat the card states) or `skipped` (could not run here)."""
    detail: str


def passed(checks: list[Check]) -> bool:
    return not any(c.status == "fail" for c in checks)


# ----------------------------------------------------------------------------- standalone drafters


def file_checks(folder: Path) -> Check:
    names = {p.name for p in folder.iterdir()}
    missing = [n for n in ("config.json", "generation_config.json") if n not in names]
    if not {"model.safetensors", "model.safetensors.index.json"} & names:
        missing.append("model.safetensors")
    if not set(TOKENIZER_FILES) & names:
        missing.append("tokenizer files (" + " / ".join(TOKENIZER_FILES) + ")")
    if missing:
        return Check("files", "fail", f"missing {', '.join(missing)}")
    return Check("files", "pass", "config, safetensors weights, tokenizer and generation config present")


def supported_architectures() -> tuple[frozenset[str], str]:
    """vLLM's registry when vllm is importable, else polydraft's list; and which one it is."""
    if importlib.util.find_spec("vllm") is None:
        return VLLM_ARCHITECTURES, "polydraft's list of vLLM architectures (vllm is not installed here)"
    import vllm
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs()), f"vLLM {vllm.__version__}'s model registry"


def vllm_rule_checks(drafter: Any, target: Any, supported: frozenset[str], source: str) -> list[Check]:
    """vLLM's draft-model rules on the two configs (no vllm needed)."""
    d, t = drafter.get_text_config(), target.get_text_config()
    checks = []
    if d.vocab_size == t.vocab_size:
        checks.append(Check("vllm_vocabulary", "pass", f"{d.vocab_size} tokens, as the target"))
    else:
        checks.append(
            Check(
                "vllm_vocabulary",
                "fail",
                f"the drafter has {d.vocab_size} tokens but the target {t.vocab_size}: vLLM's draft_model "
                "method requires the same vocabulary size (and transformers' assisted generation the same "
                "tokenizer); retrain the drafter on the target's tokenizer",
            )
        )
    architectures = list(drafter.architectures or [])
    known = [a for a in architectures if a in supported]
    multimodal = [k for k in ("vision_config", "audio_config") if getattr(drafter, k, None) is not None]
    if multimodal or not known:
        why = f"multimodal ({', '.join(multimodal)})" if multimodal else f"not in {source}"
        checks.append(Check("vllm_architecture", "fail", f"{architectures or 'no architecture'}: {why}"))
    else:
        checks.append(Check("vllm_architecture", "pass", f"{known[0]} is in {source}"))
    rope = json.dumps(getattr(d, "rope_parameters", None) or getattr(d, "rope_scaling", None) or {})
    if "mrope_section" in rope:
        checks.append(Check("vllm_rope", "fail", "M-RoPE: vLLM's draft models do not support it"))
    d_len, t_len = d.max_position_embeddings, t.max_position_embeddings
    if d_len >= t_len:
        checks.append(Check("vllm_max_model_len", "pass", f"drafter context {d_len} >= target's {t_len}"))
    else:
        checks.append(
            Check(
                "vllm_max_model_len",
                "warn",
                f"drafter context {d_len} < target's {t_len}: vLLM caps the draft model at {d_len} "
                "positions and drafts nothing past them",
            )
        )
    heads = (d.num_attention_heads, t.num_attention_heads)
    sizes = [n for n in range(1, min(heads) + 1) if heads[0] % n == 0 and heads[1] % n == 0]
    checks.append(
        Check(
            "vllm_tensor_parallel",
            "pass",
            "vLLM runs the draft model with the target's tensor parallel size; "
            f"sizes that divide both models' heads ({heads[0]}, {heads[1]}): {sizes}",
        )
    )
    return checks


def generation_options(eos_ids: set[int], pad_id: int | None) -> dict[str, Any]:
    eos = sorted(eos_ids) or None
    return {
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "eos_token_id": eos,
        "pad_token_id": eos[0] if eos else pad_id,
    }


@torch.inference_mode()
def assisted_check(
    target: Any, drafter: Any, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int]
) -> Check:
    """transformers' assisted generation with the drafter gives the target's own greedy tokens."""
    options = generation_options(eos_ids, target.config.pad_token_id)
    for index, prompt in enumerate(prompts):
        ids = prompt.view(1, -1).to(input_device(target))
        common = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": max_new_tokens}
        alone = target.generate(**common, **options)[0, ids.shape[1] :].tolist()
        helped = target.generate(**common, **options, assistant_model=drafter)[0, ids.shape[1] :].tolist()
        if alone != helped:
            at = next(
                (i for i, (a, b) in enumerate(zip(alone, helped)) if a != b), min(len(alone), len(helped))
            )
            return Check(
                "assisted_generation",
                "fail",
                f"prompt {index}: assisted generation differs from the target alone from new token {at} on "
                f"({helped[at : at + 5]} vs {alone[at : at + 5]}); in low precision numerical ties can cause "
                "this, otherwise the drafter or transformers is broken",
            )
    return Check(
        "assisted_generation",
        "pass",
        f"{len(prompts)} prompts x up to {max_new_tokens} new tokens at temperature 0: `generate(..., "
        "assistant_model=drafter)` output identical to the target alone",
    )


def drafter_checks(
    folder: Path,
    target: Any,
    target_tokenizer: Any,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    eos_ids: set[int],
) -> list[Check]:
    """Every check of a standalone drafter's exported folder except the real vLLM generation."""
    from transformers import AutoModelForCausalLM

    from polydraft.models.drafters import DrafterMismatch, check_drafter, drafter_tokenizer

    checks = [file_checks(folder)]
    try:
        drafter = (
            AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).to(input_device(target)).eval()
        )
    except (OSError, ValueError, RuntimeError) as err:
        checks.append(Check("reload", "fail", f"AutoModelForCausalLM.from_pretrained failed: {err}"))
        return checks
    checks.append(Check("reload", "pass", f"AutoModelForCausalLM.from_pretrained: {type(drafter).__name__}"))
    d_vocab = drafter.config.get_text_config().vocab_size
    t_vocab = target.config.get_text_config().vocab_size
    try:
        if drafter_tokenizer(str(folder)) is None:
            raise DrafterMismatch("the folder ships no tokenizer; it must carry the target's")
        check_drafter(str(folder), None, t_vocab, target_tokenizer, "the target")
        checks.append(Check("tokenizer", "pass", "the target's tokenizer and vocabulary"))
    except DrafterMismatch as err:
        checks.append(Check("tokenizer", "fail", str(err)))
    supported, source = supported_architectures()
    checks += vllm_rule_checks(drafter.config, target.config, supported, source)
    if (folder / "calibration").is_dir():
        draft_hidden = drafter.config.get_text_config().hidden_size
        hidden = target.config.get_text_config().hidden_size
        checks.append(calibration_check(folder / "calibration", hidden, draft_hidden, input_device(target)))
    if d_vocab != t_vocab:
        checks.append(Check("assisted_generation", "skipped", "not run: the vocabularies differ"))
    else:
        checks.append(assisted_check(target, drafter, prompts, max_new_tokens, eos_ids))
    return checks


def calibration_check(folder: Path, target_hidden: int, draft_hidden: int, device: Any) -> Check:
    """The calibration model (Cali-TS) loads and takes the two models' hidden states."""
    from polydraft.models.calibration import CalibrationModel

    try:
        calibration = CalibrationModel.load(folder, device)
        sizes = (calibration.target_hidden_size, calibration.draft_hidden_size)
        if sizes != (target_hidden, draft_hidden):
            raise ValueError(
                f"sizes {sizes}, the target's and drafter's hidden sizes are {target_hidden, draft_hidden}"
            )
        probability = calibration.predict(1, torch.zeros(target_hidden), torch.zeros(draft_hidden))
    except (OSError, ValueError, RuntimeError) as err:
        return Check("calibration", "fail", f"calibration model: {err}")
    return Check("calibration", "pass", f"`calibration/` loads; predicts {probability:.3f} on zero states")


# ----------------------------------------------------------------------------- the early-exit head


@torch.inference_mode()
def head_checks(
    folder: Path, target: Any, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int], k: int
) -> list[Check]:
    """The head attaches to the target, self-speculates losslessly, and its calibration model fits."""
    from polydraft.decoding.control import FixedK
    from polydraft.decoding.eesd import SelfSpeculative, self_speculative
    from polydraft.decoding.engine import autoregressive
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling
    from polydraft.models.early_exit import attach_exit_head

    try:
        head = attach_exit_head(target, folder)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return [Check("attach", "fail", f"attach_exit_head failed: {err}")]
    checks = [
        Check(
            "attach",
            "pass",
            f"attach_exit_head: exit after {head.num_shared_layers} of {head.num_hidden_layers} layers",
        )
    ]
    greedy, target_lm = Sampling(0.0), CachedLM(target, profile=False)
    model = SelfSpeculative(target, head, profile=False)
    generator = torch.Generator(device=input_device(target)).manual_seed(0)
    check = Check(
        "eesd_greedy",
        "pass",
        f"{len(prompts)} prompts x up to {max_new_tokens} new tokens: polydraft's `eesd` with K={k} "
        "gives the target's own greedy output",
    )
    for index, prompt in enumerate(prompts):
        alone = autoregressive(target_lm, prompt, max_new_tokens, greedy, generator, eos_ids).tokens
        drafted = self_speculative(
            model, prompt, max_new_tokens, greedy, FixedK(k), generator, eos_ids
        ).tokens
        if alone != drafted:
            check = Check("eesd_greedy", "fail", f"prompt {index}: `eesd` output differs from the target's")
            break
    checks.append(check)
    hidden = target.config.get_text_config().hidden_size
    if (folder / "calibration").is_dir():
        checks.append(calibration_check(folder / "calibration", hidden, hidden, input_device(target)))
    checks.append(
        Check("vllm", "skipped", "vLLM has no method for polydraft's early-exit heads; decode with `eesd`")
    )
    return checks
