"""Named drafter architectures (seed 003 §3.1, Table 4), built from scratch or loaded, always on the
target's vocabulary.

Speculative decoding compares the drafter's tokens with the target's one for one (and vLLM's draft-model
mode shares the token ids), so a drafter must use the target's tokenizer and vocabulary size exactly.
`check_drafter_compatible` enforces that before any training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    GemmaForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from polydraft.models.loading import load_tokenizer


class DrafterMismatch(ValueError):
    """A drafter that cannot draft for the target: another vocabulary or tokenizer."""


# Published shapes. llama-68m is JackFram/llama-68m (Miao et al., SpecInfer) and vicuna-68m is
# double7/vicuna-68m (Yang et al.), the same architecture. gemma-250m is seed 003 Table 4; its head
# dimension is not listed there, so it keeps Gemma's own 256 (the table lists only what was changed
# from Gemma-7B's config), which also gives the ~250M parameters of the name with a 256k vocabulary.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-68m": {
        "family": "llama",
        "hidden_size": 768,
        "num_layers": 2,
        "num_heads": 12,
        "num_kv_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "gemma-250m": {
        "family": "gemma",
        "hidden_size": 768,
        "num_layers": 2,
        "num_heads": 16,
        "num_kv_heads": 2,
        "intermediate_size": 6144,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}
ARCHITECTURES["vicuna-68m"] = dict(ARCHITECTURES["llama-68m"])
# `custom` is a Llama whose shape the recipe gives in full.
CUSTOM_BASE: dict[str, Any] = {
    "family": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
}


def drafter_shape(
    arch: str,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
) -> dict[str, Any]:
    """The architecture's shape with any given field replacing the named one."""
    if arch == "custom":
        shape = dict(CUSTOM_BASE)
    elif arch in ARCHITECTURES:
        shape = dict(ARCHITECTURES[arch])
    else:
        raise ValueError(
            f"unknown drafter architecture {arch!r}; expected one of {[*ARCHITECTURES, 'custom']}"
        )
    given = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
    }
    shape.update({k: v for k, v in given.items() if v is not None})
    if num_heads is not None and num_kv_heads is None and arch == "custom":
        shape["num_kv_heads"] = num_heads
    missing = [k for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size") if k not in shape]
    if missing:
        raise ValueError(f"drafter `{arch}` needs {', '.join(missing)}")
    shape.setdefault("num_kv_heads", shape["num_heads"])
    if shape["hidden_size"] % shape["num_heads"] and "head_dim" not in shape:
        raise ValueError(
            f"hidden_size {shape['hidden_size']} is not divisible by num_heads {shape['num_heads']}"
        )
    if shape["num_heads"] % shape["num_kv_heads"]:
        raise ValueError(
            f"num_heads {shape['num_heads']} is not a multiple of num_kv_heads {shape['num_kv_heads']}"
        )
    return shape


def build_drafter(
    arch: str,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    max_position_embeddings: int = 2048,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **shape_overrides: int | None,
) -> PreTrainedModel:
    """A randomly initialised drafter (fp32) of a named or custom architecture on the target's vocabulary."""
    shape = drafter_shape(arch, **shape_overrides)
    config_cls, model_cls = FAMILIES[shape["family"]]
    extra = {"head_dim": shape["head_dim"]} if "head_dim" in shape else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        intermediate_size=shape["intermediate_size"],
        hidden_act=shape["hidden_act"],
        rms_norm_eps=shape["rms_norm_eps"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **extra,
    )
    config._attn_implementation = attn_implementation
    # a seeded init that leaves the caller's global RNG as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config)


def check_drafter(
    path: str,
    revision: str | None,
    target_vocab_size: int,
    target_tokenizer: Any,
    target_name: str = "the target",
) -> None:
    """DrafterMismatch unless checkpoint `path` has the target's vocabulary size and (when it ships one) the
    target's tokenizer. Reads its config and tokenizer only, never its weights."""
    config = AutoConfig.from_pretrained(path, revision=revision)
    check_drafter_compatible(
        int(config.get_text_config().vocab_size),
        target_vocab_size,
        target_tokenizer,
        drafter_tokenizer(path, revision),
        drafter_name=f"drafter {path}",
        target_name=target_name,
    )


def load_drafter(
    path: str,
    revision: str | None,
    *,
    target_vocab_size: int,
    target_tokenizer: Any,
    target_name: str = "the target",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A drafter checkpoint (local folder or hub id), checked with `check_drafter` before any weight is
    read: the one way every stage loads a drafter (training starts, measurement, calibration, export)."""
    check_drafter(path, revision, target_vocab_size, target_tokenizer, target_name)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype, **extra)


def _has_tokenizer(path: str) -> bool:
    folder = Path(path)
    if folder.is_dir():
        return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    return True  # a hub id: ask the hub (a checkpoint there without a tokenizer raises, handled below)


def drafter_tokenizer(path: str, revision: str | None = None) -> Any | None:
    """The tokenizer shipped with a drafter checkpoint, or None when it ships none."""
    if not _has_tokenizer(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except (OSError, ValueError):
        return None


def check_drafter_compatible(
    drafter_vocab_size: int,
    target_vocab_size: int,
    target_tokenizer: Any,
    drafter_tok: Any | None = None,
    drafter_name: str = "the drafter",
    target_name: str = "the target",
) -> None:
    """Raise DrafterMismatch unless the drafter has the target's vocabulary size and (when it ships one)
    the target's tokenizer: same token -> id map and the same special tokens."""
    if drafter_vocab_size != target_vocab_size:
        raise DrafterMismatch(
            f"{drafter_name} has a vocabulary of {drafter_vocab_size} tokens but {target_name} has "
            f"{target_vocab_size}: a drafter must use the target's vocabulary. Start from scratch "
            "(drafter.init: null, the drafter is then built on the target's tokenizer) or pick a "
            "checkpoint trained with the target's tokenizer."
        )
    if drafter_tok is None:
        return
    if drafter_tok.get_vocab() != target_tokenizer.get_vocab():
        raise DrafterMismatch(
            f"{drafter_name} ships a tokenizer whose vocabulary differs from {target_name}'s "
            f"(same size {drafter_vocab_size}, different token ids): a drafter must use the target's "
            "tokenizer. Start from scratch (drafter.init: null) or pick a checkpoint trained with it."
        )
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(drafter_tok, name) != getattr(target_tokenizer, name):
            raise DrafterMismatch(
                f"{drafter_name}'s tokenizer has {name}={getattr(drafter_tok, name)} but {target_name}'s "
                f"has {getattr(target_tokenizer, name)}"
            )


def check_init_for_target(
    init: str, revision: str | None, target_path: str, target_revision: str | None, trust_remote_code: bool
) -> None:
    """DrafterMismatch when drafter checkpoint `init` does not fit the target's vocabulary (`check_drafter`):
    what the training stages check before they launch any process."""
    tokenizer = load_tokenizer(target_path, target_revision, trust_remote_code)
    vocab = target_vocab_size(target_path, target_revision, trust_remote_code)
    check_drafter(init, revision, vocab, tokenizer, f"target {target_path}")


def target_vocab_size(path: str, revision: str | None = None, trust_remote_code: bool = False) -> int:
    """The vocabulary size of the target's model config (its logits' width), without loading weights."""
    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    return int(config.get_text_config().vocab_size)


def export_drafter(
    model: PreTrainedModel, tokenizer: Any, out_dir: Path, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """A Hugging Face folder: config, model.safetensors, the target's tokenizer and a generation config.

    `AutoModelForCausalLM.from_pretrained(out_dir)` loads it, and it works as `assistant_model=` next to
    the target in transformers and as a draft model in vLLM (same tokenizer, same vocabulary).
    `state_dict`: the full weights when they are sharded across processes (FSDP, ZeRO-3).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    ).save_pretrained(out_dir)
    return out_dir
