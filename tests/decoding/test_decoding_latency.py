"""Forward latencies and the speedup a latency model predicts from them (`decoding.measurement.latency`)."""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.engine import Generation, Round
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.costs import ar_cost, chain_cost, predicted_speedup, tree_cost
from polydraft.decoding.measurement.latency import (
    ChainRounds,
    Latencies,
    chain_round_latencies,
    lm_latencies,
    run_latencies,
    self_speculative_latencies,
)
from polydraft.decoding.tree import TreeShape
from polydraft.models.tiny import build_llama
from tests.decoding_helpers import single_thread_fixture

single_thread = single_thread_fixture()

TARGET = Latencies(chain={1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0}, tree={3: 20.0, 5: 22.0, 7: 25.0})
DRAFTER = Latencies(chain={1: 2.0}, tree={2: 3.0, 4: 5.0})
# a round's first drafter step (after a verification) costs more than the next ones
ROUNDS = ChainRounds(verify={1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0}, draft=[4.0, 2.0, 2.0, 2.0])


def generation(tokens: int, rounds: list[Round]) -> Generation:
    return Generation(tokens=list(range(tokens)), stop="length", rounds=rounds, target_calls=len(rounds))


def test_predicted_speedup_of_a_fixed_k_chain_is_the_closed_form():
    # 3 rounds of K=4 that produced 5 + 2 + 3 tokens: BE = 10 / 3
    gens = [generation(7, [Round(4, 4, 4), Round(4, 4, 1)]), generation(3, [Round(4, 4, 2)])]
    predicted = predicted_speedup(gens, TARGET.chain[1], chain_cost(ROUNDS))
    assert predicted == pytest.approx((10 / 3) * 10.0 / (14.0 + 4.0 + 3 * 2.0))


def test_predicted_speedup_sums_the_cost_of_every_round_and_is_one_for_ar():
    # Thompson sampling drafts a different k each round; k = 0 is a plain target step
    gens = [generation(6, [Round(2, 2, 2), Round(0, 0, 0), Round(3, 3, 1)])]
    costs = (12.0 + 4.0 + 2.0) + 10.0 + (13.0 + 4.0 + 2 * 2.0)
    assert predicted_speedup(gens, 10.0, chain_cost(ROUNDS)) == pytest.approx(6 * 10.0 / costs)
    ar = [generation(5, [Round(0, 0, 0)] * 5)]
    assert predicted_speedup(ar, 10.0, ar_cost(TARGET)) == 1.0
    assert predicted_speedup([generation(0, [])], 10.0, chain_cost(ROUNDS)) is None


def test_the_prediction_charges_each_generation_its_prompt_extra_once():
    # two generations of sd against ar: each pays the method's extra F once, ar pays the target's
    gens = [generation(7, [Round(4, 4, 4), Round(4, 4, 1)]), generation(3, [Round(4, 4, 2)])]
    costs = 3 * (14.0 + 4.0 + 3 * 2.0)
    predicted = predicted_speedup(gens, 10.0, chain_cost(ROUNDS), prefill=9.0, ar_prefill=6.0)
    assert predicted == pytest.approx((2 * 6.0 + 10 * 10.0) / (2 * 9.0 + costs))
    ar = [generation(5, [Round(0, 0, 0)] * 5), generation(2, [Round(0, 0, 0)] * 2)]
    assert predicted_speedup(ar, 10.0, ar_cost(TARGET), prefill=6.0, ar_prefill=6.0) == pytest.approx(1.0)


def test_tree_rounds_cost_the_masked_verification_the_root_call_and_every_level_but_the_last():
    beam = TreeShape.beam(
        2, 2
    )  # levels of 2 nodes: verify 4 nodes + 1, drafter calls on the root and level 1
    cost = tree_cost(TARGET, DRAFTER, beam)
    assert cost(Round(2, 4, 1)) == 22.0 + 2.0 + 3.0
    assert cost(Round(1, 2, 0)) == 20.0 + 2.0  # a depth-1 tree near the end: no level call
    assert cost(Round(0, 0, 0)) == 10.0
    constant = TreeShape.constant([2, 2])  # levels of 2 and 4 nodes
    assert constant.level_sizes(2) == [2, 4] and constant.max_nodes == 6
    assert tree_cost(TARGET, DRAFTER, constant)(Round(2, 6, 2)) == 25.0 + 2.0 + 3.0


