"""Where a whole target goes: one device when it fits, else spread over the visible GPUs, never split inside
a decoder layer.

`plan_placement` decides from a model built on the meta device (no storage) in the load dtype and a
memory budget per device (bytes for the weights): the whole model within the first device's budget ->
that device (a plain `.to(device)`); else a device map from transformers' own `infer_auto_device_map`
(the one `from_pretrained(device_map="auto")` uses) with the model's `_no_split_modules`, the
embeddings on layer 0's device and the final norm on the lm head's; a model larger than every budget
together -> an error naming the sizes. `load_target` is what the stages call: the budget per GPU is the
recipe's `target.max_memory_per_gpu_gib` or the GPU's free memory less `RESERVE_GIB` for the KV cache and
activations.

A target loaded with a device map carries accelerate hooks that move each module's inputs to the device
it computes on. Code that calls parts of it directly asks `execution_device` where a module computes (for
a module offloaded to the CPU its parameters sit on `meta` and the hook's device is the one to use) and
`input_device` where token ids go.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from polydraft.models.loading import load_causal_lm, resolve_dtype
from polydraft.models.partial_load import decoder_parts, meta_causal_lm

log = logging.getLogger(__name__)

GIB = 2**30
RESERVE_GIB = 2.0
"""Left free on each GPU for the KV cache and activations when its budget is read from the device."""

Device = int | str
"""A device as device maps name it: a GPU index, or `cpu`."""


@dataclass(frozen=True)
class Placement:
    """Where a target's weights go: one `device`, or a `device_map` module name -> device."""

    device: torch.device | None
    device_map: dict[str, Device] | None
    description: str
    """One line for the log: the model's size and where it went."""


def _torch_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def model_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers (a tied weight counted once), of a model on any device."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def gpu_budgets(
    gpus: list[int], max_memory_per_gpu_gib: float | None, reserve_gib: float = RESERVE_GIB
) -> dict[Device, int]:
    """Bytes of weights each GPU may hold: the recipe's cap when set, else its free memory less the reserve."""
    if max_memory_per_gpu_gib is not None:
        return {gpu: int(max_memory_per_gpu_gib * GIB) for gpu in gpus}
    return {gpu: max(0, torch.cuda.mem_get_info(gpu)[0] - int(reserve_gib * GIB)) for gpu in gpus}


def _device_of(device_map: dict[str, Device], name: str) -> Device:
    """The device of module `name` in a device map (its own entry or its nearest ancestor's)."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        key = ".".join(parts[:end])
        if key in device_map:
            return device_map[key]
    raise KeyError(f"{name} has no device in the device map")


def _names(model: nn.Module) -> tuple[str, str, str, str]:
    """Names of the input embeddings, layer 0, the final norm and the lm head inside `model`."""
    parts = decoder_parts(model)
    names = {id(module): name for name, module in model.named_modules()}
    wanted = (parts.embed_tokens, parts.layers[0], parts.norm, parts.lm_head)
    embed, layer0, norm, head = (names[id(module)] for module in wanted)
    return embed, layer0, norm, head


def plan_placement(model: nn.Module, budgets: dict[Device, int]) -> Placement:
    """Where `model` (on the meta device, in its load dtype) goes given `budgets` (bytes per device, in the
    order to fill them: GPUs, then `cpu` where offloading is wanted)."""
    if not budgets:
        raise ValueError("no device to place the target on")
    size = model_bytes(model)
    first = next(iter(budgets))
    if size <= budgets[first]:
        return Placement(_torch_device(first), None, f"target ({_gib(size)}) on {_torch_device(first)}")
    shown = ", ".join(f"{device}: {_gib(budget)}" for device, budget in budgets.items())
    if size > sum(budgets.values()):
        raise ValueError(
            f"the target's weights ({_gib(size)}) do not fit the memory given to them ({shown}; "
            f"{_gib(sum(budgets.values()))} in all): use more GPUs, a smaller dtype, or raise "
            "target.max_memory_per_gpu_gib"
        )
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    # as `device_map="auto"` does: budgets lowered to spread the layers evenly (more room left on each GPU
    # for its share of the KV cache), never above the given ones
    balanced = get_balanced_memory(model, max_memory=dict(budgets), no_split_module_classes=no_split)
    device_map = dict(infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split))
    if "disk" in device_map.values():
        on_disk = [name for name, device in device_map.items() if device == "disk"]
        raise ValueError(
            f"the target's weights ({_gib(size)}) do not fit the memory given to them ({shown}) once no "
            f"decoder layer is split and room is kept to move the largest layer: {', '.join(on_disk)} left "
            "over; use more GPUs or raise target.max_memory_per_gpu_gib"
        )
    embed, layer0, norm, head = _names(model)
    if _device_of(device_map, embed) != _device_of(device_map, layer0):
        raise ValueError(
            f"device {first} ({_gib(budgets[first])}) holds the target's embeddings but not its first "
            "decoder layer beside them: raise target.max_memory_per_gpu_gib"
        )
    device_map[norm] = _device_of(device_map, head)  # the final norm is tiny: it goes with the lm head
    used = list(dict.fromkeys(device_map.values()))
    return Placement(None, device_map, f"target ({_gib(size)}) spread over {', '.join(map(str, used))}")


def load_placed(
    path: str, revision: str | None, dtype: torch.dtype, trust_remote_code: bool, placement: Placement
) -> nn.Module:
    """Load a causal LM as `placement` says, in eval mode."""
    from transformers import AutoModelForCausalLM

    if placement.device is not None:
        device = placement.device
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=dtype, trust_remote_code=trust_remote_code
        )
        return model.to(device).eval()
    return AutoModelForCausalLM.from_pretrained(
        path,
        revision=revision,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        device_map=placement.device_map,
    ).eval()


def load_target(
    path: str,
    revision: str | None,
    dtype: str,
    trust_remote_code: bool,
    max_memory_per_gpu_gib: float | None,
    device: torch.device | None = None,
) -> nn.Module:
    """The whole target in eval mode, as `plan_placement` decides: over every visible GPU (`device` None;
    the CPU without a GPU), or on `device` alone (a process of a multi-process run, or a CPU process)."""
    spread = device is None
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return load_causal_lm(path, revision, dtype, trust_remote_code, device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpus = list(range(torch.cuda.device_count())) if spread else [device.index]
    from transformers import AutoConfig

    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    skeleton = meta_causal_lm(config, torch_dtype, trust_remote_code=trust_remote_code)
    placement = plan_placement(skeleton, gpu_budgets(gpus, max_memory_per_gpu_gib))
    del skeleton
    log.info("placement: %s", placement.description)
    return load_placed(path, revision, torch_dtype, trust_remote_code, placement)


def process_device(device: torch.device, num_processes: int) -> torch.device | None:
    """What a trainer passes `load_target`: None (every visible GPU) when it is the only process on a GPU,
    else its own device."""
    return None if num_processes == 1 and device.type == "cuda" else device


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: its accelerate hook's when it has one (a target loaded with a
    device map), else that of its first parameter or buffer."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return _torch_device(device) if isinstance(device, int | str) else device
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    raise ValueError(f"{type(module).__name__} has no parameters or buffers: no device to compute on")


def input_device(model: nn.Module) -> torch.device:
    """Where a causal LM takes its token ids: the device its input embeddings compute on."""
    return execution_device(model.get_input_embeddings())
