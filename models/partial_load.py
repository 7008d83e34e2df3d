"""Load parts of a target without materialising the rest: meta skeletons and partial checkpoint reads.

The early-exit drafter of seed 001 needs only the embeddings, the first N decoder layers, the last layer,
the final norm and the lm head of a 13B or 70B target. This module builds the target's own module tree
on the `meta` device (no memory), picks the parts out of it, gives only those real storage and reads
only their tensors from the checkpoint: `safetensors.safe_open` reads single tensors from
`model.safetensors` or the shards listed in `model.safetensors.index.json`; `.bin` checkpoints are
memory-mapped (`torch.load(mmap=True)`), so unread tensors never reach memory either. For a hub id,
only the shards that hold the needed tensors are downloaded.

The layout expected of a target (Llama-family and most decoder-only models of transformers): a causal LM
whose decoder exposes input embeddings, a `nn.ModuleList` of `num_hidden_layers` decoder layers, a final
norm and a `rotary_emb`, plus an lm head. `decoder_parts` names what is missing when a model differs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

INDEX_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
"""Checkpoint layouts tried in this order (the first one present wins)."""

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
"""Attribute names of the final norm on a decoder, as transformers' model files spell them."""


class TargetLayoutError(ValueError):
    """A target whose modules do not have the layout the early-exit drafter is built from."""


@dataclass
class DecoderParts:
    """The modules of a causal LM the early-exit drafter uses, and their qualified names in the model."""

    model: nn.Module
    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module
    lm_head: nn.Module
    names: dict[str, str]
    """Part (`embed_tokens`, `layers`, `norm`, `rotary_emb`, `lm_head`) -> qualified module name in `model`
    (also the prefix of its tensors in the model's checkpoint)."""


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Find the embeddings, decoder layer list, final norm, rotary embedding and lm head of a causal LM.

    Raises TargetLayoutError naming every part that is missing, so that an unsupported architecture fails
    before anything is loaded.
    """
    kind = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise TargetLayoutError(f"{kind} has no `config`: expected a transformers causal LM")
    text_config = config.get_text_config(decoder=True)
    num_layers = getattr(text_config, "num_hidden_layers", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    missing = []
    if decoder is None:
        missing.append("a decoder (`get_decoder()`)")
        decoder = model
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        missing.append("input embeddings (`get_input_embeddings()`)")
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None:
        missing.append("an lm head (`get_output_embeddings()`)")
    layers = next(
        (
            child
            for child in decoder.children()
            if isinstance(child, nn.ModuleList) and num_layers is not None and len(child) == num_layers
        ),
        None,
    )
    if layers is None:
        missing.append(
            f"a list of decoder layers (an nn.ModuleList of num_hidden_layers={num_layers} modules)"
        )
    norm = next(
        (getattr(decoder, n) for n in FINAL_NORM_NAMES if isinstance(getattr(decoder, n, None), nn.Module)),
        None,
    )
    if norm is None:
        missing.append(f"a final norm (one of {', '.join(FINAL_NORM_NAMES)})")
    rotary = getattr(decoder, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        missing.append("a shared rotary position embedding (`rotary_emb`)")
    if missing:
        raise TargetLayoutError(
            f"{kind} ({type(decoder).__name__}) cannot host an early-exit drafter: it lacks "
            + "; ".join(missing)
            + ". Supported: Llama-family decoder-only models (embeddings -> layer list -> final norm -> lm head "
            "with rotary positions)."
        )
    by_module = {id(module): name for name, module in model.named_modules()}
    parts = {"embed_tokens": embed, "layers": layers, "norm": norm, "rotary_emb": rotary, "lm_head": lm_head}
    return DecoderParts(
        model=model,
        embed_tokens=embed,
        layers=layers,
        norm=norm,
        rotary_emb=rotary,
        lm_head=lm_head,
        names={part: by_module[id(module)] for part, module in parts.items()},
    )


# ----------------------------------------------------------------------------- checkpoint reading


class CheckpointReader:
    """The tensor names of a Hugging Face checkpoint, and reads of chosen tensors only."""

    def __init__(self, location: str, key_files: dict[str, str], fetch: Callable[[str], Path]):
        self.location = location
        self.key_files = key_files
        """Tensor name -> checkpoint file (relative to the checkpoint folder)."""
        self._fetch = fetch

    @property
    def keys(self) -> set[str]:
        return set(self.key_files)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, opening each file once and reading nothing else from it."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            if key not in self.key_files:
                raise KeyError(f"{self.location}: the checkpoint has no tensor {key!r}")
            by_file[self.key_files[key]].append(key)
        out: dict[str, torch.Tensor] = {}
        for filename, names in by_file.items():
            path = self._fetch(filename)
            if filename.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    out.update({name: handle.get_tensor(name) for name in names})
            else:
                # mmap: the zip archive is mapped, only the tensors touched below are paged in
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                out.update({name: state[name].clone() for name in names})
                del state
        return out


def _fetcher(path: str, revision: str | None) -> tuple[Callable[[str], Path | None], bool]:
    """A function filename -> local path (None when the checkpoint has no such file), and whether it is local."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return (lambda name: folder / name if (folder / name).is_file() else None), True

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    def fetch(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(path, name, revision=revision))
        except RemoteEntryNotFoundError:
            return None

    return fetch, False


