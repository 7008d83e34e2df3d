"""Small Llama-family models and byte-level BPE tokenizers built from scratch (bootstrap targets, tests)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer that, like Llama's, prepends `<s>`, with `chat_template` (e.g.
    `data.prompts.VICUNA_CHAT_TEMPLATE`) when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id(SPECIAL_TOKENS["bos_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def build_llama(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 512,
    num_kv_heads: int | None = None,
    tie_word_embeddings: bool = True,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 3,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with the given shape (fp32, eval mode)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
