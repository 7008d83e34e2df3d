"""Loading targets and drafters with transformers: local folders or hub ids, the right dtype per device."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU that supports it (float16 on older ones), float32 on a CPU."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_causal_lm(
    path: str,
    revision: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """A causal LM in eval mode on `device` (default: the GPU if there is one)."""
    device = device or default_device()
    model = AutoModelForCausalLM.from_pretrained(
        path, revision=revision, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def load_tokenizer(
    path: str, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
