"""Mutation check: named wrong variants planted into the decoders must each be rejected by the lossless tests.

Each variant edits one line of one function's source (the line must be found exactly once, so a
refactor that moves it makes this test fail instead of pass), compiles it in the function's own
module, and patches every module that imported the function. Then the checks that should catch it
run (all must fail): the exact sampler checks (tests/exact_sampling.py), a full-decoder
configuration of the distribution grid (tests/decoder_grid.py) and greedy decoding against `ar` on a
tiny Llama (the check of tests/decoding/test_decoding_lossless.py and tests/decoding/test_decoding_eesd.py). A variant
that no check rejects would be a gap in the suite; the unmutated code passes the same checks in those
modules.

Not here, because they are not wrong: a drafter cache not cropped or drafter position ids off by one
change the drafter's distribution p, and the drafts are still verified against that same p, so the
output stays the target's (only speed suffers); a sibling order or count that depends on the beam's
values rather than its tokens (seed 002 Thm 3.2). A residual that is not renormalised is harmless
where it is only sampled from (`torch.multinomial` normalises) and wrong where recursive rejection
compares against it. Likewise for the blockwise decoders: heads that read the hidden state of the
wrong position, or a rescoring drafter whose cache keeps the wrong nodes, draft from other rows, and the
drafts are verified against those same rows.

The blockwise variants are checked by the exact laws of the real decoders (tests/exact_blockwise.py,
`exact:` and `tree-rescored:`), the grid and greedy decoding on the table models (`greedy-table:`).
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch

import polydraft.decoding.blockwise
import polydraft.decoding.chain
import polydraft.decoding.eagle3
import polydraft.decoding.eesd
import polydraft.decoding.lattice
import polydraft.decoding.rsd
import polydraft.decoding.sampling
import polydraft.decoding.sd
import polydraft.decoding.tree
from polydraft.decoding.control import FixedK
from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
from polydraft.decoding.eesd import SelfSpeculative, self_speculative
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from polydraft.models.early_exit import from_target
from tests import decoder_grid
from tests.decoding_helpers import single_thread_fixture, tiny_pair
from tests.eagle3_setup import fit_eagle3
from tests.exact_blockwise import check_blockwise, check_rescored_tree
from tests.exact_sampling import check_chain, check_rejection, check_tree

single_thread = single_thread_fixture()


def plant(monkeypatch: pytest.MonkeyPatch, module, name: str, old: str, new: str) -> None:
    """Replace `old` (found exactly once) by `new` in module.name's source and patch it wherever imported."""
    original = getattr(module, name)
    source = textwrap.dedent(inspect.getsource(original))
    assert source.count(old) == 1, f"{module.__name__}.{name}: {old!r} found {source.count(old)} times"
    namespace: dict = {}
    exec(
        compile(source.replace(old, new), inspect.getsourcefile(original), "exec"), module.__dict__, namespace
    )
    for loaded in list(sys.modules.values()):
        for attribute, value in list(getattr(loaded, "__dict__", {}).items()):
            if value is original:
                monkeypatch.setattr(loaded, attribute, namespace[name])


GREEDY_PROMPTS = [torch.arange(3, 9), torch.tensor([5, 17, 2, 40, 33, 8, 71, 12, 9])]


@pytest.fixture(scope="module")
def models():
    target, drafters = tiny_pair(96)
    return target, drafters["noisy"]


def check_greedy(models, decoder: str) -> None:
    """Greedy output equals `ar`'s for two prompts, 12 tokens (the decoders' T = 0 losslessness)."""
    target_model, drafter_model = models
    target, drafter = CachedLM(target_model), CachedLM(drafter_model)
    greedy, generator = Sampling(), torch.Generator()
    for prompt in GREEDY_PROMPTS:
        expected = autoregressive(target, prompt, 12, greedy, generator, set()).tokens
        if decoder == "sd":
            got = speculative(target, drafter, prompt, 12, greedy, FixedK(3), generator, set())
        elif decoder == "eesd":
            model = SelfSpeculative(target_model, from_target(target_model, 2, 1))
            got = self_speculative(model, prompt, 12, greedy, FixedK(3), generator, set())
        elif decoder == "eagle3":  # a head fitted to the first prompt's output: drafts partly accepted
            sequence = torch.cat(
                [
                    GREEDY_PROMPTS[0],
                    torch.tensor(
                        autoregressive(target, GREEDY_PROMPTS[0], 12, greedy, generator, set()).tokens
                    ),
                ]
            )
            head = Eagle3Drafter(
                fit_eagle3(target_model, [1, 2, 3], [sequence], steps=30), target_model.get_input_embeddings()
            )
            featured = CachedLM(target_model, aux_layers=[1, 2, 3])
            got = eagle3_decode(featured, head, prompt, 12, greedy, FixedK(3), generator, set())
        else:
            got = recursive_speculative(
                target, drafter, prompt, 12, greedy, TreeShape.beam(3, 3), generator, set()
            )
        assert got.tokens == expected, (decoder, prompt.tolist())


