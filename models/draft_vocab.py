"""The draft vocabulary of an EAGLE-3 head: the target tokens one language's answers use most, plus the
tokens no text can do without.

A head predicts over a subset of the target's vocabulary (the lm head is the largest matrix of a head on a
128k-vocabulary target). Which subset decides which languages it can draft: a vocabulary picked from
English answers leaves most German or Japanese tokens out, and every round that needs one is lost. So each
language pair gets its own, from that pair's self-distilled answers. Always kept, whatever their counts:
the special tokens (EOS ends every answer) and the byte tokens, without which a character the counted
answers never used could not be drafted at all (SentencePiece's byte fallback `<0x00>`..`<0xFF>`, or the
256 one-byte symbols of a byte-level BPE).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that spell one byte: `<0xHH>` (byte fallback) and, for a byte-level BPE, the
    vocabulary entries of its 256 one-byte symbols."""
    vocab = tokenizer.get_vocab()
    ids = {i for token, i in vocab.items() if BYTE_FALLBACK.fullmatch(token)}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and '"ByteLevel"' in backend.to_str():
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        ids |= {vocab[symbol] for symbol in bytes_to_unicode().values() if symbol in vocab}
    return sorted(ids)


def always_kept(tokenizer: Any) -> list[int]:
    """The special tokens and the byte tokens (`byte_token_ids`)."""
    return sorted(set(tokenizer.all_special_ids) | set(byte_token_ids(tokenizer)))


def count_tokens(sequences: Iterable[list[int]]) -> Counter[int]:
    """How often each token id occurs in `sequences`."""
    counts: Counter[int] = Counter()
    for ids in sequences:
        counts.update(ids)
    return counts


def draft_vocabulary(counts: Counter[int], size: int, keep: Iterable[int], vocab_size: int) -> list[int]:
    """The `size` target ids of a draft vocabulary, sorted: every id of `keep`, then the most frequent of
    `counts` (ties: the lower id), then, should the counts run out, the lowest remaining ids. ValueError
    when `keep` alone is larger than `size`."""
    kept = {i for i in keep if 0 <= i < vocab_size}
    if size >= vocab_size:
        return list(range(vocab_size))
    if len(kept) > size:
        raise ValueError(
            f"draft_vocab_size {size} cannot hold the {len(kept)} special and byte tokens every draft "
            f"vocabulary keeps: raise it above {len(kept)}"
        )
    chosen = set(kept)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) == size:
            break
        if 0 <= token < vocab_size:
            chosen.add(token)
    filler = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return sorted(chosen)


def coverage(counts: Counter[int], ids: Iterable[int]) -> float | None:
    """The share of the counted tokens that lie inside `ids` (None when nothing was counted)."""
    total = sum(counts.values())
    if not total:
        return None
    inside = set(ids)
    return sum(n for token, n in counts.items() if token in inside) / total
