"""The export stage's records, typed and defined once: `results.json` in each exported folder (every fact of
its model card) and `export.json` (the index `polydraft publish` and the run summary read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polydraft.decoding.measurement.results import DrafterKind, Engine, ResultRow
from polydraft.pipelines.export.routing import RoutingTable
from polydraft.pipelines.runtime.manifest import write_json_atomic
from polydraft.train.stage_metrics import CalibrationScores, DraftVocab

RESULTS_FORMAT = "polydraft-export-results/1"
INDEX_FORMAT = "polydraft-export/1"
INDEX_FILE = "export.json"
RESULTS_FILE = "results.json"
CARD_FILE = "README.md"


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PublicTarget(Record):
    """The target as a card may name it: a hub id, or None for a local or bootstrap target."""

    id: str | None
    revision: str | None
    label: str | None
    """The id's last part (`vicuna-7b-v1.3`), used in repo names."""


class MeanStd(Record):
    mean: float | None
    std: float | None


class SummaryEntry(Record):
    """One method on one dataset at one temperature: its settings and mean/std over seeds."""

    method: str
    engine: Engine
    decoder: str
    control: str | None
    draft_length: int | None
    tree: str | None
    dataset: str
    temperature: float
    in_domain: bool | None
    seeds: list[int]
    matches_ar: bool | None
    block_efficiency: MeanStd
    speedup: MeanStd
    acceptance_rate: MeanStd
    mean_accepted_length: MeanStd
    token_rate: MeanStd


class MeasurementContext(Record):
    """Where and when the rows were measured (every distinct value, so mixed runs show as such)."""

    hardware: list[str]
    device: list[str]
    dates: list[str]
    """First and last."""
    torch: list[str]
    transformers: list[str]
    seeds: list[int]
    prompts: list[int]
    max_new_tokens: list[int]
    top_p: list[float]


class Measurement(Record):
    measured: bool
    decoder: str
    """The decoder the headline is about: `sd` for a drafter, `eesd` for the head, `bpd` for proposal heads
    (the chain of their argmaxes, what vLLM's medusa method drafts)."""
    best_draft_length: int | None
    headline: SummaryEntry | None
    context: MeasurementContext | None
    summary: list[SummaryEntry]
    rows: list[ResultRow]
    """This drafter's rows and the `ar` rows of the groups it was measured in."""


class PretrainCard(Record):
    arch: str
    sources: list[str]
    token_budget: int
    tokens: int | None
    steps: int | None
    train_loss: float | None


class FinetuneCard(Record):
    pair: str | None
    start: str
    distill_sources: list[str]
    open_sources: list[str]
    prompt_format: str
    distilled_temperatures: list[float]
    temperatures: list[float]
    loss: str
    tokens: int | None
    steps: int | None
    train_loss: float | None
    eval_loss: float | None
    top1_agreement: float | None


class TrainingCard(Record):
    pretrain: PretrainCard | None
    finetune: FinetuneCard | None


class CalibrationCard(Record):
    draft_length: int
    heldout: CalibrationScores


class HeadCard(Record):
    num_hidden_layers: int
    num_shared_layers: int
    num_exit_layers: int
    steps: int | None
    train_loss: float | None
    initial_top1_target: float | None
    top1_target: float | None


class HeadsCard(Record):
    """Blockwise proposal heads (seed 000): their shape and the heads stage's held-out scores."""

    kind: Literal["medusa", "bpd"]
    num_heads: int
    num_layers: int
    """Residual SiLU layers per head."""
    parameters: int
    """Trainable parameters (a BPD folder's copy of the target's lm head not counted)."""
    steps: int | None
    train_loss: float | None
    initial_top1_target: list[float] | None
    """Per head: agreement of its argmax with the target's greedy token at its position, as initialised."""
    top1_target: list[float] | None
    """The same after training."""


class Eagle3Card(Record):
    """An EAGLE-3 head: its shape, draft vocabulary and the eagle3 stage's training and held-out scores."""

    aux_layers: list[int]
    target_hidden_size: int
    draft_vocab_size: int
    vocab: DraftVocab
    parameters: int
    """Its own parameters (the target's embeddings it shares not counted)."""
    ttt_steps: int
    steps: int
    tokens: int
    train_loss: float | None
    top1_by_step: list[float] | None
    """Held-out agreement of each draft step's argmax with the target's greedy token."""
    expected_accepted: float | None
    initial_expected_accepted: float | None
    speculative_tokens: int
    """The K its config drafts per round (the measured best, else the recipe's)."""


class ArchitectureCard(Record):
    class_name: str = Field(alias="class")
    model_type: str | None
    hidden_size: int | None
    num_hidden_layers: int | None
    vocab_size: int | None
    max_position_embeddings: int | None
    parameters: int


