"""The full target's greedy tokens on a fixed set of sequences, computed one layer at a time.

The early-exit trainer reports top-1 agreement with the full target on held-out rows, but loading a 13B
or 70B target beside every training process would undo what partial loading saves. Instead the target
is streamed once: each layer is read from the checkpoint, applied to the hidden states of all the
sequences, and released (back to the meta device) before the next one is read. Peak memory is one
layer plus the sequences' hidden states.
"""

from __future__ import annotations

import torch

from polydraft.models.decoder_layers import attention_masks, rotary_embeddings, run_layers, target_layer_types
from polydraft.models.partial_load import decoder_parts, materialise, meta_causal_lm, open_checkpoint


@torch.no_grad()
def streamed_greedy_tokens(
    target_path: str,
    sequences: list[torch.Tensor],
    *,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> list[torch.Tensor]:
    """For each (batch, length) tensor of token ids, the target's argmax token at every position.

    Sequences are right-padded batches: padding sits after the real tokens, so causal attention leaves
    the real positions' predictions untouched. Results are on the CPU.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path, revision=revision, trust_remote_code=trust_remote_code)
    reader = open_checkpoint(target_path, revision)
    skeleton = meta_causal_lm(config, dtype, attn_implementation, trust_remote_code)
    parts = decoder_parts(skeleton)
    names = parts.names
    types = target_layer_types(skeleton.config)
    slots = list(range(len(types)))
    materialise(
        [(parts.embed_tokens, names["embed_tokens"]), (parts.rotary_emb, names["rotary_emb"])],
        skeleton,
        reader,
        device,
    )
    hidden = [parts.embed_tokens(ids.to(device)) for ids in sequences]
    positions = [torch.arange(h.shape[1], device=device).unsqueeze(0) for h in hidden]
    rope = [rotary_embeddings(parts.rotary_emb, h, p, types) for h, p in zip(hidden, positions, strict=True)]
    masks = [
        attention_masks(skeleton.config, h, None, None, p, slots, types)
        for h, p in zip(hidden, positions, strict=True)
    ]
    parts.embed_tokens.to("meta")
    for index, layer in enumerate(parts.layers):
        materialise([(layer, f"{names['layers']}.{index}")], skeleton, reader, device)
        hidden = [
            run_layers([layer], h, r, m, None, p, [types[index]])
            for h, r, m, p in zip(hidden, rope, masks, positions, strict=True)
        ]
        layer.to("meta")  # release this layer's storage before reading the next
    materialise([(parts.norm, names["norm"]), (parts.lm_head, names["lm_head"])], skeleton, reader, device)
    return [parts.lm_head(parts.norm(h)).argmax(-1).cpu() for h in hidden]