@pytest.fixture(scope="module")
def tiny_lm():
    return CachedLM(build_llama(64, 32, 2, 4, 64, seed=1))


def test_lm_latencies_time_each_size_from_the_same_cached_context(tiny_lm, monkeypatch):
    context = torch.arange(3, 15).view(1, -1)
    seen = []
    forward = tiny_lm.forward

    def recording(input_ids, num_logits=1, position_ids=None, attention_mask=None):
        seen.append((tiny_lm.length, input_ids.shape[1], attention_mask is not None))
        return forward(input_ids, num_logits, position_ids, attention_mask)

    monkeypatch.setattr(tiny_lm, "forward", recording)
    latencies = lm_latencies(tiny_lm, context, [1, 3], [2, 4], repeats=2)
    assert sorted(latencies.chain) == [1, 3] and sorted(latencies.tree) == [2, 4]
    assert all(s > 0 for s in [*latencies.chain.values(), *latencies.tree.values()])
    # the context once, then every timed call starts from it (the cache is cropped back each time)
    assert seen[0] == (0, 12, False)
    assert seen[1:] == [(12, 1, False), (12, 3, False), (12, 2, True), (12, 4, True)] * 2
    assert tiny_lm.length == 0
    with pytest.raises(ValueError, match="latency sizes"):
        lm_latencies(tiny_lm, context, [12], [], repeats=1)


def test_run_latencies_cover_every_round_the_decoders_can_make(tiny_lm):
    from polydraft.decoding.eagle3 import Eagle3Drafter
    from polydraft.decoding.eesd import SelfSpeculative
    from polydraft.models.eagle3 import head_for_target
    from polydraft.models.early_exit import from_target

    target = build_llama(64, 32, 4, 4, 64, seed=2)
    eesd = SelfSpeculative(target, from_target(target, 2, 1))
    head = Eagle3Drafter(head_for_target(target, torch.arange(64), [1, 2, 3]), target.get_input_embeddings())
    eagle3 = {"e3": (CachedLM(target, aux_layers=[1, 2, 3]), head)}
    shapes = [TreeShape.constant([2, 2, 1]), TreeShape.beam(3, 3)]
    run = run_latencies(
        CachedLM(target), {"d": tiny_lm}, {"ee": eesd}, eagle3, torch.arange(3, 23).view(1, -1), 5, shapes, 1,
        torch.arange(3, 15).view(1, -1),
    )  # fmt: skip
    assert sorted(run.target.chain) == [1]
    assert sorted(run.target.tree) == list(range(2, 12))  # trees of up to 10 nodes (2 + 4 + 4)
    assert sorted(run.drafters["d"].chain) == [1] and sorted(run.drafters["d"].tree) == [1, 2, 3, 4]
    for name in (
        "d",
        "ee",
        "e3",
    ):  # sd's rounds with the drafter, eesd's with the exit, eagle3's with the head
        assert sorted(run.rounds[name].verify) == list(range(1, 7)) and len(run.rounds[name].draft) == 5
    assert set(run.as_json()) == {"target", "drafters", "rounds", "prefill"}
    # each model's prompt extra, once per generation: sd pays the target's and its drafter's
    assert set(run.prefill) == {"target", "d", "ee", "e3"}
    assert run.method_prefill() == run.prefill["target"]
    assert run.method_prefill("d", standalone=True) == run.prefill["target"] + run.prefill["d"]
    assert run.method_prefill("e3") == run.prefill["e3"]


def record_forward_calls(monkeypatch, **lms: CachedLM) -> list[tuple[str, int, int]]:
    """(name, cached length, new tokens) of every forward call of these models, in order."""
    calls = []
    for name, lm in lms.items():

        def recording(input_ids, num_logits=1, position_ids=None, attention_mask=None, lm=lm, name=name):
            calls.append((name, lm.length, input_ids.shape[1]))
            return type(lm).forward(lm, input_ids, num_logits, position_ids, attention_mask)

        monkeypatch.setattr(lm, "forward", recording)
    return calls


