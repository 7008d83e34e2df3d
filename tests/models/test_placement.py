"""Where a whole target goes (`models.placement`), and every decoder on a target loaded through it.

The decisions are tested on models built on the meta device (no weights allocated) with device counts
and memories given, so a 70B-shaped Llama is placed over 2, 4 and 8 GPUs of 80 GB on a CPU machine.
A tiny target loaded through the placement path, with a per-layer device map and accelerate's hooks,
decodes exactly as `ar` with every decoder on the CPU; with a CUDA GPU the same target split between the
GPU and the CPU (its later layers offloaded) does too.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig

from polydraft.decoding.lm import CachedLM
from polydraft.models.partial_load import meta_causal_lm
from polydraft.models.placement import (
    GIB,
    Device,
    Placement,
    execution_device,
    gpu_budgets,
    input_device,
    load_placed,
    model_bytes,
    plan_placement,
    process_device,
)
from polydraft.pipelines.runtime.target import resolve_target
from polydraft.pipelines.schema import DataConfig, TargetConfig
from tests.decoding.test_decoding_families import (
    chain_decoders,
    decode_all,
    fitted_heads,
    noisy_copy,
    prompts_and_references,
    target_model,
    tree_decoders,
)
from tests.decoding_helpers import single_thread_fixture

single_thread = single_thread_fixture()

LLAMA_70B = LlamaConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


@pytest.fixture(autouse=True)
def quiet_accelerate(caplog):
    """accelerate warns for every GPU index this machine does not have: the budgets name imagined GPUs."""
    caplog.set_level(logging.ERROR)


@pytest.fixture(scope="module")
def llama_70b() -> torch.nn.Module:
    return meta_causal_lm(LLAMA_70B, torch.bfloat16)


def test_a_target_that_fits_the_first_gpu_goes_there_whole():
    model = meta_causal_lm(
        LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), torch.float32
    )
    size = model_bytes(model)
    assert next(model.parameters()).device.type == "meta"  # nothing allocated
    placement = plan_placement(model, {0: size, 1: 80 * GIB})
    assert placement.device == torch.device("cuda", 0) and placement.device_map is None
    assert plan_placement(model, {"cpu": size}).device == torch.device("cpu")
    assert "on cuda:0" in placement.description


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_a_70b_target_spreads_over_every_gpu_without_splitting_a_layer(llama_70b, gpus):
    size = model_bytes(llama_70b)
    assert 130 * GIB < size < 132 * GIB  # bfloat16 Llama-70B shape: 70.6e9 parameters
    placement = plan_placement(llama_70b, {gpu: 80 * GIB for gpu in range(gpus)})
    device_map = placement.device_map
    assert placement.device is None and device_map is not None
    assert set(device_map.values()) == set(range(gpus))  # spread over all of them, as `auto` balances
    for name in device_map:  # the no-split rule: whole decoder layers, never their parts
        assert not name.startswith("model.layers.") or name.count(".") == 2, name
    layers = [device_map[f"model.layers.{i}"] for i in range(80)]
    assert layers == sorted(layers)  # in order: each GPU holds a run of consecutive layers
    assert device_map["model.embed_tokens"] == device_map["model.layers.0"] == 0
    assert device_map["model.norm"] == device_map["lm_head"] == gpus - 1
    per_gpu = [layers.count(gpu) for gpu in range(gpus)]
    # balanced as `device_map="auto"` balances: no GPU idle, none far over its even share (8 GPUs: 9..11 layers
    # on the first seven, the 5 left on the last, beside the lm head)
    assert min(per_gpu) >= 80 // gpus // 2 and max(per_gpu) <= 80 // gpus + 3, per_gpu
    assert f"spread over {', '.join(map(str, range(gpus)))}" in placement.description


def test_a_target_too_big_for_the_gpus_is_refused_naming_the_sizes(llama_70b):
    with pytest.raises(ValueError, match=r"\(131\.4 GiB\) do not fit .*0: 80\.0 GiB; 80\.0 GiB in all"):
        plan_placement(llama_70b, {0: 80 * GIB})
    with pytest.raises(ValueError, match=r"0: 40\.0 GiB, 1: 40\.0 GiB, 2: 40\.0 GiB; 120\.0 GiB in all"):
        plan_placement(llama_70b, {gpu: 40 * GIB for gpu in range(3)})


def test_whole_layers_that_cannot_fit_are_refused_not_split():
    """Budgets that hold the weights only if a layer were cut in two: an error, not a split layer."""
    model = meta_causal_lm(
        LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=2048, vocab_size=64),
        torch.float32,
    )
    size = model_bytes(model)
    with pytest.raises(ValueError, match="once no decoder layer is split"):
        plan_placement(model, {0: int(size * 0.51), 1: int(size * 0.51)})


def test_budgets_come_from_the_recipe_else_from_the_device(monkeypatch):
    assert gpu_budgets([0, 1], 70.0) == {0: 70 * GIB, 1: 70 * GIB}
    free = {0: 79 * GIB, 1: 60 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda gpu: (free[gpu], 80 * GIB))
    assert gpu_budgets([0, 1], None) == {0: 77 * GIB, 1: 58 * GIB}  # less the 2 GiB reserve
    assert gpu_budgets([1], None, reserve_gib=10.0) == {1: 50 * GIB}
    assert gpu_budgets([0, 1], 70.0) == {0: 70 * GIB, 1: 70 * GIB}  # the recipe's cap wins over the device


def test_each_process_of_a_multi_process_run_keeps_its_own_gpu():
    assert process_device(torch.device("cuda", 0), 1) is None
    assert process_device(torch.device("cuda", 3), 4) == torch.device("cuda", 3)
    assert process_device(torch.device("cpu"), 1) == torch.device("cpu")


def test_the_recipe_field_reaches_the_stages(tmp_path):
    target = TargetConfig.model_validate({"path": "org/model", "max_memory_per_gpu_gib": 70.5})
    assert resolve_target(target, DataConfig.model_validate({})).max_memory_per_gpu_gib == 70.5
    assert resolve_target(TargetConfig(path="org/model"), DataConfig()).max_memory_per_gpu_gib is None
    with pytest.raises(ValueError, match="max_memory_per_gpu_gib"):
        TargetConfig.model_validate({"path": "org/model", "max_memory_per_gpu_gib": 0.0})


def every_decoder_is_ar(model: torch.nn.Module, tmp_path) -> None:
    """`tests/test_decoding_families`' check: every decoder gives `ar`'s greedy output on two prompts."""
    # the drafter perturbs a plain copy: the hooks a deep copy of `model` would carry are not under test
    drafter = noisy_copy(target_model("llama", None)).to(input_device(model))
    target, drafter = CachedLM(model), CachedLM(drafter)
    prompts, references = prompts_and_references(model, target, [4, 7], 16)
    sequence = torch.cat([prompts[0], torch.tensor(references[0])])
    heads = fitted_heads(model, target, sequence)
    decoders, _ = chain_decoders(model, tmp_path / "early_exit", target, drafter, heads)
    decode_all("llama", decoders | tree_decoders(target, drafter, heads), prompts, references, 16)


def tiny_placement(tmp_path, share: float, budget: Device) -> Placement:
    """The tiny Llama saved to `tmp_path/target`; where `plan_placement` puts it when GPU 0 holds `share` of
    its weights and `budget` takes the rest."""
    model = target_model("llama", None)
    model.save_pretrained(tmp_path / "target")
    size = model_bytes(meta_causal_lm(model.config, torch.float32))
    return plan_placement(
        meta_causal_lm(model.config, torch.float32), {0: int(size * share), budget: 4 * size}
    )


def test_a_target_loaded_with_a_device_map_decodes_as_ar_with_every_decoder(tmp_path):
    """On the CPU: the per-layer map two small GPUs would get, every entry sent to the CPU, and
    accelerate's hooks forced on (as on a spread target), so every module runs behind a hook."""
    from accelerate import dispatch_model

    placement = tiny_placement(tmp_path, 0.7, 1)
    assert placement.device_map is not None and set(placement.device_map.values()) == {0, 1}
    on_cpu = dataclasses.replace(placement, device_map=dict.fromkeys(placement.device_map, "cpu"))
    model = load_placed(str(tmp_path / "target"), None, torch.float32, False, on_cpu)
    dispatch_model(model, on_cpu.device_map, force_hooks=True)
    assert hasattr(model.model.layers[0], "_hf_hook") and hasattr(model.lm_head, "_hf_hook")
    assert execution_device(model.model.layers[-1]) == input_device(model) == torch.device("cpu")
    every_decoder_is_ar(model, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to split the target with the CPU")
def test_a_target_split_between_the_gpu_and_the_cpu_decodes_as_ar_with_every_decoder(tmp_path):
    placement = tiny_placement(tmp_path, 0.6, "cpu")
    model = load_placed(str(tmp_path / "target"), None, torch.float32, False, placement)
    assert placement.device_map is not None and set(placement.device_map.values()) == {0, "cpu"}
    assert input_device(model) == torch.device("cuda", 0)
    assert any(p.device.type == "meta" for p in model.model.layers[-1].parameters())  # offloaded to the CPU
    every_decoder_is_ar(model, tmp_path)


def test_the_final_norm_goes_with_a_tied_lm_head():
    """A tied lm head shares the embeddings' weight on GPU 0; the final norm, after the last layer on the
    last GPU, goes to GPU 0 with it."""
    config = LlamaConfig(
        num_hidden_layers=8, hidden_size=256, intermediate_size=1024, tie_word_embeddings=True
    )
    model = meta_causal_lm(config, torch.float32)
    size = model_bytes(model)
    device_map = plan_placement(model, {0: int(size * 0.7), 1: int(size * 0.7)}).device_map
    assert device_map is not None and device_map["model.layers.7"] == 1
    assert device_map["model.norm"] == device_map["lm_head"] == device_map["model.embed_tokens"] == 0
