"""The EAGLE-3 draft head (arXiv 2503.01840), built from transformers' Llama modules, in the format vLLM's
`eagle3` speculative method loads (the speculators format).

    g_t   = fc([h_t^(a) ; h_t^(b) ; h_t^(c)])                 the target's states after layers a < b < c
    a_t   = Layer(e(x_{t+1}), g_t)                             one decoder layer, attention over 2H inputs
    p     = softmax(lm_head(norm(a_t)))                        over the draft vocabulary

`Layer` concatenates the normed token embedding and the normed feature (`input_layernorm`, `hidden_norm`)
into the attention's 2H-wide input; its residual stream starts from the feature itself (vLLM's
`norm_before_residual: false`, written explicitly into the config because speculators defaults it to true).
The layer's output before the final norm, `a_t`, is the feature of the next draft step: drafting step k+1
reads (e(x̂_{t+k+1}), a_{t+k}) at position t+k. The token embeddings are the target's own (frozen, not
saved: vLLM shares the target's when the checkpoint has none).

Feature layer ids follow vLLM: id i is the residual stream entering decoder layer i (0: the embeddings),
which is `hidden_states[i]` of a transformers forward with `output_hidden_states=True`; the default is
vLLM's and the reference's, (2, L // 2, L - 3).

The head predicts over a draft vocabulary, a sorted subset of the target's (`models.draft_vocab`): `d2t`
maps a draft id to its target id as an offset (target = draft + d2t[draft]), `t2d` marks the target ids
inside it. Both are saved with the weights; vLLM reads `d2t` (without it, it would use the identity).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polydraft.models.decoder_layers import cache_kwargs

SPECULATORS_VERSION = "0.3.0"
"""The speculators format version written (the field vLLM's loader does not read; kept for the tool)."""
WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "eagle3.json"
"""polydraft's own record beside the speculators config: pair, coverage, training metrics."""


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and the reference's default feature layers: low, middle, high."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layers_problem(layers: list[int], num_layers: int) -> str | None:
    """Why `layers` cannot be a head's feature layers on a target of `num_layers` layers, or None."""
    if len(layers) < 1:
        return "no feature layer"
    if any(b <= a for a, b in zip(layers, layers[1:])):
        # vLLM sorts the ids and concatenates in that order: an unsorted list would train another order
        return f"feature layers {layers} must be strictly increasing"
    if layers[0] < 0 or layers[-1] >= num_layers:
        return f"feature layers {layers} must lie in 0..{num_layers - 1} (the target has {num_layers} layers)"
    return None


def layer_config(target_config: Any, intermediate_size: int | None) -> Any:
    """The head's decoder layer as a LlamaConfig: the target's width, heads, rotary embedding and norm eps
    (the head reads the target's embeddings and positions), one layer, `intermediate_size` (None: the
    target's)."""
    from transformers import LlamaConfig

    text = target_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    rope = dict(text.rope_parameters)
    if "full_attention" in rope:  # one rotary setting per attention type (Gemma 3): the global layers'
        rope = dict(rope["full_attention"])
    config = LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=rope,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (vLLM's and speculators' weight names: `layers.0.*`)."""

    def __init__(self, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        # transformers' attention over the concatenation [embedding ; feature]: only q, k, v are wider
        attention, width = self.self_attn, self.self_attn.head_dim
        attention.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * width, bias=False)
        attention.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * width, bias=False)
        attention.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * width, bias=False)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """The layer's output [B, T, H] before the final norm: the next step's feature."""
        joined = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=joined,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **cache_kwargs(self.self_attn, cache),
        )
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """fc + one decoder layer + norm + lm head over the draft vocabulary; see the module docstring."""

    def __init__(
        self, config: Any, target_hidden_size: int, aux_layers: list[int], draft_ids: torch.Tensor
    ) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_ids.numel() == 0 or bool((draft_ids[1:] <= draft_ids[:-1]).any()):
            raise ValueError(
                "the draft vocabulary must be a non-empty, strictly increasing list of target ids"
            )
        self.config = config
        self.aux_layers = list(aux_layers)
        self.target_hidden_size = target_hidden_size
        hidden = config.hidden_size
        self.fc = nn.Linear(len(aux_layers) * target_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_ids.numel(), bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("draft_ids", draft_ids, persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc(features): the target's concatenated feature-layer states [.., 3 H_target] -> [.., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """One pass of the layer over positions `position_ids` [B, T]: `embeds` are the target's embeddings
        of the tokens, `hidden` the features (`project`ed, or the previous step's outputs). Returns the
        layer's outputs [B, T, H] (the next step's features; `logits` turns them into draft logits)."""
        rope = self.rotary_emb(hidden, position_ids=position_ids)
        return self.layers[0](embeds.to(hidden.dtype), hidden, rope, attention_mask, cache)

    def normed(self, outputs: torch.Tensor) -> torch.Tensor:
        """The input of the lm head."""
        return self.norm(outputs)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., V_draft] of layer outputs."""
        return self.lm_head(self.norm(outputs))

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [.., V]: the draft ones at their target ids, -inf elsewhere
        (as vLLM's `compute_logits` does): a draft never proposes a token outside the draft vocabulary."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_ids] = draft_logits
        return full


@contextlib.contextmanager
def feature_capture(model: nn.Module, aux_layers: list[int]) -> Iterator[list[torch.Tensor]]:
    """Within the block, a forward of `model` (a transformers causal LM or its decoder) leaves the states
    entering each decoder layer of `aux_layers` in the yielded list, in that order, each moved to the
    first's device: what `hidden_states[i]` of `output_hidden_states=True` holds, without keeping every
    layer's states (a 7B target's 33 of them are 2 GiB at 4 x 2048 tokens). Hooks on the layers before
    (on the embeddings for id 0), removed at exit."""
    decoder = model.base_model
    grabbed: dict[int, torch.Tensor] = {}
    handles = []
    for i in aux_layers:
        module = decoder.layers[i - 1] if i > 0 else decoder.get_input_embeddings()

        def keep(_module: nn.Module, _args: Any, output: Any, i: int = i) -> None:
            grabbed[i] = output[0] if isinstance(output, tuple) else output

        handles.append(module.register_forward_hook(keep))
    states: list[torch.Tensor] = []
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()
    if grabbed:
        device = grabbed[aux_layers[0]].device
        states.extend(grabbed[i].to(device) for i in aux_layers)


def head_for_target(
    target: nn.Module,
    draft_ids: torch.Tensor,
    aux_layers: list[int],
    intermediate_size: int | None = None,
    seed: int = 0,
) -> Eagle3Head:
    """A new head for `target`, in fp32 on the target's input device (the trained weights; a bf16 target's
    features are cast by `project`), initialised as the target reads its own last layer: `fc` passes the
    highest feature layer's state through, the decoder layer's norms, feature half of q/k/v, o and MLP are
    the target's last layer's (the token-embedding half of q/k/v small and random), the final norm and lm
    head the target's final norm and its lm head's rows of the draft vocabulary. So the head starts by
    computing the target's last layer on the feature (as EESD's exit layer starts from the target's last
    layers) and learns the one-token shift from there, in fewer steps than from a random layer
    (bench/results/eagle3_demo.md). A target whose last layer is not Llama-shaped (fused projections, another
    MLP) keeps a random layer where the shapes differ."""
    config = layer_config(target.config, intermediate_size)
    text = target.config.get_text_config(decoder=True)
    problem = aux_layers_problem(aux_layers, text.num_hidden_layers)
    if problem:
        raise ValueError(f"eagle3.aux_layers: {problem}")
    generator = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config, text.hidden_size, aux_layers, draft_ids)
    std = getattr(text, "initializer_range", 0.02)
    hidden = config.hidden_size
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[head.draft_ids].float())
        norm = getattr(target.base_model, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            head.norm.weight.copy_(norm.weight.detach().float())
        if text.hidden_size == hidden:
            head.fc.weight.zero_()
            head.fc.weight[:, -hidden:] = torch.eye(hidden)
            copy_last_layer(head.layers[0], target.base_model.layers[-1])
    return head.to(target.get_input_embeddings().weight.device)


def copy_last_layer(layer: Eagle3Layer, last: nn.Module) -> None:
    """The target's last decoder layer's weights into the head's layer where their shapes agree (the
    feature half of q/k/v; o, the MLP, the norms); whatever does not match stays as initialised."""
    hidden = layer.input_layernorm.weight.shape[0]
    pairs = [
        (layer.hidden_norm.weight, getattr(last, "input_layernorm", None)),
        (layer.post_attention_layernorm.weight, getattr(last, "post_attention_layernorm", None)),
    ]
    theirs = getattr(last, "self_attn", None)
    for name in ("o_proj",):
        pairs.append((getattr(layer.self_attn, name).weight, getattr(theirs, name, None)))
    for name in ("gate_proj", "up_proj", "down_proj"):
        pairs.append((getattr(layer.mlp, name).weight, getattr(getattr(last, "mlp", None), name, None)))
    for mine, module in pairs:
        weight = getattr(module, "weight", None)
        if weight is not None and weight.shape == mine.shape:
            mine.copy_(weight.detach().float())
    for name in ("q_proj", "k_proj", "v_proj"):
        mine = getattr(layer.self_attn, name).weight
        weight = getattr(getattr(theirs, name, None), "weight", None)
        if weight is not None and weight.shape == mine[:, hidden:].shape:
            mine[:, :hidden].mul_(0.1)
            mine[:, hidden:] = weight.detach().float()


# ----------------------------------------------------------------------------- the speculators format


def speculators_config(
    head: Eagle3Head, verifier: str, verifier_architectures: list[str], speculative_tokens: int
) -> dict[str, Any]:
    """The `config.json` of a speculators-format EAGLE-3 checkpoint, as vLLM reads it
    (`vllm/transformers_utils/configs/speculators`): every norm flag written out, since vLLM's llama
    layer and the speculators updater default `norm_before_residual` differently."""
    layer = head.config.to_dict()
    for key in ("transformers_version", "_attn_implementation_autoset", "architectures", "dtype"):
        layer.pop(key, None)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens, "verifier_accept_k": 1}
            ],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": head.aux_layers,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
    }


