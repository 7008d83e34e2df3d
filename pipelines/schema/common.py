"""Blocks of the recipe shared by several stages: target, data, launch, tracking.

Every field's default lives here and is documented once, in the docstring under it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from polydraft.data.offline import KINDS
from polydraft.data.prompts import PAIRS

LanguagePair = Literal[PAIRS]  # type: ignore[valid-type]
"""A translation direction, source language first (`data.prompts.PAIRS`)."""


class FieldError(ValueError):
    """A check across fields that blames particular keys (dotted paths below the block that checks, the
    offending one first), so that the recipe loader names the file or override that set that value rather
    than the file that declared the block."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


Item = TypeVar("Item")


def _no_duplicates(values: list[Item]) -> list[Item]:
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise ValueError(f"lists a set, each value once: {twice[0]!r} appears twice in {values}")
    return values


UniqueList = Annotated[list[Item], AfterValidator(_no_duplicates)]
"""A list field that names a set (temperatures, seeds, pairs, decoders, ...): a duplicate is an error,
never a silently repeated measurement or a doubled share of the data."""


def _yaml_off(value: Any) -> Any:
    """YAML 1.1 reads an unquoted `off` (in a recipe or a `key=off` override) as false: the switch's `off`."""
    return "off" if value is False else value


VllmSwitch = Annotated[Literal["off", "auto", "require"], BeforeValidator(_yaml_off)]
"""`off`, `auto` (when vLLM can run here) or `require` (fail where it cannot)."""
PositiveInt = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0)]


