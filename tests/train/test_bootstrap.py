"""The bootstrap target build: a stopped build resumes to the same model as an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from polydraft.train import bootstrap

SETTINGS = dict(
    pairs=["de-en"],
    shape=bootstrap.TargetShape(300, 32, 2, 2, 64, max_position_embeddings=256),
    training=bootstrap.BootstrapTraining(
        steps=6, batch_size=5, seq_len=256, lr=3e-3, seed=0, checkpoint_every=2
    ),
    corpus=bootstrap.Corpus(12, entries_per_sample=(1, 2), test_fraction=0.1, kind_weights={"date": 1.0}),
    show_progress=False,
)
# 12 examples in batches of 5: the data order is drawn again at steps 0, 2 and 4, so a build resumed at
# step 4 (its last checkpoint) must restore the order's random state too


def test_a_stopped_build_resumes_to_the_same_model(tmp_path, monkeypatch):
    whole = bootstrap.build_bootstrap_target(tmp_path / "whole", **SETTINGS)
    step = bootstrap.train_step
    calls = []

    def stopping(*args, **kwargs):  # a kill during step 5, after its update (checkpoints after steps 2 and 4)
        calls.append(step(*args, **kwargs))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return calls[-1]

    # polydraft's own step, not an accelerate or torch internal: accelerate 1.16 clips without
    # torch.nn.utils.clip_grad_norm_, so a hook there never fired
    monkeypatch.setattr(bootstrap, "train_step", stopping)
    with pytest.raises(KeyboardInterrupt):
        bootstrap.build_bootstrap_target(tmp_path / "sliced", **SETTINGS)
    checkpoints = tmp_path / ".sliced.partial" / bootstrap.CHECKPOINTS
    assert not (tmp_path / "sliced").exists() and [p.name for p in checkpoints.iterdir()] == ["step-00000004"]
    monkeypatch.setattr(bootstrap, "train_step", step)
    sliced = bootstrap.build_bootstrap_target(tmp_path / "sliced", **SETTINGS)
    assert not (tmp_path / ".sliced.partial").exists()
    assert sliced["final_loss"] == whole["final_loss"] and (sliced["slices"], whole["slices"]) == (2, 1)
    first, second = (load_file(tmp_path / name / "model.safetensors") for name in ("whole", "sliced"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "sliced" / bootstrap.DONE).read_text())["steps"] == 6
    tokens = (tmp_path / "whole" / "tokenizer.json").read_text()
    assert (tmp_path / "sliced" / "tokenizer.json").read_text() == tokens


def test_bootstrap_pairs_default_to_the_data_pairs_and_keep_the_cache_key():
    """Unset, `target.bootstrap.pairs` is `data.pairs` and the key is the one builds had before the field
    existed (the committed demo targets' folders are named by it); set, it names the pairs trained on."""
    import pytest

    from polydraft.pipelines.runtime.target import bootstrap_key, bootstrap_pairs
    from polydraft.pipelines.schema import Recipe

    # the demo recipe of b966087, whose target was committed as recipes/demo/target/bdb8f257ea236e49
    boot = {"vocab_size": 2048, "hidden_size": 128, "num_layers": 24, "num_heads": 4, "intermediate_size": 384,
            "steps": 1500, "batch_size": 32, "seq_len": 256, "lr": 2.0e-3, "cache_dir": "target"}  # fmt: skip
    offline = {"entries_per_sample": [4, 8], "samples_per_pair": 4000,
               "kind_weights": {"catalog": 1.0, "name": 1.0, "date": 2.0, "number": 2.0}}  # fmt: skip
    old = Recipe.model_validate(
        {"target": {"bootstrap": boot}, "data": {"pairs": ["de-en", "fr-en"], "offline": offline}}
    )
    assert bootstrap_key(old.target, old.data) == "bdb8f257ea236e49"
    assert bootstrap_pairs(old.target, old.data) == ["de-en", "fr-en"]
    more = {"target": {"bootstrap": {**boot, "pairs": ["fr-en", "de-en", "en-de"]}},
            "data": {"pairs": ["de-en"], "offline": offline}}  # fmt: skip
    wider = Recipe.model_validate(more)
    assert bootstrap_pairs(wider.target, wider.data) == ["de-en", "en-de", "fr-en"]
    assert bootstrap_key(wider.target, wider.data) != bootstrap_key(old.target, old.data)
    with pytest.raises(ValueError, match=r"data.pairs \['ru-en'\] are not among target.bootstrap.pairs"):
        Recipe.model_validate({**more, "data": {"pairs": ["de-en", "ru-en"], "offline": offline}})