def test_run_latencies_prefill_each_model_once_then_interleave_every_probe_per_repeat(tiny_lm, monkeypatch):
    from polydraft.decoding.eesd import SelfSpeculative
    from polydraft.models.early_exit import from_target

    target = CachedLM(build_llama(64, 32, 3, 4, 64, seed=3))
    eesd = SelfSpeculative(
        build_llama(64, 32, 4, 4, 64, seed=2), from_target(build_llama(64, 32, 4, 4, 64), 2, 1)
    )
    calls = record_forward_calls(monkeypatch, T=target, D=tiny_lm)
    for method in ("draft_step", "verify"):

        def recording_eesd(*args, method=method):
            calls.append(("E", method))
            return getattr(SelfSpeculative, method)(eesd, *args)

        monkeypatch.setattr(eesd, method, recording_eesd)
    run_latencies(target, {"d": tiny_lm}, {"ee": eesd}, {}, torch.arange(3, 15).view(1, -1), 1, [], repeats=2)
    # each model takes the 12-token context once
    assert calls[:4] == [("T", 0, 12), ("D", 0, 12), ("E", "draft_step"), ("E", "verify")]
    one_repeat = [
        # the ar step: an untimed one, then 8 timed ones, each appending to the cache
        *[("T", n, 1) for n in range(12, 21)],
        ("D", 12, 1),  # the drafter's step alone
        ("T", 12, 1), ("D", 12, 1), ("T", 12, 2),  # sd's rounds of 0 and 1 drafts
        ("E", "verify"), ("E", "draft_step"), ("E", "verify"),  # eesd's
    ]  # fmt: skip
    assert calls[4:] == one_repeat * 2
    assert target.length == tiny_lm.length == eesd.length(eesd.shared_slots) == 0


def test_self_speculative_latencies_restore_every_slot_group():
    from polydraft.decoding.eesd import SelfSpeculative
    from polydraft.models.early_exit import from_target

    target = build_llama(64, 32, 4, 4, 64, seed=2)
    model = SelfSpeculative(target, from_target(target, 2, 1))
    lengths = []
    verify = model.verify

    def recording(pending, num_logits):
        lengths.append((model.length(model.shared_slots), model.length(model.deep_slots), num_logits))
        return verify(pending, num_logits)

    model.verify = recording
    rounds = self_speculative_latencies(model, torch.arange(3, 13).view(1, -1), 2, repeats=2)
    # after the context's own verification, a round of k drafts verifies k + 1 positions: k drafts
    # in the shared layers (the last one's shared pass comes with the verification), the deeper
    # layers still at the context
    assert lengths == [(10, 0, 1)] + [(10, 10, 1), (11, 10, 2), (12, 10, 3)] * 2
    assert model.length(model.shared_slots) == 0
    assert sorted(rounds.verify) == [1, 2, 3] and len(rounds.draft) == 2


def test_chain_round_latencies_time_sd_rounds_in_their_order_from_the_same_context(tiny_lm, monkeypatch):
    target = CachedLM(build_llama(64, 32, 3, 4, 64, seed=3))
    calls = record_forward_calls(monkeypatch, T=target, D=tiny_lm)
    rounds = chain_round_latencies(target, tiny_lm, torch.arange(3, 15).view(1, -1), 2, repeats=2)
    # each model's context once, then rounds of k = 0, 1, 2 drafts: the drafter's k one-token steps
    # right before the target's call on k + 1 tokens, both cropped back to the context after it
    assert calls[:2] == [("T", 0, 12), ("D", 0, 12)]
    one_repeat = [("T", 12, 1), ("D", 12, 1), ("T", 12, 2), ("D", 12, 1), ("D", 13, 1), ("T", 12, 3)]
    assert calls[2:] == one_repeat * 2
    assert sorted(rounds.verify) == [1, 2, 3] and len(rounds.draft) == 2
    assert all(s > 0 for s in [*rounds.verify.values(), *rounds.draft])
    assert target.length == 0 and tiny_lm.length == 0
    with pytest.raises(ValueError, match="latency sizes"):
        chain_round_latencies(target, tiny_lm, torch.arange(3, 15).view(1, -1), 11, repeats=1)


