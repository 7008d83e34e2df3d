"""`results.jsonl`: one typed row per engine x decoder x drafter x dataset x temperature x seed (x draft
setting), written by the measure stage group by group and read by the export stage, the run summary and the
reports. The row is defined here, once.

Rows of engine `polydraft` come from polydraft's own decoders (batch 1, `decoding.measurement.groups`); rows of engine
`vllm` from the same drafters run as vLLM's draft model on the same prompts (`decoding.measurement.vllm_measure`), with
vLLM's own target-alone run as their baseline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from polydraft.decoding.engine import Generation

RESULTS_FILE = "results.jsonl"

DecoderName = Literal[
    "ar", "sd", "rsd_c", "rsd_s", "eesd", "eagle3", "assisted", "bpd", "medusa", "bpd+rescore", "medusa+rescore"
]  # fmt: skip
DrafterKind = Literal["finetune", "pretrain", "extra", "early_exit", "eagle3", "heads"]
Engine = Literal["polydraft", "vllm"]


class BatchRate(BaseModel):
    """Tokens/s of the vLLM engine at one batch size, without and with the drafter, same prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int
    without_drafter: float
    with_drafter: float
    speedup: float


class PromptResult(BaseModel):
    """One prompt of a row: what comparisons paired by prompt need (`decoding.measurement.claims`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    new_tokens: int
    target_calls: int
    wall_seconds: float
    drafted: int | None = None
    """Draft tokens sent to the target (None in rows written before this field)."""
    accepted: int | None = None
    """Draft tokens accepted and kept (None in rows written before this field)."""
    first_round_drafted: int | None = None
    """Draft tokens of the prompt's first round (Cali-TS drafts up to its cap there before deciding, seed
    001 Alg. 3 as `decoding.control` reads it); None in rows written before this field."""

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / max(self.target_calls, 1)

    @property
    def token_rate(self) -> float | None:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else None

    @property
    def hm(self) -> float | None:
        """Seed 001's HM of this prompt: the harmonic mean of accepted / drafted and accepted / new tokens
        (`decoding.measurement.metrics.summarize`); None without drafts or without the counts."""
        if self.drafted is None or self.accepted is None or not self.drafted or not self.new_tokens:
            return None
        v_d, r_d = self.accepted / self.drafted, self.accepted / self.new_tokens
        return 2 * v_d * r_d / (v_d + r_d) if v_d + r_d > 0 else None


def prompt_speedup(method: PromptResult, ar: PromptResult) -> float:
    """The speedup of one prompt: the method's token rate over `ar`'s on the same prompt and repetition
    (ar's wall seconds over the method's when both wrote the same tokens, as at T=0)."""
    return (method.new_tokens / method.wall_seconds) / (ar.new_tokens / ar.wall_seconds)


def prompt_results(generations: Sequence[Generation]) -> list[PromptResult]:
    """Each generation of a row, in the group's prompt order."""
    return [
        PromptResult(
            new_tokens=len(g.tokens), target_calls=g.target_calls, wall_seconds=g.wall_seconds,
            drafted=sum(r.drafted for r in g.rounds), accepted=sum(r.accepted for r in g.rounds),
            first_round_drafted=g.rounds[0].drafted if g.rounds else 0,
        )
        for g in generations
    ]  # fmt: skip


class ResultRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # identity
    engine: Engine
    """`polydraft` (its own decoders) or `vllm` (vLLM's draft-model speculative decoding)."""
    engine_detail: str | None
    """For `vllm`: version, device and draft sampling method (`vLLM 0.32.0 cpu, greedy drafts`)."""
    engine_version: str | None = None
    """For `vllm`: `vllm.__version__` of the engine that measured the row (a known engine bug is tied to
    versions); None for polydraft's rows and for vLLM rows written before this field."""
    decoder: DecoderName
    method: str
    """A readable label unique within a group, e.g. `sd[de-en] K=4`, `rsd_s[de-en] 3x3`, `eesd beta_ts`."""
    drafter: str | None
    """The drafter's name; None for `ar`; `heads` for the blockwise decoders."""
    rescorer: str | None = None
    """`+rescore` decoders: the name of the drafter that rescores the heads' lattice."""
    rescore_weight: float | None = None
    """`+rescore` decoders: lambda."""
    drafter_kind: DrafterKind | None
    drafter_pair: str | None
    """The pair a language drafter was finetuned on; None for generic drafters and the early-exit head."""
    dataset: str
    dataset_pair: str | None
    in_domain: bool | None
    """drafter_pair == dataset_pair; None when either is None."""
    temperature: float
    top_p: float
    seed: int
    # settings
    draft_length: int | None
    """K of a chain; the cap under Thompson sampling; None otherwise."""
    control: (
        Literal["fixed", "beta_ts", "cali_ts", "beta_ts_literal", "cali_ts_model", "cali_ts_sampling"] | None
    )
    """`pipelines.schema.measure.Control`; None for trees and the blockwise decoders."""
    tree: str | None
    """`2-2-1` (branching) for rsd_c, `3x3` (width x depth) for rsd_s and `medusa+rescore` (beams x
    heads), `9 nodes` for medusa, None otherwise."""
    max_new_tokens: int
    size_ratio: float | None
    """Drafter parameters / target parameters; None for `ar`."""
    # metrics (decoding.measurement.metrics.summarize)
    prompts: int
    new_tokens: int
    target_calls: int
    draft_calls: int
    block_efficiency: float | None
    mean_accepted_length: float | None
    mean_draft_length: float | None
    acceptance_rate: float | None
    """v_d: accepted / drafted tokens."""
    acceptance_per_position: list[float] | None
    """Entry i: the share of draft rounds whose first i+1 draft tokens were all accepted."""
    draft_proportion: float | None
    """r_d: accepted draft tokens / output tokens."""
    hm: float | None
    mbsu: float | None
    token_rate: float | None
    """Output tokens per second of wall time."""
    wall_seconds: float
    target_seconds: float | None
    draft_seconds: float | None
    """Time in the target's and the drafter's forward passes; None for `vllm` (not timed apart)."""
    overhead_share: float | None
    rescore_seconds: float = 0.0
    """`+rescore` decoders: time in the rescoring drafter's forwards (part of draft_seconds)."""
    rescore_ms_per_round: float | None = None
    """`+rescore` decoders: rescore_seconds per target call, in milliseconds."""
    eos_stops: int
    speedup: float | None
    """token_rate / the token rate of `ar` in the same group; for `vllm`, over vLLM's target alone at the
    smallest batch size."""
    batch_rates: list[BatchRate] | None
    """For `vllm`: tokens/s without and with the drafter per batch size."""
    predicted_speedup: float | None = Field(
        default=None, validation_alias=AliasChoices("predicted_speedup", "ideal_speedup")
    )
    """The speedup a latency model predicts for these rounds from the measured forward latencies
    (`decoding.measurement.latency`): a prediction, not a bound. Rows written before the rename call it
    `ideal_speedup`, which is still read."""
    matches_ar: bool | None
    """Temperature 0: identical tokens to `ar`'s on every prompt (for `vllm`: to vLLM's target alone);
    None otherwise."""
    per_prompt: list[PromptResult] | None = None
    """polydraft's rows: each prompt in the group's order (every row of a group decoded the same prompts,
    so the rows pair by position); None for `vllm` rows and rows written before this field."""
    # context
    target: str
    device: str
    hardware: str
    date: str
    """UTC, ISO 8601."""
    torch: str
    transformers: str
    group_rows: int
    """Rows written for the group: a group with fewer rows in the file was torn by a kill."""

    @property
    def group(self) -> tuple[str, str, float, int]:
        return (self.engine, self.dataset, self.temperature, self.seed)


class MethodHeadline(BaseModel):
    """One method at one temperature, averaged over the eval sets that are not out of domain and seeds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    temperature: float
    speedup: float | None
    block_efficiency: float | None


class MeasureMetrics(BaseModel):
    """What the measure stage reports (its manifest's `metrics`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int
    methods: list[MethodHeadline]


class ResultsError(ValueError):
    """A results file whose complete lines are not result rows (another format, or corrupt)."""


def read_rows(path: Path) -> list[ResultRow]:
    """Complete rows of results.jsonl: a torn last line and groups a kill left incomplete are dropped;
    a complete line that is not a row is an error naming the file and line."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the torn end of an interrupted append
                continue
            raise ResultsError(f"{path}:{number}: not valid JSON") from None
        try:
            rows.append(ResultRow.model_validate(data))
        except ValidationError as err:
            raise ResultsError(f"{path}:{number}: not a result row: {err.errors()[0]['msg']}") from None
    counts: dict[tuple, int] = {}
    for row in rows:
        counts[row.group] = counts.get(row.group, 0) + 1
    return [row for row in rows if counts[row.group] == row.group_rows]


def write_rows(path: Path, rows: list[ResultRow]) -> None:
    """Rewrite results.jsonl with these rows (atomically)."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(row.model_dump_json() + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)


def append_rows(path: Path, rows: list[ResultRow]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(row.model_dump_json() + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())