def save_eagle3(
    head: Eagle3Head,
    folder: Path,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    info: dict[str, Any],
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write `folder` in the speculators format (`config.json`, `model.safetensors` with `d2t` and `t2d`)
    plus polydraft's `eagle3.json` (`info`). `state`: the weights to save (a gathered state dict under
    FSDP / ZeRO-3), else the head's own. A draft vocabulary that is the whole vocabulary saves no map
    (vLLM then has none to load)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in (state or head.state_dict()).items()}
    if head.draft_vocab_size == head.config.vocab_size:
        weights.pop("d2t", None)
        weights.pop("t2d", None)
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = speculators_config(head, verifier, verifier_architectures, speculative_tokens)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def load_eagle3(
    folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Eagle3Head:
    """A head saved by `save_eagle3` (or any speculators-format EAGLE-3 checkpoint with a Llama layer and
    polydraft's weight names); ValueError naming the folder when it is not one."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder}: no readable config.json ({err})") from err
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{folder}: not an EAGLE-3 head (speculators_model_type is not `eagle3`)")
    if config.get("norm_before_residual", True) or config.get("norm_before_fc") or config.get("fc_norm"):
        raise ValueError(f"{folder}: a variant polydraft does not build (norm flags of {config})")
    layer = LlamaConfig(**config["transformer_layer_config"])
    layer._attn_implementation = "sdpa"
    weights = load_file(str(folder / WEIGHTS_FILE))
    size = config["draft_vocab_size"]
    draft_ids = torch.arange(size) + weights["d2t"] if "d2t" in weights else torch.arange(size)
    head = Eagle3Head(
        layer, config["target_hidden_size"], config["eagle_aux_hidden_state_layer_ids"], draft_ids
    )
    weights.setdefault("d2t", head.d2t)
    weights.setdefault("t2d", head.t2d)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match the head (missing {missing}, unexpected {unexpected})"
        )
    return head.to(device=device, dtype=dtype or head.fc.weight.dtype).eval()


def read_info(folder: str | Path) -> dict[str, Any]:
    """polydraft's record of a head (`eagle3.json`): {} for a head trained elsewhere."""
    path = Path(folder) / INFO_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