def open_checkpoint(path: str, revision: str | None = None) -> CheckpointReader:
    """Index a local checkpoint folder or a hub repo (downloading only its index, or its single file)."""
    fetch, local = _fetcher(path, revision)
    for index_name in INDEX_FILES:
        found = fetch(index_name)
        if found is None:
            continue
        if index_name.endswith(".index.json"):
            key_files = json.loads(found.read_text(encoding="utf-8"))["weight_map"]
        elif index_name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(found), framework="pt", device="cpu") as handle:
                key_files = {key: index_name for key in handle.keys()}  # noqa: SIM118 - not a dict
        else:
            state = torch.load(found, map_location="meta", mmap=True, weights_only=True)
            key_files = {key: index_name for key in state}

        def strict_fetch(name: str) -> Path:
            got = fetch(name)
            if got is None:
                raise FileNotFoundError(f"{path}: the checkpoint index names {name}, which is missing")
            return got

        return CheckpointReader(path, key_files, strict_fetch)
    where = "folder" if local else "hub repo (revision " + str(revision or "main") + ")"
    raise FileNotFoundError(f"{path}: no checkpoint in this {where}; looked for {', '.join(INDEX_FILES)}")


# ----------------------------------------------------------------------------- meta skeletons


def meta_causal_lm(
    config,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The target's causal LM built from its config on the meta device: its module tree, no storage."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def materialise(
    sources: list[tuple[nn.Module, str]],
    skeleton: nn.Module,
    reader: CheckpointReader,
    device: torch.device | str,
) -> list[str]:
    """Give meta modules real storage on `device` and fill them from the checkpoint; returns the keys read.

    `sources` pairs each module with the checkpoint prefix of the module it stands for (e.g. an exit layer
    with `model.layers.39`). Non-persistent buffers (rotary frequencies, embedding scales) are not in
    checkpoints: they are recomputed by the model's own `_init_weights`, as transformers does after its
    own meta-device loading. A tensor missing from the checkpoint is an error that lists them all.
    """
    tied = getattr(skeleton, "_tied_weights_keys", None) or {}
    plan: dict[str, list[torch.Tensor]] = defaultdict(list)
    missing = []
    for module, prefix in sources:
        module.to_empty(device=device)
        with torch.no_grad():
            for sub in module.modules():
                skeleton._init_weights(sub)
        for name, tensor in module.state_dict(keep_vars=True).items():
            key = f"{prefix}.{name}" if prefix else name
            if key not in reader.key_files and isinstance(tied, dict) and tied.get(key) in reader.key_files:
                key = tied[key]  # tied lm head: its weights are stored once, as the embeddings
            if key in reader.key_files:
                plan[key].append(tensor)
            else:
                missing.append(key)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise TargetLayoutError(f"{reader.location}: the checkpoint lacks {shown}")
    loaded = reader.read(plan)
    with torch.no_grad():
        for key, tensors in plan.items():
            for tensor in tensors:
                if tensor.shape != loaded[key].shape:
                    raise TargetLayoutError(
                        f"{reader.location}: {key} has shape {tuple(loaded[key].shape)}, expected {tuple(tensor.shape)}"
                    )
                tensor.copy_(loaded[key])
    return sorted(plan)
