"""The real CPU build of vLLM runs an exported heads folder as the target's `medusa` draft.

Medusa heads, and BPD heads (vLLM's `original_lm_head`: one shared copy of the target's lm head), fitted to the demo target's own greedy continuations (so that drafts are accepted, partly)
are saved in polydraft's format plus vLLM's medusa config (`models.heads.add_vllm_medusa`), the way the
heads stage writes them and the export stage ships them. vLLM (in a subprocess, `pipelines.export.vllm_check`) then
generates greedily with the target alone and with the folder as `speculative_config={"method": "medusa",
...}`: the outputs must be identical, and vLLM's medusa proposer (each head's argmax, a chain) must accept
exactly the draft tokens polydraft's `bpd` decoder accepts on the same prompts, position by position.
That equality is what shows vLLM reads the heads as polydraft trained them: same tensors, same head order,
same offset (head i predicts token t+2+i from the hidden state at t).
"""

from __future__ import annotations

import pytest
import torch

from tests.heads_setup import fit_heads
from tests.vllm_setup import counted_like_vllm, demo_prompts, demo_target, greedy_sequences, require_vllm

NUM_HEADS = 3
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["medusa", "bpd"])
def heads_folder(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polydraft.models.heads import add_vllm_medusa, save_heads

    target = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    prompts = demo_prompts(AutoTokenizer.from_pretrained(demo_target()))
    sequences = greedy_sequences(target, prompts[:2], NEW_TOKENS)  # the others' drafts are mostly rejected
    heads = fit_heads(target, "medusa", NUM_HEADS, sequences, steps=30, lr=1e-2)
    folder = save_heads(
        heads, tmp_path_factory.mktemp("vllm_heads") / "heads", {"path": "t", "revision": None}
    )
    add_vllm_medusa(folder, target.get_output_embeddings())
    return target, folder, prompts


def polydraft_bpd(target, folder, prompts, eos_id: int) -> tuple[list[list[int]], list[int]]:
    """polydraft's `bpd` at temperature 0, counted the way vLLM counts (`tests.vllm_setup.counted_like_vllm`)."""
    from polydraft.decoding.blockwise import HeadsDraft, blockwise_chain
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling
    from polydraft.models.heads import attach_heads

    target_lm = CachedLM(target, profile=False)
    draft = HeadsDraft(attach_heads(target, folder), target_lm, profile=False)
    new = NEW_TOKENS + NUM_HEADS + 1
    generations = [
        blockwise_chain(target_lm, draft, torch.tensor(ids), new, Sampling(), torch.Generator(), set())
        for ids in prompts
    ]
    return counted_like_vllm(generations, eos_id, NEW_TOKENS, NUM_HEADS)


def test_real_vllm_runs_the_heads_as_its_medusa_draft(heads_folder):
    from polydraft.pipelines.export.vllm_check import VllmDraft, vllm_generations

    require_vllm()
    target, folder, prompts = heads_folder
    spec = {"path": str(demo_target()), "revision": None, "trust_remote_code": False}
    (result,) = vllm_generations(spec, [VllmDraft(str(folder), "medusa", NUM_HEADS, prompts)], NEW_TOKENS, [])
    assert "error" not in result, result["error"]
    outputs, per_position = polydraft_bpd(target, folder, prompts, target.generation_config.eos_token_id)
    assert result["alone"] == outputs  # vLLM's greedy target and polydraft's agree, token for token
    assert result["drafted"] == result["alone"]
    # drafts were accepted at every position, and rejected (so that the counts say something)
    assert min(per_position) > 0 and result["accepted"] < result["drafted_tokens"], (result, per_position)
    assert result["accepted_per_position"] == per_position, (result, per_position)
