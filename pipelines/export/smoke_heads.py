"""Smoke checks of an exported heads folder (Medusa-1 or BPD heads, seed 000), run before it is published.

The folder is both formats (`models.heads`): polydraft's (`heads.json`, `heads.safetensors`) and vLLM's
`medusa` speculative method's (`config.json`, the same `heads.safetensors`, and for BPD heads
`lm_head.safetensors`). It must:
- attach to the loaded target with polydraft's loader (`models.heads.attach_heads`: shapes checked);
- read back, the way vLLM's medusa model reads a folder (`models.heads.load_vllm_medusa`), as exactly the
  same heads, and for BPD heads with the target's own lm head;
- give, with polydraft's `bpd` and `medusa` decoders at temperature 0, the target's own greedy output;
- when vLLM can run here, generate greedily in vLLM with the folder as the target's `medusa` draft, with the
  target's own greedy output (`pipelines.export.vllm_check`, `method="medusa"`; the caller runs it,
  in a subprocess, before this process loads the target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polydraft.models.placement import input_device
from polydraft.pipelines.export.smoke import Check


@torch.inference_mode()
def heads_checks(
    folder: Path, target: Any, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int]
) -> list[Check]:
    """Every check of an exported heads folder except the real vLLM generation."""
    from polydraft.models.heads import (
        CONFIG_FILE,
        VLLM_CONFIG_FILE,
        VLLM_LM_HEAD_FILE,
        WEIGHTS_FILE,
        attach_heads,
    )

    needed = [CONFIG_FILE, WEIGHTS_FILE, VLLM_CONFIG_FILE]
    missing = [name for name in needed if not (folder / name).is_file()]
    files = Check("files", "fail", f"missing {', '.join(missing)}") if missing else None
    try:
        heads = attach_heads(target, folder)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return [*([files] if files else []), Check("attach", "fail", f"attach_heads failed: {err}")]
    if heads.kind == "bpd" and not (folder / VLLM_LM_HEAD_FILE).is_file():
        missing.append(VLLM_LM_HEAD_FILE)
    present = ", ".join(needed + ([VLLM_LM_HEAD_FILE] if heads.kind == "bpd" else []))
    checks = [
        Check("files", "fail", f"missing {', '.join(missing)}")
        if missing
        else Check("files", "pass", f"{present} present"),
        Check(
            "attach",
            "pass",
            f"attach_heads: {heads.num_heads} {heads.kind} heads of {heads.num_layers} residual layer(s)",
        ),
        vllm_format_check(folder, heads, target),
        greedy_check(heads, target, prompts, max_new_tokens, eos_ids),
    ]
    return checks


def vllm_format_check(folder: Path, heads: Any, target: Any) -> Check:
    """vLLM's reading of the folder gives the heads polydraft attached (and, for BPD, the target's lm head)."""
    from polydraft.models.heads import load_vllm_medusa

    try:
        read, shared = load_vllm_medusa(folder)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return Check("vllm_medusa_format", "fail", f"as vLLM's medusa model reads it: {err}")
    mine = {k: v.float().cpu() for k, v in heads.state_dict().items()}
    theirs = {k: v.float().cpu() for k, v in read.state_dict().items()}
    if read.kind != heads.kind or mine.keys() != theirs.keys():
        return Check("vllm_medusa_format", "fail", f"vLLM would read {read.kind} heads with {sorted(theirs)}")
    differ = sorted(k for k in mine if not torch.equal(mine[k], theirs[k]))
    if differ:
        return Check("vllm_medusa_format", "fail", f"vLLM would read other values for {differ}")
    if heads.kind == "bpd":
        own = target.get_output_embeddings().weight.detach().float().cpu()
        if shared is None or not torch.equal(shared.float(), own.to(shared.dtype).float()):
            return Check("vllm_medusa_format", "fail", "lm_head.safetensors is not the target's lm head")
    return Check(
        "vllm_medusa_format",
        "pass",
        "read as vLLM's medusa model reads it (config.json, every *.safetensors): the same "
        f"{len(mine)} tensors" + (" and the target's lm head" if heads.kind == "bpd" else ""),
    )


def greedy_check(
    heads: Any, target: Any, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int]
) -> Check:
    """polydraft's `bpd` and `medusa` (a chain of every head as the tree) give the target's greedy output."""
    from polydraft.decoding.blockwise import HeadsDraft, blockwise_chain, blockwise_tree
    from polydraft.decoding.engine import autoregressive
    from polydraft.decoding.lattice import CandidateTree
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling

    greedy, target_lm = Sampling(0.0), CachedLM(target, profile=False)
    draft = HeadsDraft(heads, target_lm, profile=False)
    tree = CandidateTree.from_paths([[0], [1], *[[0] * d for d in range(2, heads.num_heads + 1)]])
    generator = torch.Generator(device=input_device(target))
    accepted = 0
    for index, prompt in enumerate(prompts):
        alone = autoregressive(target_lm, prompt, max_new_tokens, greedy, generator, eos_ids).tokens
        chain = blockwise_chain(target_lm, draft, prompt, max_new_tokens, greedy, generator, eos_ids)
        medusa = blockwise_tree(target_lm, draft, prompt, max_new_tokens, greedy, generator, eos_ids, tree)
        for name, got in (("bpd", chain), ("medusa", medusa)):
            if got.tokens != alone:
                return Check(
                    "heads_greedy", "fail", f"prompt {index}: `{name}` output differs from the target's"
                )
        accepted += sum(r.accepted for r in chain.rounds)
    return Check(
        "heads_greedy",
        "pass",
        f"{len(prompts)} prompts x up to {max_new_tokens} new tokens: polydraft's `bpd` (K={heads.num_heads}) "
        f"and `medusa` give the target's own greedy output; bpd accepted {accepted} draft tokens",
    )
