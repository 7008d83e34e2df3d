"""The real CPU build of vLLM runs exported draft folders as the demo target's speculative draft: Medusa
heads and BPD heads as its `medusa` draft, an EAGLE-3 head as its `eagle3` draft.

Each folder is fitted to the demo target's own greedy continuations of two prompts (so that drafts are
accepted, partly) and saved the way its stage writes it: heads in polydraft's format plus vLLM's medusa
config (`models.heads.add_vllm_medusa`; BPD heads are vLLM's `original_lm_head`, one shared copy of the
target's lm head), the head in the speculators format (`models.eagle3`) on the default feature layers
(2, 12, 21) with a draft vocabulary of 512 of the 2048 tokens (so that vLLM must map draft ids through
`d2t`). vLLM then generates greedily with the target alone and with each folder, all three in one
subprocess as the export checks its folders (`pipelines.export.vllm_check`): the outputs must be
identical, drafts accepted, and vLLM's proposer must accept exactly the draft tokens polydraft's own
decoder (`bpd` for heads, `eagle3` for the head) accepts on the same prompts, position by position. That
equality is what shows vLLM reads a folder as polydraft trained it: same tensors, head order and offset
(head i predicts token t+2+i from the hidden state at t); for the EAGLE-3 head the same feature layers in
the same order, norms, positions, vocabulary map and weights. The export's own check
(`vllm_check.check_of`) passes on the same generations.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.eagle3_setup import fit_eagle3
from tests.heads_setup import fit_heads
from tests.vllm_setup import counted_like_vllm, demo_prompts, demo_target, greedy_sequences, require_vllm

NUM_HEADS = 3
K = 3
NEW_TOKENS = 24
LAYERS = [2, 12, 21]
HEAD_KINDS = ("medusa", "bpd")


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_target())
    return target, tokenizer, demo_prompts(tokenizer)


def heads_folder(target, kind: str, prompts, root):
    from polydraft.models.heads import add_vllm_medusa, save_heads

    sequences = greedy_sequences(target, prompts[:2], NEW_TOKENS)  # the others' drafts are mostly rejected
    heads = fit_heads(target, kind, NUM_HEADS, sequences, steps=30, lr=1e-2)
    folder = save_heads(heads, root / kind, {"path": "t", "revision": None})
    return add_vllm_medusa(folder, target.get_output_embeddings())


def eagle3_folder(target, tokenizer, prompts, root):
    from polydraft.models.draft_vocab import always_kept, draft_vocabulary
    from polydraft.models.eagle3 import save_eagle3

    # the others' drafts are mostly rejected
    sequences = greedy_sequences(target, prompts[:2], NEW_TOKENS + K + 1)
    counts = Counter(token for s in sequences for token in s.tolist())
    draft_ids = torch.tensor(draft_vocabulary(counts, 512, always_kept(tokenizer), len(tokenizer)))
    head = fit_eagle3(target, LAYERS, sequences, steps=60, draft_ids=draft_ids)
    folder = root / "eagle3"
    save_eagle3(head, folder, verifier=str(demo_target()), verifier_architectures=["LlamaForCausalLM"],
                speculative_tokens=K, info={"pair": "de-en", "aux_layers": LAYERS})  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def in_vllm(demo, tmp_path_factory):
    """kind -> (its folder, its VllmDraft, vLLM's generations with it), every folder in one vLLM subprocess."""
    from polydraft.pipelines.export.vllm_check import VllmDraft, vllm_generations

    require_vllm()
    target, tokenizer, prompts = demo
    root = tmp_path_factory.mktemp("vllm_drafts")
    folders = {kind: heads_folder(target, kind, prompts, root) for kind in HEAD_KINDS}
    folders["eagle3"] = eagle3_folder(target, tokenizer, prompts, root)
    drafts = {kind: VllmDraft(str(folders[kind]), "medusa", NUM_HEADS, prompts) for kind in HEAD_KINDS}
    drafts["eagle3"] = VllmDraft(str(folders["eagle3"]), "eagle3", K, prompts)
    spec = {"path": str(demo_target()), "revision": None, "trust_remote_code": False}
    results = vllm_generations(spec, list(drafts.values()), NEW_TOKENS, [])
    return {kind: (folders[kind], drafts[kind], result) for kind, result in zip(drafts, results, strict=True)}


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


def assert_like_polydraft(result, outputs, per_position) -> None:
    assert "error" not in result, result["error"]
    assert result["alone"] == outputs  # vLLM's greedy target and polydraft's agree, token for token
    assert result["drafted"] == result["alone"]
    # drafts were accepted at every position, and rejected (so that the counts say something)
    assert min(per_position) > 0 and result["accepted"] < result["drafted_tokens"], (result, per_position)
    assert result["accepted_per_position"] == per_position, (result, per_position)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_real_vllm_runs_the_heads_as_its_medusa_draft(kind, demo, in_vllm):
    from polydraft.models.heads import read_heads_config

    target, _, prompts = demo
    folder, _, result = in_vllm[kind]
    assert read_heads_config(folder)["kind"] == kind  # the folder holds heads of the kind this case names
    outputs, per_position = polydraft_bpd(target, folder, prompts, target.generation_config.eos_token_id)
    assert_like_polydraft(result, outputs, per_position)


def test_real_vllm_runs_the_head_as_its_eagle3_draft(demo, in_vllm):
    from polydraft.pipelines.export.vllm_check import check_of

    target, _, prompts = demo
    folder, draft, result = in_vllm["eagle3"]
    outputs, per_position = polydraft_eagle3(target, folder, prompts, target.generation_config.eos_token_id)
    assert_like_polydraft(result, outputs, per_position)
    # the export's check of the same generations: identical output and drafts accepted
    check = check_of(result, draft)
    assert check.status == "pass", check.detail
    assert f"{result['accepted']} of {result['drafted_tokens']} draft tokens accepted" in check.detail
    # a head whose drafts vLLM all rejected fails it
    rejected = check_of({**result, "accepted": 0}, draft)
    assert rejected.status == "fail" and "accepted none of" in rejected.detail
