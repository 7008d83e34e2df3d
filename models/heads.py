"""Medusa-1 and BPD heads on a frozen target's last hidden state, saved in two formats.

Both kinds put `num_heads` proposal heads on the target's final hidden state h_t (the final-norm output,
the input of its lm head). The target's own head gives token t+1; proposal head i (0-based) predicts
token t+2+i. This is Medusa's convention (its k-th head predicts the token k+1 positions after the
next one) and Stern et al. 2018's blockwise parallel decoding with k = num_heads + 1, whose first
head is the base model's own: only the k-1 proposal heads are trained here, the target stays frozen.

Each proposal head starts with a residual block, `x + SiLU(W x + b)` (`num_layers` of them in a row),
initialised to the identity (W = 0, b = 0, as Medusa does), so that training starts from the target's
next-token prediction. Then:
- `medusa` (Medusa-1, Cai et al. 2024): each head has its own lm head, initialised from the target's;
- `bpd` (Stern et al. 2018): every head goes through the target's own lm head, shared and frozen, as
  Stern et al. share the base model's output projection. Stern et al.'s per-head layer is a residual
  feed-forward layer; here it is the same one-matrix residual block as Medusa's, so that both kinds
  load in vLLM's `medusa` method (BPD with `original_lm_head`), and the two differ only in the lm head.

Formats:
- polydraft's own: `heads.safetensors` (the trainable tensors only: a BPD folder holds no lm head,
  it is the target's) and `heads.json` (kind, shape, the target it was trained on, training metrics);
- vLLM's `medusa` speculative method, in the same folder (`add_vllm_medusa`): `config.json`
  (`model_type: medusa`, `num_heads`, `num_hidden_layers` = residual layers per head, `medusa_fc_bias`,
  `original_lm_head`); vLLM reads every top-level `*.safetensors`, and `heads.safetensors` already uses
  its parameter names (`blocks.{i}.layers.{j}.weight|bias`, `lm_heads.{i}.weight`). BPD heads add
  `lm_head.safetensors`, a copy of the target's lm head, with `original_lm_head: true`. So one folder
  is both formats and no tensor is stored twice. vLLM's medusa proposer drafts each head's argmax, a
  chain: what polydraft's `bpd` decoder does at temperature 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from polydraft.models.placement import execution_device

HeadKind = Literal["medusa", "bpd"]
KINDS: tuple[str, ...] = ("medusa", "bpd")
WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"
FORMAT = "polydraft-heads/1"
VLLM_LM_HEAD_FILE = "lm_head.safetensors"
VLLM_CONFIG_FILE = "config.json"


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x + b), initialised to the identity."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.act = nn.SiLU()
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.zero_()
                if layer.bias is not None:
                    layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class Heads(nn.Module):
    """`num_heads` proposal heads; head i predicts token t+2+i from the target's final hidden state h_t."""

    def __init__(
        self,
        kind: str,
        num_heads: int,
        hidden_size: int,
        vocab_size: int,
        num_layers: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown head kind {kind!r}; expected one of {KINDS}")
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {num_heads}, {num_layers}")
        self.kind = kind
        self.num_heads, self.num_layers, self.bias = num_heads, num_layers, bias
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        # BPD heads have no lm head of their own: the target's is passed to `forward`
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False)
            for _ in range(num_heads if kind == "medusa" else 0)
        )

    def forward(
        self, hidden: torch.Tensor, shared_head: nn.Module | None = None, project: bool = True
    ) -> torch.Tensor:
        """hidden [..., H] -> logits [num_heads, ..., V]. `shared_head`: the target's lm head (BPD only).
        `project=False`: the residual blocks' outputs [num_heads, ..., H], the lm heads' inputs (a trainer
        computing the loss chunk by chunk projects them itself, `lm_head_of`)."""
        if not project:
            return torch.stack([block(hidden) for block in self.blocks])
        if self.kind == "bpd":
            if shared_head is None:
                raise ValueError("BPD heads project through the target's lm head: pass it as shared_head")
            return torch.stack([shared_head(block(hidden)) for block in self.blocks])
        return torch.stack([head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)])

    def lm_head_of(self, i: int, shared_head: nn.Module | None = None) -> nn.Module:
        """The lm head head `i` projects through: its own (Medusa) or the target's (BPD)."""
        if self.kind == "bpd":
            if shared_head is None:
                raise ValueError("BPD heads project through the target's lm head: pass it as shared_head")
            return shared_head
        return self.lm_heads[i]

    def init_lm_heads(self, target_head: nn.Module) -> None:
        """Copy the target's lm head into every Medusa head (Medusa-1's initialisation)."""
        if getattr(target_head, "bias", None) is not None:
            raise ValueError("the target's lm head has a bias; Medusa heads (and vLLM's) have none")
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(target_head.weight)

    def shape(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "bias": self.bias,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


def target_sizes(config: Any) -> tuple[int, int]:
    """(hidden size, vocabulary size) of a transformers config."""
    text = config.get_text_config(decoder=True)
    return text.hidden_size, text.vocab_size


def heads_for_target(
    target: nn.Module, kind: str, num_heads: int, num_layers: int = 1, bias: bool = True
) -> Heads:
    """New heads for a loaded causal LM, fp32, on its device; Medusa heads start from its lm head."""
    hidden_size, vocab_size = target_sizes(target.config)
    target_head = target.get_output_embeddings()
    heads = Heads(kind, num_heads, hidden_size, vocab_size, num_layers, bias)
    heads.to(execution_device(target_head))
    if kind == "medusa":
        heads.init_lm_heads(target_head)
    return heads


# ----------------------------------------------------------------------------- polydraft's format


def save_heads(
    heads: Heads,
    folder: str | Path,
    target: dict[str, str | None],
    extra: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `heads.safetensors` and `heads.json`. `target`: {"path", "revision"} of the target;
    `state`: the heads' state dict when it lives elsewhere (gathered from FSDP / ZeRO-3 shards)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in (state or heads.state_dict()).items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = {
        "format": FORMAT,
        **heads.shape(),
        "predicts": "head i predicts token t+2+i from the target's final hidden state at t",
        "target": target,
        "dtype": dtype,
        **(extra or {}),
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def read_heads_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; is this a heads folder?")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("format") != FORMAT:
        raise ValueError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    return config


def load_heads(folder: str | Path, device: torch.device | str = "cpu") -> Heads:
    """Heads saved by `save_heads`, in the dtype they were saved in."""
    from safetensors.torch import load_file

    config = read_heads_config(folder)
    heads = Heads(
        config["kind"], config["num_heads"], config["hidden_size"], config["vocab_size"],
        config["num_layers"], config["bias"],
    )  # fmt: skip
    state = load_file(str(Path(folder) / WEIGHTS_FILE), device=str(device))
    heads.to(device=device, dtype=next(iter(state.values())).dtype)
    heads.load_state_dict(state)
    return heads.eval()


def check_heads_fit(heads: Heads, target: nn.Module, where: str) -> None:
    """Refuse heads trained for a target of another hidden or vocabulary size."""
    hidden_size, vocab_size = target_sizes(target.config)
    if (heads.hidden_size, heads.vocab_size) != (hidden_size, vocab_size):
        raise ValueError(
            f"{where}: heads for hidden size {heads.hidden_size} and vocabulary {heads.vocab_size}, "
            f"but the target has {hidden_size} and {vocab_size}"
        )


def attach_heads(target: nn.Module, folder: str | Path) -> Heads:
    """Load heads for decoding with a loaded target: on its device, in its dtype, shapes checked."""
    heads = load_heads(folder)
    check_heads_fit(heads, target, str(folder))
    head = target.get_output_embeddings()
    return heads.to(device=execution_device(head), dtype=head.weight.dtype).eval()


# ----------------------------------------------------------------------------- vLLM's medusa format


def vllm_medusa_config(shape: dict[str, Any], dtype: str) -> dict[str, Any]:
    """vLLM's `MedusaConfig` for heads of this `shape` (`Heads.shape()`, or a `heads.json`)."""
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": shape["hidden_size"],
        "vocab_size": shape["vocab_size"],
        "truncated_vocab_size": shape["vocab_size"],
        # MedusaConfig renames every key holding "num" and "heads" (or "layers"): only these two may
        "num_heads": shape["num_heads"],
        "num_hidden_layers": shape["num_layers"],
        "medusa_fc_bias": shape["bias"],
        "original_lm_head": shape["kind"] == "bpd",
        "dtype": dtype,
    }


def add_vllm_medusa(folder: str | Path, target_head: nn.Module | None = None) -> Path:
    """Make a polydraft heads folder (`save_heads`) loadable by vLLM's `medusa` method too, in place.

    vLLM reads `config.json` and every top-level `*.safetensors`; `heads.safetensors` already holds its
    parameter names (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`), so no tensor is duplicated. BPD
    heads share the target's lm head, which vLLM's medusa model keeps a copy of (`original_lm_head`):
    it goes into `lm_head.safetensors` (`target_head` required).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    config = read_heads_config(folder)
    if config["kind"] == "bpd":
        if target_head is None:
            raise ValueError("exporting BPD heads needs the target's lm head (vLLM keeps a copy)")
        if getattr(target_head, "bias", None) is not None:
            raise ValueError("the target's lm head has a bias, which vLLM's medusa lm head cannot hold")
        weight = target_head.weight.detach().to("cpu", getattr(torch, config["dtype"])).contiguous()
        save_file({"lm_head.weight": weight}, str(folder / VLLM_LM_HEAD_FILE), metadata={"format": "pt"})
    medusa = vllm_medusa_config(config, config["dtype"])
    (folder / VLLM_CONFIG_FILE).write_text(json.dumps(medusa, indent=2) + "\n", encoding="utf-8")
    return folder


def load_vllm_medusa(folder: str | Path) -> tuple[Heads, torch.Tensor | None]:
    """Read a folder as vLLM's medusa model does: (heads, the shared lm head of an `original_lm_head` one).

    Like vLLM's `Medusa.load_weights`: `config.json`, then every top-level `*.safetensors`, a
    `medusa_heads.` prefix dropped, and a shared head found as `lm_head.weight` or `lm_heads.0.weight`. An
    `original_lm_head` folder becomes BPD heads (they project through one shared head); the caller checks
    that weight against the target's. Raises ValueError when a parameter vLLM needs is missing.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / VLLM_CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("model_type") != "medusa":
        raise ValueError(f"{folder}: model_type {config.get('model_type')!r}, expected 'medusa'")
    shared = bool(config.get("original_lm_head", False))
    heads = Heads(
        "bpd" if shared else "medusa", config["num_heads"], config["hidden_size"], config["vocab_size"],
        config.get("num_hidden_layers", 1), bool(config.get("medusa_fc_bias", False)),
    )  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update({k.removeprefix("medusa_heads."): v for k, v in load_file(str(path)).items()})
    shared_weight = None
    if shared:
        shared_weight = state.pop("lm_head.weight", None)
        shared_weight = state.pop("lm_heads.0.weight", None) if shared_weight is None else shared_weight
    wanted = set(heads.state_dict())
    missing = sorted(wanted - set(state)) + (["lm_head.weight"] if shared and shared_weight is None else [])
    if missing:
        raise ValueError(f"{folder}: vLLM's medusa model would miss {missing}")
    heads.to(dtype=state[next(iter(sorted(wanted)))].dtype)
    heads.load_state_dict({k: state[k] for k in wanted})
    return heads.eval(), shared_weight