class StrictModel(BaseModel):
    """Base of every config block: unknown keys and wrong types are errors, never coerced; loaded
    values never change afterwards (a changed copy is made with `model_copy(update=...)`)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, frozen=True)


class ResolvedTarget(StrictModel):
    """The target as stages load it: a local folder or hub id, after any bootstrap build."""

    path: str
    revision: str | None
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    trust_remote_code: bool
    max_memory_per_gpu_gib: float | None = Field(default=None, gt=0)
    """Bytes of target weights each GPU may hold, in GiB, where a stage loads the whole target (measure,
    calibrate, heads, the export's checks). Unset: each GPU's free memory less a reserve of 2 GiB for the KV
    cache and activations. A target within the first GPU's share goes there whole; a larger one is spread over
    the visible GPUs, never splitting a decoder layer (`models.placement`); lower it to leave more room
    for activations."""


class BootstrapConfig(StrictModel):
    """A small Llama-family target built and trained here, for offline demos and tests only.

    The build is cached by the hash of this block (and of the offline corpus options), so later runs
    reuse it instead of training again.
    """

    vocab_size: int = Field(default=2048, ge=1)
    """Size of the byte-level BPE vocabulary trained on the offline corpus."""
    hidden_size: int = Field(default=128, ge=1)
    num_layers: int = Field(default=12, ge=1)
    """Deep and narrow on purpose: on a CPU, batch-1 decode latency grows with depth, not width."""
    num_heads: int = Field(default=4, ge=1)
    intermediate_size: int = Field(default=384, ge=1)
    max_position_embeddings: int = Field(default=512, ge=1)
    steps: int = Field(default=300, ge=1)
    """Optimizer steps of the brief training run on the offline corpus."""
    batch_size: int = Field(default=32, ge=1)
    seq_len: int = Field(default=256, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    seed: int = 0
    pairs: UniqueList[LanguagePair] | None = Field(default=None, min_length=1)
    """The pairs it learns to translate. Unset: `data.pairs`. A demo target can serve more pairs than one
    recipe runs (a study's variants use the others); every `data.pairs` entry must be among them."""
    cache_dir: str = "~/.cache/polydraft/bootstrap"
    """Folder of cached builds, one sub-folder per config hash. A relative path is relative to the recipe
    file that sets it (to the working directory when set by a command-line override)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> BootstrapConfig:
        if self.hidden_size % self.num_heads:
            raise FieldError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}",
                "hidden_size",
            )
        return self


class TargetConfig(StrictModel):
    """The target LLM whose outputs the drafters imitate and whose speedups are measured."""

    path: str | None = None
    """A local Hugging Face folder or a hub id (e.g. `lmsys/vicuna-7b-v1.3`). Exactly one of `path` and
    `bootstrap` is set."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `path` is a hub id."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto` loads bfloat16 on a GPU and float32 on a CPU."""
    trust_remote_code: bool = False
    """Off unless the recipe says so: remote code runs arbitrary Python from the hub."""
    max_memory_per_gpu_gib: float | None = Field(default=None, gt=0)
    """Bytes of target weights each GPU may hold, in GiB, where a stage loads the whole target (measure,
    calibrate, heads, the export's checks). Unset: each GPU's free memory less a reserve of 2 GiB for the KV
    cache and activations. A target within the first GPU's share goes there whole; a larger one is spread over
    the visible GPUs, never splitting a decoder layer (`models.placement`); lower it to leave more room
    for activations."""
    bootstrap: BootstrapConfig | None = None
    """Build a small target here instead of loading one (offline demos and tests)."""

    @model_validator(mode="after")
    def _one_source(self) -> TargetConfig:
        if (self.path is None) == (self.bootstrap is None):
            raise FieldError("set exactly one of target.path and target.bootstrap", "path", "bootstrap")
        return self


OfflineKind = Literal["catalog", "name", "date", "number"]
"""The kinds of entry of the offline corpus (`data.offline.KINDS`)."""


class SourceConfig(StrictModel):
    """One dataset. `kind` says where its rows come from, `format` what a row holds."""

    kind: Literal["offline", "hf", "local"]
    """`offline`: the built-in offline parallel corpus (gettext catalogs, CLDR names and dates,
    spelled-out numbers); `hf`: a `datasets` hub name; `local`: a JSONL/JSON/Parquet file or folder."""
    format: Literal["translation", "chat", "text", "prompts"] = "translation"
    """`translation`: a source sentence and its reference; `chat`: ShareGPT-style conversations;
    `text`: plain documents (pretraining); `prompts`: one prompt per row."""
    path: str | None = None
    """`hf`: the dataset name (e.g. `wmt16`); `local`: the file or folder (a relative path is relative to
    the recipe file that lists the source). Unused for `offline`."""
    name: str | None = None
    """`hf`: the dataset config (e.g. `de-en`)."""
    split: str = "train"
    """Dataset split. For `offline`, `train` and `test` are disjoint deterministic splits."""
    revision: str | None = None
    streaming: bool = False
    """Stream an `hf` dataset instead of downloading it whole (corpora that do not fit, e.g. C4)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Role -> dotted field path in a row. Roles: translation `source`, `target`; chat `conversations`;
    text `text`; prompts `prompt`. Missing roles use the role name itself as the field."""
    pair: LanguagePair | None = None
    """The language pair a `translation` source serves (required for translation)."""
    limit: int | None = Field(default=None, ge=1)
    """Keep at most this many rows, after shuffling with `data.seed`."""
    skip_invalid: bool = False
    """Count and report rows with a missing or empty field instead of failing on the first one."""
    kind_weights: dict[OfflineKind, float] | None = None
    """`offline` translation sources only: this source's mix of entry kinds, replacing
    `data.offline.kind_weights` (which also sets what a bootstrap target is trained on) for it alone;
    kinds left out are not drawn."""
    entries_per_sample: list[int] | None = None
    """`offline` translation sources only: [low, high] entries per sample for this source, replacing
    `data.offline.entries_per_sample` for it alone."""

    @model_validator(mode="after")
    def _check(self) -> SourceConfig:
        if self.kind in ("hf", "local") and not self.path:
            raise ValueError(f"a `{self.kind}` source needs `path`")
        for key in ("kind_weights", "entries_per_sample"):
            if getattr(self, key) is not None and (self.kind != "offline" or self.format != "translation"):
                raise FieldError(f"{key}: only for `offline` translation sources", key)
        if self.kind_weights is not None:
            check_kind_weights(self.kind_weights)
        if self.entries_per_sample is not None:
            check_entries_per_sample(self.entries_per_sample)
        if self.format == "translation" and self.pair is None:
            raise ValueError("a `translation` source needs `pair`")
        return self


class OfflineCorpusConfig(StrictModel):
    """Options of the offline parallel corpus (kind `offline`)."""

    entries_per_sample: list[int] = Field(default_factory=lambda: [2, 4])
    """Each sample joins between these many catalog entries, names, dates and numbers (inclusive),
    so that answers are long enough for drafting to matter."""
    test_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of entries held out for the `test` split (chosen by a hash of the entry, so stable)."""
    samples_per_pair: int = Field(default=4000, ge=1)
    """Number of composite samples generated per language pair and split `train` (a tenth for `test`)."""
    kind_weights: dict[OfflineKind, float] = Field(
        default_factory=lambda: {"catalog": 1.0, "name": 1.0, "date": 1.0, "number": 1.0}
    )
    """How often each kind of entry is drawn: gettext catalog messages, CLDR names, dates, numbers.
    Dates and numbers are systematic (learnable by small models); catalog messages must be memorised."""

    @model_validator(mode="after")
    def _check(self) -> OfflineCorpusConfig:
        check_entries_per_sample(self.entries_per_sample)
        check_kind_weights(self.kind_weights)
        return self


def check_entries_per_sample(bounds: list[int]) -> None:
    if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
        raise ValueError("entries_per_sample: [low, high] with 1 <= low <= high")


def check_kind_weights(weights: dict[str, float]) -> None:
    if any(w < 0 for w in weights.values()) or not any(weights.values()):
        raise ValueError("kind_weights: non-negative, at least one positive")


def reader_args(source: SourceConfig, seed: int, offline: OfflineCorpusConfig | None) -> dict[str, Any]:
    """A recipe source -> the keyword arguments of `data.sources.read_source` (and of the pretraining
    document stream, `train.stream.texts`): the one place where that mapping is written."""
    args: dict[str, Any] = {
        "kind": source.kind,
        "format": source.format,
        "path": source.path,
        "name": source.name,
        "split": source.split,
        "revision": source.revision,
        "streaming": source.streaming,
        "fields": dict(source.fields),
        "pair": source.pair,
        "limit": source.limit,
        "skip_invalid": source.skip_invalid,
        "seed": seed,
    }
    if source.kind == "offline" and offline is not None:
        args |= {
            "offline_entries_per_sample": tuple(source.entries_per_sample or offline.entries_per_sample),
            "offline_test_fraction": offline.test_fraction,
            "offline_samples": offline.samples_per_pair,
            "offline_kind_weights": dict(offline.kind_weights)
            if source.kind_weights is None
            else {kind: source.kind_weights.get(kind, 0.0) for kind in KINDS},
        }
    return args


class DataConfig(StrictModel):
    """Where prompts, training text and evaluation sets come from."""

    pairs: UniqueList[LanguagePair] = Field(default_factory=list)
    """Language pairs of this run; finetune trains one drafter per pair (EESD-only runs may leave it empty)."""
    seed: int = 0
    """Seed of every shuffle and subsample of the data."""
    offline: OfflineCorpusConfig = Field(default_factory=OfflineCorpusConfig)
    distill: list[SourceConfig] = Field(default_factory=list)
    """Prompt sources answered by the target in the distill stage."""
    open: list[SourceConfig] = Field(default_factory=list)
    """Open-source data mixed with the distilled records (seed 001 keeps some)."""
    pretrain: list[SourceConfig] = Field(default_factory=list)
    """Generic corpora for drafter pretraining (C4, ShareGPT, ...)."""
    eval: list[SourceConfig] = Field(default_factory=list)
    """Held-out evaluation sets for the measure stage."""


class LaunchConfig(StrictModel):
    """How training stages are launched: a subprocess through `accelerate launch`."""

    accelerate_config: str = "recipes/accelerate/single.yaml"
    """An accelerate config file (single process, DDP, FSDP, DeepSpeed ZeRO-2/3, multi-node).
    A relative path is looked up from the working directory, then from the package's recipes."""
    num_processes: int | None = Field(default=None, ge=1)
    """Training processes on each node (one per GPU). Unset: the config file's `num_processes` (accelerate's
    count over all its `num_machines`) divided by its `num_machines`. On N nodes polydraft starts N times
    this many: accelerate's own `--num_processes` is the total, which polydraft computes."""
    collective_timeout_s: int | None = Field(default=None, ge=60)
    """How long a training process waits for the others in a collective (torch.distributed's timeout).
    Unset: 30 minutes, or 3 times the work rank 0 does alone before the others go on (tokenizing the mix
    into the cache they read: its bytes at `pipelines.runtime.cluster.TOKENIZE_BYTES_PER_S`), whichever is longer. Each
    launch logs the value and why."""
    cpu: bool = False
    """Train on the CPU even when a GPU exists. Multi-process CPU runs use gloo DDP."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the training processes."""


class AccelerateFile(BaseModel):
    """What polydraft reads of the accelerate config file `launch.accelerate_config` names, with accelerate's
    own default for a key the file leaves out; every other key is accelerate's alone."""

    model_config = ConfigDict(extra="allow", frozen=True)

    distributed_type: str = "NO"
    num_machines: int = 1
    num_processes: int = 1
    """accelerate's count over all its `num_machines`."""
    machine_rank: int = 0

    @classmethod
    def read(cls, path: Path) -> AccelerateFile:
        return cls.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")) or {})


class RunnerConfig(StrictModel):
    """How the runner schedules the stages (it changes no stage's output, so no stage's key)."""

    parallel_stages: int = Field(default=1, ge=1)
    """Training stages that do not depend on each other run side by side, up to this many at once (on the
    demo's DAG: eagle3 beside pretrain -> finetune -> early_exit -> calibrate), the machine's CPU cores
    shared among them (`--num_cpu_threads_per_process`). For small models on a few CPU cores: one-thread
    processes side by side get more done than one on every core (bench/results/parallel_stages.md). 1: one
    stage at a time, as on a GPU node, where each training launch takes every GPU. Stages run one at a
    time whatever this says with `--in-process` or on several nodes."""


class TrackingConfig(StrictModel):
    """Weights & Biases tracking: one run per stage, grouped per pipeline run."""

    project: str = "polydraft"
    entity: str | None = None
    run_name: str | None = None
    """Name of the run group; defaults to the run directory's name."""
    tags: UniqueList[str] = Field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] = "offline"
    """`offline` writes a local run folder under `<run_dir>/wandb` that `wandb sync` can upload later."""
    model_artifacts: bool = False
    """Log every exported folder (weights, tokenizer, card, results.json) as a wandb `model` artifact
    named after its repo name. Off by default: each run would upload every checkpoint again. Read when
    the export stage runs: turning it on later does not redo a completed export (`--only export --force`)."""