SAMPLING = polydraft.decoding.sampling
VARIANTS: dict[str, tuple[object, str, str, str, list[str]]] = {
    "residual not renormalised": (
        SAMPLING, "residual", "diff / total.clamp(min=torch.finfo(diff.dtype).tiny)", "diff",
        ["rejection:3:plain", "tree:rsd_c-332:top-k"],
    ),
    "rejected token not removed from p": (
        SAMPLING, "recursive_rejection", "p_cur[x] = 0.0", "pass",
        ["rejection:2:plain", "rejection:stop:top-p", "tree:rsd_s-w3:mixed"],
    ),
    "bonus token from the last draft's row": (
        SAMPLING, "verify_chain", "else target_probs[k]", "else target_probs[k - 1]",
        ["chain:2:plain", "chain:4:top-k"],
    ),
    "resampling from q instead of (q - p)+ (chain)": (
        SAMPLING, "verify_chain", "residual(target_probs[accepted], draft_probs[accepted])",
        "target_probs[accepted]", ["chain:1:plain", "chain:3:top-p"],
    ),
    "resampling from q instead of (q - p)+ (tree)": (
        SAMPLING, "recursive_rejection", "q_cur = residual(q_cur, p_cur)", "q_cur = q_cur",
        ["rejection:1:plain", "tree:rsd_c-3111:top-k"],
    ),
    "acceptance ratio p/q instead of q/p": (
        SAMPLING, "verify_chain", "if u * p >= q:", "if u * q >= p:", ["chain:1:top-k", "chain:3:mixed"],
    ),
    "tree verified against the root's draft row": (
        polydraft.decoding.tree, "verify_tree", "p = draft_probs[node + 1] if kids else q", "p = draft_probs[0] if kids else q",
        ["tree:rsd_c-332:top-k"],
    ),
    "chain draft probabilities taken before top-k/top-p (sd, eesd)": (
        polydraft.decoding.chain, "draft_tokens", "rows.append(p)",
        "rows.append(probabilities(logits, Sampling(sampling.temperature)))",
        ["grid:sd-fixed:T1-topk2", "grid:eesd-beta_ts:T0.7-topp0.8"],
    ),
    "greedy chain accepts the first draft whether or not the target agrees": (
        polydraft.decoding.chain, "accept_greedy", "while accepted < k and draft[accepted] == pred[accepted]:",
        "while accepted < k and (accepted == 0 or draft[accepted - 1] == pred[accepted - 1]):",
        ["greedy:sd", "greedy:eesd", "greedy-table:bpd"],
    ),
    "tree draft probabilities taken before top-k/top-p": (
        polydraft.decoding.tree, "_log_dist", "return probs.log(), probs",
        "return probs.log(), probabilities(logits, Sampling(sampling.temperature))",
        ["grid:rsd_s:T1-topk2"],
    ),
    "wrong tree-mask row (a child copies the row of the node before its parent)": (
        polydraft.decoding.tree, "ancestor_mask", "lineage[parent] if parent >= 0",
        "lineage[parent - 1] if parent >= 1", ["greedy:rsd", "grid:rsd_s:T1-topp0.8"],
    ),
    "wrong tree position ids (depth + n)": (
        polydraft.decoding.tree, "tree_inputs", "(length - 1) + tree.depths[node]", "length + tree.depths[node]",
        ["greedy:rsd", "grid:rsd_c:T0.7-topk2"],
    ),
    "sd target cache not cropped after a rejection": (
        polydraft.decoding.sd, "DrafterProposer", "self.target.crop(n + accepted)", "self.target.crop(n + drafts)",
        ["greedy:sd", "grid:sd-cali_ts:T0.7-topp0.8"],
    ),
    "eagle3 target cache not cropped after a rejection": (
        polydraft.decoding.eagle3, "Eagle3Proposer", "self.target.crop(n + accepted)",
        "self.target.crop(n + drafts)", ["greedy:eagle3", "grid:eagle3-fixed:T1-topk2"],
    ),
    "eesd cache not cropped after a rejection": (
        polydraft.decoding.eesd, "SelfProposer", "self.model.crop(n + accepted, exit_length)",
        "self.model.crop(n + drafts, exit_length)",
        ["greedy:eesd", "grid:eesd-fixed:T1-topk2"],
    ),
    # the tree round rsd_c / rsd_s and medusa share (`decoding.tree.tree_decode`)
    # (not greedy:rsd: on the tiny Llama every greedy path it accepts follows the first children, which the
    # target reads first, so a crop keeps the right positions there)
    "tree cache keeps the first nodes, not the accepted path": (
        polydraft.decoding.tree, "tree_decode", "target.keep(n, [slot[node] for node in path])",
        "target.crop(n + len(path))",
        ["grid:rsd_s:T0.7-topk2", "greedy-table:medusa", "grid:medusa:T0.7-topp0.8"],
    ),
    "tree cache keeps the accepted nodes' places in node order, not in the target's input order": (
        polydraft.decoding.tree, "tree_decode", "target.keep(n, [slot[node] for node in path])",
        "target.keep(n, path)", ["greedy:rsd", "grid:rsd_s:T0.7-topk2"],
    ),
    "target rows read in input order, not put back in node order": (
        polydraft.decoding.tree, "tree_decode",
        "rows = [0] + [1 + index for index in slot]",
        "rows = list(range(len(tree) + 1))", ["greedy:rsd", "grid:rsd_s:T0.7-topk2"],
    ),
    "Gumbel-top-k children in increasing order": (
        SAMPLING, "gumbel_topk", 'return tokens, values > float("-inf")',
        'return tokens.flip(-1), (values > float("-inf")).flip(-1)', ["grid:rsd_c:T1-topp0.8"],
    ),
    # the blockwise decoders (seed 000) and the rescored lattice
    "bpd+rescore verified against the heads' rows, not the rescored rows its path was drawn from": (
        polydraft.decoding.blockwise, "HeadsProposer",
        "draft_probs = dists[torch.tensor([0] + [node + 1 for node in path[:-1]], device=dists.device)]",
        "draft_probs = head_logp[:k].exp()", ["exact:bpd+rescore:T1-topp0.8", "grid:bpd+rescore:T1-topk2"],
    ),
    "medusa children verified against the row of the head before theirs": (
        polydraft.decoding.lattice, "candidate_tree", "rows = torch.tensor([0, *depths], device=device)",
        "rows = torch.tensor([0, *[d - 1 for d in depths]], device=device)",
        ["exact:medusa:T0.7-topk2", "grid:medusa:T1-topk2"],
    ),
    "wrong verification mask for the medusa tree (a node does not see its ancestors)": (
        polydraft.decoding.tree, "tree_inputs", "ancestor_mask(tree.parents, order, device, order)",
        "ancestor_mask([-1] * len(tree.parents), order, device, order)",
        ["greedy-table:medusa", "exact:medusa:T1-topp0.8"],
    ),
    "rescored lattice rows not renormalised over the top k": (
        polydraft.decoding.lattice, "rescorer", "out[:, tokens] = torch.log_softmax(mixed, dim=-1)",
        "out[:, tokens] = mixed", ["exact:bpd+rescore:T0.7-topk2", "tree-rescored:top-k"],
    ),
}  # fmt: skip
"""name -> (module, function, old line part, new line part, the checks that must reject it)."""


