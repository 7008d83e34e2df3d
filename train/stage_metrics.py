"""What the training stages report: typed metrics, written by one stage (its manifest's `metrics`) and read
by the next (export's model cards, the run summary). Metric names are fields, never parsed from strings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Metrics(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EvalMetrics(Metrics):
    """A drafter on one held-out mix: loss on the response tokens, top-1 agreement with the target's greedy
    tokens (rows distilled at temperature 0; None when the set has none)."""

    eval_loss: float
    top1_agreement: float | None = None


class DrafterMetrics(Metrics):
    """One trained drafter (pretrain's, or one pair's finetune)."""

    steps: int
    tokens: int
    """Input tokens seen (all processes)."""
    train_loss: float | None
    """Mean loss of the last `log_every` steps."""
    eval: dict[str, EvalMetrics] = {}
    """Held-out metrics by eval set (a pair's mix)."""


class Launched(Metrics):
    """What accelerate really ran (an FSDP or DeepSpeed config falls back to DDP on a CPU); None when
    nothing was launched (every job was finished by an earlier, interrupted run)."""

    distributed_type: str | None = None
    num_processes: int | None = None


class PretrainMetrics(Launched):
    drafter: DrafterMetrics


class MultilingualMetrics(Metrics):
    """The drafter trained on the union of every pair's mix (`finetune.multilingual`)."""

    drafter: DrafterMetrics
    examples_per_pair: dict[str, int]
    """Distinct encoded training rows of each pair."""
    rows_per_pair: dict[str, int]
    """Rows of each pair in one epoch of the balanced union (each the largest pair's count)."""


class FinetuneMetrics(Launched):
    pairs: dict[str, DrafterMetrics]
    multilingual: MultilingualMetrics | None = None
    """None unless `finetune.multilingual`."""


class HeadEval(Metrics):
    """The early-exit head on held-out rows."""

    eval_loss: float
    top1_target: float
    """Agreement of the head's argmax with the full target's greedy token."""
    top1_labels: float
    """Agreement with the data's next token."""
    target_top1_labels: float
    """The full target's own agreement with the data's next token."""


class EarlyExitMetrics(Launched):
    steps: int
    train_loss: float | None
    initial: HeadEval | None
    """The head as initialised from the target's last layer(s): the baseline training must beat."""
    final: HeadEval | None
    peak_memory_gib: float | None = None
    """GPU only."""


class HeadScore(Metrics):
    """One proposal head on held-out rows (head i predicts the token i + 2 positions ahead)."""

    loss: float
    top1: float
    """Agreement of the head's argmax with the data's token."""
    top1_target: float
    """Agreement with the target's own greedy token at that position, given the true prefix."""


class HeadsEval(Metrics):
    """Blockwise proposal heads on held-out rows."""

    eval_loss: float
    """The mean of the heads' losses."""
    heads: list[HeadScore]
    target_top1: float
    """The target's own next-token agreement with the data, for scale."""


class HeadsMetrics(Launched):
    steps: int
    train_loss: float | None
    initial: HeadsEval | None
    """The heads as initialised (identity blocks on the target's lm head): the baseline training must beat."""
    final: HeadsEval | None
    peak_memory_gib: float | None = None
    """GPU only."""


class CalibrationScores(Metrics):
    """A calibration model's predictions of draft acceptance against the labels, and the base rate's."""

    accuracy: float
    base_rate_accuracy: float
    brier: float
    base_rate_brier: float
    ece: float
    base_rate: float
    count: int


class CalibrationReport(Metrics):
    """`calibrate/<drafter>/report.json`."""

    drafter: str
    drafter_path: str
    draft_length: int
    positions: dict[str, int]
    heldout: CalibrationScores
    train: CalibrationScores
    heldout_base_rate_by_step: list[float]


class CalibrateMetrics(Launched):
    heldout: dict[str, CalibrationScores]
    """By drafter name (`early_exit`, or a pair's drafter)."""


class Eagle3StepScore(Metrics):
    """An EAGLE-3 head's draft step i (its i-th token after the target's) on held-out rows, given the true
    tokens before it."""

    kl: float
    """Forward KL from the target's distribution restricted to the draft vocabulary, on the rows whose
    target argmax lies inside it."""
    top1: float
    """Agreement of the head's argmax with the target's greedy token, over every row (a token outside the
    draft vocabulary is a miss): what greedy acceptance of this step needs."""
    in_vocab: float
    """Share of the rows whose target argmax lies inside the draft vocabulary."""


class Eagle3Eval(Metrics):
    eval_loss: float
    """The steps' KL, weighted as the training loss weighs them."""
    steps: list[Eagle3StepScore]
    expected_accepted: float
    """sum_k prod_{i <= k} top1_i: the drafts a greedy round of `ttt_steps` would accept, were the steps'
    agreements independent (a proxy for block efficiency - 1 at K = ttt_steps)."""


class DraftVocab(Metrics):
    """One head's draft vocabulary."""

    size: int
    kept: int
    """Special and byte tokens kept whatever their counts."""
    answer_tokens: int
    """Tokens of the self-distilled training answers it was chosen from."""
    coverage_train: float | None
    """Share of those tokens inside it."""
    coverage_heldout: float | None
    """Share of the held-out answers' tokens inside it (the pair's eval split; the union for `multilingual`)."""


class Eagle3HeadMetrics(Metrics):
    steps: int
    tokens: int
    train_loss: float | None
    initial: Eagle3Eval | None
    final: Eagle3Eval | None
    vocab: DraftVocab


class Eagle3Metrics(Launched):
    heads: dict[str, Eagle3HeadMetrics]
    """By pair, plus `multilingual` with `eagle3.multilingual`."""
    aux_layers: list[int]
    peak_memory_gib: float | None = None
    """GPU only."""
