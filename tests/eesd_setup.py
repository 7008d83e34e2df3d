"""A tiny target whose layers matter, for the early-exit and calibration tests.

At the usual initialisation scale (std 0.02) a random tiny Llama's residual stream is its embedding and
every layer's argmax is the same; top-1 agreement would be 1.0 for any N. Scaling the layers' matrices
by 5 makes each layer change the prediction, so an exit after layer 2 disagrees with the full target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polydraft.models.tiny import build_llama


def save_layered_target(folder: Path, tokenizer, num_layers: int = 4, scale: float = 5.0) -> Path:
    model = build_llama(
        vocab_size=len(tokenizer), hidden_size=64, num_layers=num_layers, num_heads=4, intermediate_size=128,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, seed=2,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed_tokens" not in name:
                param.mul_(scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