def run_check(check: str, monkeypatch: pytest.MonkeyPatch, models) -> None:
    kind, _, spec = check.partition(":")
    if kind == "grid":
        decoder_grid.check(spec)
        return
    if kind == "greedy":
        check_greedy(models, spec)
        return
    if kind == "greedy-table":
        decoder_grid.check_greedy(spec)
        return
    if kind == "exact":
        method, _, sampling = spec.partition(":")
        check_blockwise(monkeypatch, method, sampling)
        return
    if kind == "tree-rescored":
        check_rescored_tree(monkeypatch, spec)
        return
    first, _, pair = spec.partition(":")
    checks: dict[str, Callable] = {"chain": check_chain, "rejection": check_rejection, "tree": check_tree}
    checks[kind](monkeypatch, int(first) if first.isdigit() else first, pair)


def test_there_are_enough_variants():
    assert len(VARIANTS) >= 8


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lossless_checks_reject_the_variant(monkeypatch, models, variant):
    module, name, old, new, checks = VARIANTS[variant]
    plant(monkeypatch, module, name, old, new)
    for check in checks:
        # an assertion, or the decoder breaking on its own corrupted state (a shape or index error)
        with pytest.raises((AssertionError, IndexError, RuntimeError, ValueError)):
            run_check(check, monkeypatch, models)