class PromptExample(Record):
    format: str
    example: str
    """The prompt format with a placeholder (`{text}` or `{question}`)."""
    add_special_tokens: bool


class SmokeCheck(Record):
    name: str
    status: Literal["pass", "fail", "warn", "skipped"]
    detail: str


class SmokeResult(Record):
    passed: bool
    checks: list[SmokeCheck]


class GitState(Record):
    commit: str | None
    dirty: bool | None


class MixedTrafficCard(Record):
    """The run's mixed-language traffic (`measure.mixed`): routed per-language drafters against the
    multilingual drafter on every pair's prompts interleaved (`decoding.measurement.mixed`)."""

    decisions: list[str]
    """Which choice won, per temperature, with the numbers and the noise."""
    rule: str
    summary: str
    """The measure summary's section: every method per pair and overall, the router's accuracy and cost."""


class ExportResults(Record):
    """`results.json`: everything the model card says, machine-readable."""

    format: Literal["polydraft-export-results/1"] = RESULTS_FORMAT
    name: str
    kind: Literal["drafter", "early_exit", "heads", "eagle3"]
    source: DrafterKind
    pair: str | None
    repo_name: str
    target: PublicTarget
    license: str
    languages: list[str]
    datasets: list[str]
    training: TrainingCard
    calibration: CalibrationCard | None
    prompt: PromptExample
    measurement: Measurement
    draft_length_default: int
    smoke: SmokeResult
    plots: list[str]
    polydraft: GitState
    head: HeadCard | None = None
    heads: HeadsCard | None = None
    eagle3: Eagle3Card | None = None
    architecture: ArchitectureCard | None = None
    mixed_traffic: MixedTrafficCard | None = None
    """Finetuned drafters of a run that measured mixed traffic."""
    files: list[str] = []


class ExportRecord(Record):
    """One exported folder in `export.json`."""

    name: str
    kind: Literal["drafter", "early_exit", "heads", "eagle3"]
    folder: str
    pair: str | None
    repo_name: str
    smoke_passed: bool
    measured: bool
    best_draft_length: int | None
    headline: SummaryEntry | None


class ExportIndex(Record):
    format: Literal["polydraft-export/1"] = INDEX_FORMAT
    target: PublicTarget
    items: list[ExportRecord]


class ExportedItemMetrics(Record):
    smoke_passed: bool
    best_k: int | None
    speedup: float | None
    block_efficiency: float | None


class ExportMetrics(Record):
    """What the export stage reports (its manifest's `metrics`)."""

    exported: int
    smoke_failed: list[str]
    unmeasured: list[str]
    items: dict[str, ExportedItemMetrics]
    routing: dict[str, str] | None = None
    """`routing.json`'s language -> drafter folder (`fallback`: its fallback, when it has one); None when
    no pair drafter was exported (no table is written)."""


def write_index(work_dir: Path, names: list[str], target: PublicTarget) -> ExportIndex:
    """`export.json`: one record per exported folder, read by `polydraft publish` and the run summary."""
    items = []
    for name in names:
        info = ExportResults.model_validate_json((work_dir / name / RESULTS_FILE).read_text(encoding="utf-8"))
        m = info.measurement
        items.append(
            ExportRecord(
                name=name,
                kind=info.kind,
                folder=name,
                pair=info.pair,
                repo_name=info.repo_name,
                smoke_passed=info.smoke.passed,
                measured=m.measured,
                best_draft_length=m.best_draft_length,
                headline=m.headline,
            )
        )
    index = ExportIndex(target=target, items=items)
    write_json_atomic(work_dir / INDEX_FILE, index.model_dump(mode="json"))
    return index


def stage_metrics(index: ExportIndex, table: RoutingTable | None = None) -> dict[str, Any]:
    items = {
        item.name: ExportedItemMetrics(
            smoke_passed=item.smoke_passed,
            best_k=item.best_draft_length,
            speedup=item.headline.speedup.mean if item.headline else None,
            block_efficiency=item.headline.block_efficiency.mean if item.headline else None,
        )
        for item in index.items
    }
    return ExportMetrics(
        exported=len(index.items),
        smoke_failed=[i.name for i in index.items if not i.smoke_passed],
        unmeasured=[i.name for i in index.items if not i.measured],
        items=items,
        routing=None
        if table is None
        else {
            **table.drafters,
            **({"fallback": table.fallback} if table.fallback else {}),
            **{f"eagle3 {language}": folder for language, folder in table.heads.items()},
            **({"eagle3 fallback": table.heads_fallback} if table.heads_fallback else {}),
        },
    ).model_dump()
