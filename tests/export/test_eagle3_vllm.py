"""The real CPU build of vLLM runs an EAGLE-3 head polydraft trained and saved as its `eagle3` draft.

A head on the demo target's default feature layers (2, 12, 21), with a draft vocabulary of 512 of its 2048
tokens (so that vLLM must map draft ids through `d2t`), is fitted by the trainer's own loss to the demo
target's greedy continuations of two prompts and saved in the speculators format (`models.eagle3`). vLLM
(in a subprocess, `pipelines.export.vllm_check`) then generates greedily with the target alone and with the
folder as `speculative_config={"method": "eagle3", ...}`: the outputs must be identical, drafts accepted,
and vLLM's proposer must accept exactly the draft tokens polydraft's `eagle3` decoder accepts on the same
prompts, position by position. That equality is what shows vLLM reads the head as polydraft trained it:
the same feature layers in the same order, norms, positions, vocabulary map and weights. The export's own
check (`vllm_check.check_of` with `method="eagle3"`) passes on the same generations.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.eagle3_setup import fit_eagle3
from tests.vllm_setup import counted_like_vllm, demo_prompts, demo_target, greedy_sequences, require_vllm

K = 3
NEW_TOKENS = 24
LAYERS = [2, 12, 21]


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polydraft.models.draft_vocab import always_kept, draft_vocabulary
    from polydraft.models.eagle3 import save_eagle3

    target = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_target())
    prompts = demo_prompts(tokenizer)
    # the other prompts' drafts are mostly rejected
    sequences = greedy_sequences(target, prompts[:2], NEW_TOKENS + K + 1)
    counts = Counter(token for s in sequences for token in s.tolist())
    draft_ids = torch.tensor(draft_vocabulary(counts, 512, always_kept(tokenizer), len(tokenizer)))
    head = fit_eagle3(target, LAYERS, sequences, steps=60, draft_ids=draft_ids)
    folder = tmp_path_factory.mktemp("vllm_eagle3") / "head"
    save_eagle3(head, folder, verifier=str(demo_target()), verifier_architectures=["LlamaForCausalLM"],
                speculative_tokens=K, info={"pair": "de-en", "aux_layers": LAYERS})  # fmt: skip
    return target, folder, prompts


def polydraft_eagle3(target, folder, prompts, eos_id: int) -> tuple[list[list[int]], list[int]]:
    """polydraft's `eagle3` at temperature 0, counted the way vLLM counts (`tests.vllm_setup.counted_like_vllm`)."""
    from polydraft.decoding.control import FixedK
    from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling
    from polydraft.models.eagle3 import load_eagle3

    head = load_eagle3(folder)
    featured = CachedLM(target, profile=False, aux_layers=head.aux_layers)
    drafter = Eagle3Drafter(head, target.get_input_embeddings(), profile=False)
    new = NEW_TOKENS + K + 1
    generations = [
        eagle3_decode(
            featured, drafter, torch.tensor(ids), new, Sampling(), FixedK(K), torch.Generator(), set()
        )
        for ids in prompts
    ]
    return counted_like_vllm(generations, eos_id, NEW_TOKENS, K)


def test_real_vllm_runs_the_head_as_its_eagle3_draft(head_folder):
    from polydraft.pipelines.export.vllm_check import VllmDraft, check_of, vllm_generations

    require_vllm()
    target, folder, prompts = head_folder
    spec = {"path": str(demo_target()), "revision": None, "trust_remote_code": False}
    draft = VllmDraft(str(folder), "eagle3", K, prompts)
    (result,) = vllm_generations(spec, [draft], NEW_TOKENS, [])
    assert "error" not in result, result["error"]
    outputs, per_position = polydraft_eagle3(target, folder, prompts, target.generation_config.eos_token_id)
    assert result["alone"] == outputs  # vLLM's greedy target and polydraft's agree, token for token
    assert result["drafted"] == result["alone"]
    # drafts were accepted at every position, and rejected (so that the counts say something)
    assert min(per_position) > 0 and result["accepted"] < result["drafted_tokens"], (result, per_position)
    assert result["accepted_per_position"] == per_position, (result, per_position)
    # the export's check of the same generations: identical output and drafts accepted
    check = check_of(result, draft)
    assert check.status == "pass", check.detail
    assert f"{result['accepted']} of {result['drafted_tokens']} draft tokens accepted" in check.detail
    # a head whose drafts vLLM all rejected fails it
    rejected = check_of({**result, "accepted": 0}, draft)
    assert rejected.status == "fail" and "accepted none of" in rejected.detail
