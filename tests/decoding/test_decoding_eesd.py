"""`eesd`: lossless self-speculation with the early-exit drafter on ONE cache shared with the target."""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.eesd import SelfSpeculative, self_speculative
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from polydraft.models.early_exit import from_target
from tests.decoding_helpers import (
    single_thread_fixture,
    tiny_pair,
)

single_thread = single_thread_fixture()
VOCAB = 96
GREEDY = Sampling()


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_pair(VOCAB)
    return model


CONTROLS = {
    "k1": lambda: FixedK(1),
    "k4": lambda: FixedK(4),
    "beta-ts": lambda: BetaTS(1.0, 1.0, 6, 0),
    "cali-ts": lambda: CaliTS(0.2, 0.3, 0.5, lambda i, t, d: 0.8, 6, 0),
}


@pytest.mark.parametrize(("shared", "exits"), [(1, 1), (2, 1), (2, 0), (3, 2)])
def test_greedy_output_is_ar_output(target, shared, exits):
    """Exit heads of 0-2 layers after 1-3 shared layers, every control, EOS and length limits."""
    model = SelfSpeculative(target, from_target(target, shared, exits))
    reference_lm = CachedLM(target)
    prompts = torch.Generator().manual_seed(shared * 10 + exits)
    for length, max_new in [(1, 1), (4, 2), (9, 14), (15, 7)]:
        prompt = torch.randint(0, VOCAB, (length,), generator=prompts)
        reference = autoregressive(reference_lm, prompt, max_new, GREEDY, torch.Generator(), set())
        eos = {reference.tokens[max_new // 2]}
        stopped = autoregressive(reference_lm, prompt, max_new, GREEDY, torch.Generator(), eos)
        for name, make in CONTROLS.items():
            for expected, eos_ids in ((reference, set()), (stopped, eos)):
                got = self_speculative(model, prompt, max_new, GREEDY, make(), torch.Generator(), eos_ids)
                assert got.tokens == expected.tokens, (name, length, max_new)
                assert got.stop == expected.stop and got.target_calls == len(got.rounds)


def test_shared_layers_run_once_per_position(target):
    """The first N layers' cache serves drafting and verification: every position goes through layer 0
    exactly as often as through the last layer (no recomputation), and rejected drafts are cropped
    from every slot so that the cache ends holding exactly the output."""
    drafter = from_target(target, 2, 1)
    model = SelfSpeculative(target, drafter)
    seen = {"first": 0, "last": 0, "exit": 0}

    def counter(name):
        def hook(module, args, kwargs, output):
            seen[name] += args[0].shape[1] if args else kwargs["hidden_states"].shape[1]

        return hook

    handles = [
        target.model.layers[0].register_forward_hook(counter("first"), with_kwargs=True),
        target.model.layers[-1].register_forward_hook(counter("last"), with_kwargs=True),
        drafter.exit.layers[0].register_forward_hook(counter("exit"), with_kwargs=True),
    ]
    try:
        prompt = torch.arange(10, 22)
        gen = self_speculative(model, prompt, 30, GREEDY, FixedK(4), torch.Generator(), set())
    finally:
        for handle in handles:
            handle.remove()
    drafted = sum(r.drafted for r in gen.rounds)
    rejected = drafted - sum(r.accepted for r in gen.rounds)
    assert 0 < rejected < drafted  # partial acceptance: rejected positions were really computed
    assert seen["first"] == seen["last"] == len(prompt) + drafted + len(gen.rounds) - 1
    # the last committed token was never fed; every other position is in each slot exactly once
    assert model.length(model.shared_slots) == model.length(model.deep_slots) == len(prompt) + 29
    assert model.length(model.exit_slots) <= len(prompt) + 29
    assert seen["exit"] < seen["first"]  # the exit layers never see the last draft of a round


def test_measure_runs_eesd_and_cali_ts_from_upstream_folders(tmp_path, tiny_target_dir, tiny_target):
    """The measure stage finds the early-exit head and the calibration models the upstream stages
    wrote, measures `eesd` with fixed K and Cali-TS, and leaves Cali-TS out for a drafter without one."""
    from polydraft.decoding.measurement.results import RESULTS_FILE, read_rows
    from polydraft.models.calibration import CalibrationModel
    from polydraft.models.early_exit import save_exit_head
    from tests.measure_setup import measure_context, measure_recipe, run_measure

    hidden = tiny_target.config.hidden_size
    early_exit = tmp_path / "early_exit"
    save_exit_head(from_target(tiny_target, 2, 1), early_exit / "head")
    calibrate = tmp_path / "calibrate"
    CalibrationModel(hidden, hidden).save(calibrate / "early_exit", extra={"draft_length": 10})  # steps 1..10
    finetune = tmp_path / "finetune"
    tiny_target.save_pretrained(finetune / "de-en")  # a drafter without a calibration model
    upstream = {"early_exit": early_exit, "calibrate": calibrate, "finetune": finetune}
    ctx = measure_context(tmp_path, upstream)
    settings = {
        "decoders": ["ar", "sd", "eesd"],
        "controls": ["fixed", "cali_ts"],
        "k_sweep": [],
        "seeds": [0],
        "eesd_draft_length": 2,  # its own fixed K; sd keeps measure.draft_length (3 here)
    }
    run_measure(measure_recipe(tiny_target_dir, **settings), ctx, tiny_target_dir)
    rows = read_rows(ctx.work_dir / RESULTS_FILE)
    methods = {r.method for r in rows}
    assert methods == {"ar", "sd[de-en] K=3", "eesd K=2", "eesd cali_ts"}
    eesd = [r for r in rows if r.decoder == "eesd"]
    assert {r.drafter_kind for r in eesd} == {"early_exit"} and all(0 < (r.size_ratio or 0) < 1 for r in eesd)
    assert all(r.matches_ar for r in rows if r.temperature == 0)