def add_to_clock(monkeypatch, lm: CachedLM, seconds: list[float]) -> None:
    """Each forward call of `lm` adds the next of these seconds to its clock (on top of its real few ms)."""
    durations = iter(seconds)
    forward = lm.forward

    def clocked(*args, **kwargs):
        out = forward(*args, **kwargs)
        lm.seconds += next(durations)
        return out

    monkeypatch.setattr(lm, "forward", clocked)


def test_latencies_are_the_median_over_repeats(tiny_lm, monkeypatch):
    # the context's call, then one step per repeat: median 3, mean 4
    add_to_clock(monkeypatch, tiny_lm, [0.5, 1.0, 8.0, 3.0])
    latencies = lm_latencies(tiny_lm, torch.arange(3, 15).view(1, -1), [1], [], repeats=3)
    assert latencies.chain[1] == pytest.approx(3.0, abs=0.01)  # within the real calls' own few ms


def test_a_round_step_costs_its_mean_over_the_rounds_that_take_it(tiny_lm, monkeypatch):
    target = CachedLM(build_llama(64, 32, 3, 4, 64, seed=3))
    # the drafter's calls in order: the context, then step 0 of round k=1, steps 0 and 1 of round k=2
    add_to_clock(monkeypatch, tiny_lm, [0.0, 1.0, 3.0, 5.0])
    rounds = chain_round_latencies(target, tiny_lm, torch.arange(3, 15).view(1, -1), 2, repeats=1)
    assert rounds.draft == pytest.approx([2.0, 5.0], abs=0.01)  # step 0: (1 + 3) / 2; step 1: 5


def test_the_ar_step_is_the_mean_of_consecutive_steps_after_an_untimed_one(monkeypatch):
    # `ar` makes its steps one after the other: the probe's steps follow one of the same model, which
    # does not count, and the step is their mean (the context's call, the untimed step, 8 timed steps)
    target = CachedLM(build_llama(64, 32, 3, 4, 64, seed=3))
    add_to_clock(monkeypatch, target, [0.0, 100.0, *range(1, 9)])
    run = run_latencies(target, {}, {}, {}, torch.arange(3, 15).view(1, -1), 1, [], repeats=1)
    assert run.target.chain[1] == pytest.approx(4.5, abs=0.01)
    assert target.length == 0


def test_tree_verifications_are_timed_right_after_a_drafters_tree_calls(tiny_lm, monkeypatch):
    # as tree_decode makes them: the drafter's root step and a masked call per level, then the target's
    # masked verification; timed on the target alone, a size is faster (its caches still hold it)
    target = CachedLM(build_llama(64, 32, 4, 4, 64, seed=2))
    calls: list[tuple[str, int, bool]] = []
    forward = CachedLM.forward

    def logged(self, input_ids, num_logits=1, position_ids=None, attention_mask=None):
        calls.append(
            ("target" if self is target else "drafter", input_ids.shape[1], attention_mask is not None)
        )
        return forward(self, input_ids, num_logits, position_ids, attention_mask)

    monkeypatch.setattr(CachedLM, "forward", logged)
    shape = TreeShape.beam(2, 3)  # levels of 2 nodes: the drafter calls 2 and 2 before a verification
    run_latencies(target, {"d": tiny_lm}, {}, {}, torch.arange(3, 23).view(1, -1), 1, [shape], 2)
    verifications = [i for i, (who, _, masked) in enumerate(calls) if who == "target" and masked]
    assert len(verifications) == 2 * shape.max_nodes  # sizes 2..max_nodes + 1, in each of 2 repeats
    for i in verifications:
        assert calls[i - 3 : i] == [("drafter", 1, False), ("drafter", 2, True), ("drafter", 2, True)]
