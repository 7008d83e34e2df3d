"""Shared fixtures: tiny models and tokenizers built from configs, nothing downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 512-token byte-level BPE trained on the offline corpus, with the Vicuna chat template."""
    from polydraft.data.offline import offline_texts
    from polydraft.data.prompts import VICUNA_CHAT_TEMPLATE
    from polydraft.models.tiny import train_tokenizer

    texts = [row["text"] for row in offline_texts(["de", "fr"], 400, seed=0)]
    return train_tokenizer(texts, vocab_size=512, chat_template=VICUNA_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random 4-layer Llama (hidden 64) saved as a Hugging Face folder with its tokenizer."""
    from polydraft.models.tiny import build_llama

    tok = tiny_tokenizer
    model = build_llama(
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        intermediate_size=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=0,
    )
    folder = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
