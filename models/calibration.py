"""The calibration model of seed 001 (eq. 5): the probability that draft token i will be accepted.

    theta_M^{t+i} = sigmoid(W_p [W^i H_t^(T) ; H_{t+i}^(D)]),   i <- min(i, 10)

Trained as a 2-class classifier with cross-entropy, so theta = softmax(logits)[1] = sigmoid(l_1 - l_0).
Cali-TS (seed 001 Alg. 3) uses theta_M as the model prediction mixed with the sampled acceptance rate.

The inputs, at draft step i (1-based) of a drafting round:
- `target_hidden` H_t^(T): the target's last hidden state (the input of its lm head) that produced the
  newest token of the context, i.e. at the last position the target has verified. After the prefill it is
  the hidden state at the last prompt position; after a verification, the one at the last accepted
  position (whose prediction became the correction or bonus token that drafting starts from).
- `draft_hidden` H_{t+i}^(D): the drafter's last hidden state (the input of its lm head) from which it
  predicted draft token i.

Dimensions: W^i maps the target's hidden size d_T to the drafter's d_D (W^i in R^{d_D x d_T}), and
W_p in R^{2 x 2 d_D}. For the early-exit drafter d_T = d_D = d as in the paper and each W^i starts as
the identity; for a standalone drafter of another width W^i starts as a random projection. W_p has a
bias (2 numbers beyond eq. 5) so that the model can represent the base acceptance rate exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHTS_FILE = "calibration.safetensors"
CONFIG_FILE = "calibration.json"
FORMAT = "polydraft-calibration/1"


class CalibrationModel(nn.Module):
    """theta = softmax(W_p [W^i h_T ; h_D] + b)[1], with one W^i per draft step up to `max_steps`."""

    def __init__(self, target_hidden_size: int, draft_hidden_size: int, max_steps: int = 10):
        super().__init__()
        self.target_hidden_size = target_hidden_size
        self.draft_hidden_size = draft_hidden_size
        self.max_steps = max_steps
        self.step_proj = nn.Parameter(torch.empty(max_steps, draft_hidden_size, target_hidden_size))
        """W^1..W^max_steps, each d_D x d_T."""
        self.classifier = nn.Linear(2 * draft_hidden_size, 2)
        """W_p (and its bias): 2 logits, index 1 = accepted."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.target_hidden_size == self.draft_hidden_size:
                self.step_proj.copy_(torch.eye(self.draft_hidden_size).expand_as(self.step_proj))
            else:
                nn.init.normal_(self.step_proj, std=self.target_hidden_size**-0.5)
            nn.init.normal_(self.classifier.weight, std=(2 * self.draft_hidden_size) ** -0.5)
            nn.init.zeros_(self.classifier.bias)

    def forward(
        self, steps: torch.Tensor, target_hidden: torch.Tensor, draft_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Logits (B, 2) for draft steps `steps` (B,) (1-based), target_hidden (B, d_T), draft_hidden (B, d_D)."""
        if steps.numel() and int(steps.min()) < 1:
            raise ValueError("draft steps are 1-based (the first draft token of a round is step 1)")
        index = steps.clamp(max=self.max_steps) - 1
        weight = self.step_proj
        target_hidden = target_hidden.to(weight.dtype)
        projected = torch.empty(
            target_hidden.shape[0], self.draft_hidden_size, dtype=weight.dtype, device=weight.device
        )
        # one matmul per distinct step instead of gathering a d x d matrix per row
        for step in index.unique().tolist():
            rows = index == step
            projected[rows] = target_hidden[rows] @ weight[step].T
        return self.classifier(torch.cat([projected, draft_hidden.to(weight.dtype)], dim=-1))

    def probability(
        self, steps: torch.Tensor, target_hidden: torch.Tensor, draft_hidden: torch.Tensor
    ) -> torch.Tensor:
        """P(accepted) for each row, the softmax of the two logits."""
        return self.forward(steps, target_hidden, draft_hidden).softmax(dim=-1)[:, 1]

    @torch.no_grad()
    def predict(self, step_i: int, target_hidden: torch.Tensor, draft_hidden: torch.Tensor) -> float:
        """theta_M for one draft step (1-based `step_i`); hidden states of shape (d,) or (1, d).

        This is the callable the decoding engine's Cali-TS controller takes; see the module docstring
        for which hidden states to pass.
        """
        device = self.step_proj.device
        steps = torch.tensor([step_i], device=device)
        target = target_hidden.reshape(1, -1).to(device)
        draft = draft_hidden.reshape(1, -1).to(device)
        return float(self.probability(steps, target, draft)[0])

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """`calibration.safetensors` + `calibration.json` (sizes and whatever `extra` names, e.g. the drafter)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
        config = {
            "format": FORMAT,
            "target_hidden_size": self.target_hidden_size,
            "draft_hidden_size": self.draft_hidden_size,
            "max_steps": self.max_steps,
            **(extra or {}),
        }
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu") -> CalibrationModel:
        from safetensors.torch import load_file

        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; is this a calibrate stage output?")
        config = json.loads(path.read_text(encoding="utf-8"))
        if config.get("format") != FORMAT:
            raise ValueError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
        model = cls(config["target_hidden_size"], config["draft_hidden_size"], config["max_steps"])
        model.load_state_dict(load_file(str(Path(folder) / WEIGHTS_FILE)))
        return model.to(device).eval()


def check_covers(folder: str | Path, max_length: int) -> None:
    """ValueError unless the calibration model in `folder` was trained on every draft step 1..`max_length`
    that Cali-TS may take (its labels' `draft_length`, recorded by the calibrate stage)."""
    config = json.loads((Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    trained = config.get("draft_length")
    if not isinstance(trained, int) or trained < max_length:
        raise ValueError(
            f"{folder}: the calibration model was trained on draft steps 1..{trained}, but Cali-TS may "
            f"draft {max_length} tokens a round (measure.max_draft_length): steps past {trained} would use "
            f"untrained matrices. Raise calibrate.draft_length to {max_length} and rerun calibrate, or lower "
            "measure.max_draft_length"
        )


def acceptance_labels(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """chi_i for each draft token: 1 while the drafts agree with the target's tokens, 0 from the first miss on."""
    if len(draft_tokens) != len(target_tokens):
        raise ValueError(f"{len(draft_tokens)} draft tokens but {len(target_tokens)} target tokens")
    labels, agreeing = [], True
    for draft, target in zip(draft_tokens, target_tokens, strict=True):
        agreeing = agreeing and draft == target
        labels.append(int(agreeing))
    return labels


def calibration_metrics(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 10
) -> dict[str, float | int]:
    """Held-out quality of predicted acceptance probabilities against 0/1 labels.

    - `accuracy`: predictions thresholded at 0.5; `base_rate_accuracy`: always predicting the majority class
    - `brier`: mean squared error of the probability; `base_rate_brier`: that of always predicting the base
      rate (= base_rate * (1 - base_rate)), the score to beat
    - `ece`: expected calibration error over `num_bins` equal-width bins of the predicted probability
      (sum over bins of |mean label - mean probability| weighted by the bin's share of rows)
    - `base_rate`: share of accepted labels; `count`: rows
    """
    probs = probs.detach().double().flatten().cpu()
    labels = labels.detach().double().flatten().cpu()
    if probs.numel() == 0:
        raise ValueError("no predictions to score")
    base = float(labels.mean())
    bins = (probs * num_bins).long().clamp(max=num_bins - 1)
    ece = 0.0
    for b in range(num_bins):
        rows = bins == b
        if rows.any():
            ece += float(rows.double().mean()) * abs(float(labels[rows].mean()) - float(probs[rows].mean()))
    return {
        "accuracy": float(((probs >= 0.5).double() == labels).double().mean()),
        "base_rate_accuracy": max(base, 1.0 - base),
        "brier": float(((probs - labels) ** 2).mean()),
        "base_rate_brier": base * (1.0 - base),
        "ece": ece,
        "base_rate": base,
        "count": probs.numel(),
    }
