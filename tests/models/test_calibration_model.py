"""The eq. 5 calibration model, its labels and its held-out metrics."""

from __future__ import annotations

import math

import pytest
import torch

from polydraft.models.calibration import CalibrationModel, acceptance_labels, calibration_metrics


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([5, 6, 7, 8], [5, 6, 9, 8], [1, 1, 0, 0]),  # a later agreement after a miss still counts 0
        ([1, 2, 3], [1, 2, 3], [1, 1, 1]),
        ([4, 2, 3], [1, 2, 3], [0, 0, 0]),
        ([], [], []),
    ],
)
def test_acceptance_labels(draft, target, expected):
    assert acceptance_labels(draft, target) == expected


def test_acceptance_labels_need_equal_lengths():
    with pytest.raises(ValueError, match="3 draft tokens but 2 target tokens"):
        acceptance_labels([1, 2, 3], [1, 2])


def test_metrics_on_hand_made_predictions():
    probs = torch.tensor([0.95, 0.85, 0.35, 0.05])  # mid-bin values: no float rounding across bin edges
    labels = torch.tensor([1, 0, 0, 0])
    got = calibration_metrics(probs, labels, num_bins=10)
    assert got["accuracy"] == pytest.approx(0.75)
    assert got["brier"] == pytest.approx((0.0025 + 0.7225 + 0.1225 + 0.0025) / 4)
    # four singleton bins: |1-.95| + |0-.85| + |0-.35| + |0-.05|, each weighted 1/4
    assert got["ece"] == pytest.approx((0.05 + 0.85 + 0.35 + 0.05) / 4)
    assert got["base_rate"] == pytest.approx(0.25)
    assert got["base_rate_brier"] == pytest.approx(0.1875)
    assert got["base_rate_accuracy"] == pytest.approx(0.75)
    assert got["count"] == 4


def test_ece_of_a_calibrated_bin_is_zero():
    # ten rows at p=0.7 of which 70% are accepted, ten rows at p=0 never accepted: perfectly calibrated
    probs = torch.tensor([0.7] * 10 + [0.0] * 10)
    labels = torch.tensor([1] * 7 + [0] * 3 + [0] * 10)
    assert calibration_metrics(probs, labels)["ece"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="no predictions"):
        calibration_metrics(torch.tensor([]), torch.tensor([]))


def test_model_shapes_caps_steps_and_starts_from_identity():
    torch.manual_seed(0)
    model = CalibrationModel(16, 16, max_steps=10)
    assert torch.equal(model.step_proj[3], torch.eye(16))
    target, draft = torch.randn(6, 16), torch.randn(6, 16)
    steps = torch.tensor([1, 2, 10, 11, 15, 3])
    with torch.no_grad():
        model.step_proj.add_(torch.randn_like(model.step_proj))  # make the steps distinguishable
        logits = model(steps, target, draft)
    assert logits.shape == (6, 2)
    expected = model.classifier(torch.cat([target[2] @ model.step_proj[9].T, draft[2]]))
    assert torch.allclose(logits[2], expected, atol=1e-5)
    assert torch.allclose(
        logits[3], model.classifier(torch.cat([target[3] @ model.step_proj[9].T, draft[3]]))
    )
    p = model.predict(15, target[4], draft[4])
    assert isinstance(p, float) and 0.0 < p < 1.0
    assert p == pytest.approx(float(logits[4].softmax(-1)[1]), abs=1e-6)
    with pytest.raises(ValueError, match="1-based"):
        model(torch.tensor([0]), target[:1], draft[:1])


def test_probability_is_the_sigmoid_of_the_logit_difference():
    model = CalibrationModel(8, 4)
    target, draft = torch.randn(3, 8), torch.randn(3, 4)  # a drafter narrower than the target
    steps = torch.tensor([1, 2, 3])
    with torch.no_grad():
        logits = model(steps, target, draft)
        probs = model.probability(steps, target, draft)
    assert torch.allclose(probs, torch.sigmoid(logits[:, 1] - logits[:, 0]))
    assert model.step_proj.shape == (10, 4, 8) and model.classifier.weight.shape == (2, 8)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(1)
    model = CalibrationModel(8, 8, max_steps=4)
    with torch.no_grad():
        model.classifier.bias.fill_(math.log(3.0))
    model.save(tmp_path / "cal", extra={"drafter": "early_exit"})
    loaded = CalibrationModel.load(tmp_path / "cal")
    h_t, h_d = torch.randn(8), torch.randn(8)
    assert loaded.predict(2, h_t, h_d) == pytest.approx(model.predict(2, h_t, h_d))
    assert loaded.max_steps == 4
    with pytest.raises(FileNotFoundError, match="calibration.json"):
        CalibrationModel.load(tmp_path)
