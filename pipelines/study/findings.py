"""The findings of the seed papers that the study reproduces, each computed from the rows of the variants
that measure it and judged by the one rule of `pipelines.study.verdicts`, and the sanity checks.

Every finding names the seed's table or figure, quotes its claim and numbers (typed in from
`../shared/seeds/`) in the seed's setting, says which metric it compares and how, and returns its checks;
a study item that is no seed claim says so (`seed_claim=False`). The findings live by seed:
`findings_drafters` (seed 003), `findings_eesd` (seed 001), `findings_trees` (seeds 002 and 000), and the
seeds' headline tables that only `make study-full` measures, `findings_headline` (seeds 001, 002 and 003)
and `findings_thompson` (seed 001's controls on long answers, its ablations and exit layers).
"""

from __future__ import annotations

from typing import get_args

from polydraft.decoding.measurement.results import DecoderName
from polydraft.pipelines.study.findings_drafters import (
    distill_temperatures,
    finetune_tokens,
    in_domain,
    input_domain,
    pf_over_f,
    pf_over_p,
    pf_over_p_budgets,
)
from polydraft.pipelines.study.findings_eesd import (
    cali_over_beta,
    exit_layer,
    shared_layers,
    thompson_eesd,
    thompson_standalone,
)
from polydraft.pipelines.study.findings_headline import (
    drafter_size,
    eesd_vs_baselines,
    sd_vs_medusa,
    trees_lengths,
)
from polydraft.pipelines.study.findings_thompson import (
    beta_literal,
    cali_ablations,
    exit_layers_two,
    self_distillation,
    thompson_long,
)
from polydraft.pipelines.study.findings_trees import rescoring, rsd_budget, rsd_budget_low, trees
from polydraft.pipelines.study.model import Finding, Panel, Runs, finish, ok
from polydraft.pipelines.study.verdicts import Check, Stat, stat


def lossless(runs: Runs) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows = [r for data in runs.values() for r in data.rows if r.temperature == 0 and r.decoder != "ar"]
        checks = []
        for decoder in dict.fromkeys(r.decoder for r in rows):
            same = [1.0 if r.matches_ar else 0.0 for r in rows if r.decoder == decoder]
            share = stat(same)
            if share is None:
                continue
            checks.append(
                Check(
                    label=f"{decoder}: output identical to ar at T=0", claim="==", first="identical",
                    second="all", a=share, b=Stat(mean=1.0, std=0.0, n=len(same)), first_values=[],
                    second_values=[], interval=None, outcome="holds" if all(same) else "contradicted",
                )
            )  # fmt: skip
        unmeasured = [d for d in get_args(DecoderName) if d != "ar" and d not in {r.decoder for r in rows}]
        details = (
            f"Decoders no variant measured at T=0: {', '.join(f'`{d}`' for d in unmeasured) or 'none'}. "
            "T > 0: sampled outputs differ from `ar`'s by design, so the study does not recheck them; the "
            "proofs are the exact tests (`tests/decoding/test_decoding_exact.py`: each verification step gives the "
            "target's distribution to 1e-6) and the distribution tests (`tests/decoding/test_decoding_distribution.py`)."
        )
        return checks, details, []

    return finish(
        "lossless",
        "every decoder is lossless: at T=0 identical to `ar` token for token (T > 0 by the proofs)",
        "sanity check; seeds 000, 001, 002 (speculative sampling preserves the target's distribution)",
        "speculative sampling returns the target's distribution (seed 002 Theorem 3.1)",
        "Every seed's decoders are exact: greedy outputs equal the target's, sampled ones follow its "
        "distribution (seed 002 Theorem 3.1 for recursive rejection sampling).",
        "share of rows (every variant, eval set and seed at T=0) whose tokens equal `ar`'s",
        [name for name in runs if ok(runs, name)],
        runs,
        build,
        quantity="share of rows identical to ar",
        sanity=True,
    )


def sanity_checks(runs: Runs) -> list[Finding]:
    """Checks that cannot come out otherwise when the code is right, reported apart from the findings."""
    return [lossless(runs)]


def all_findings(
    runs: Runs, draft_length: int, pairs: list[str], shared_layers_n: int, drafter_depth: int | None = None
) -> list[Finding]:
    """The seeds' findings by seed (003, 001, 002, 000), then a seed's side remark and the study items that
    are no seed claim; the sanity checks are in `sanity_checks`. `drafter_depth`: the recipe's drafter
    layers (None: 1), the smallest of the drafter-size finding's depths."""
    k = draft_length
    return [
        pf_over_p(runs, k, pairs),
        pf_over_f(runs, k, pairs),
        in_domain(runs, k, pairs),
        input_domain(runs, k),
        finetune_tokens(runs, k, pairs),
        sd_vs_medusa(runs, k),
        drafter_size(runs, k, pairs, drafter_depth),
        eesd_vs_baselines(runs),
        exit_layer(runs),
        exit_layers_two(runs),
        self_distillation(runs),
        shared_layers(runs, shared_layers_n),
        thompson_eesd(runs, best=False),
        cali_over_beta(runs),
        thompson_eesd(runs, best=True),
        thompson_long(runs, cali=False),
        thompson_long(runs, cali=True),
        cali_ablations(runs),
        thompson_standalone(runs, pairs, best=False),
        trees(runs, pairs),
        trees_lengths(runs, pairs),
        rsd_budget(runs, pairs),
        rescoring(runs, "block_efficiency"),
        rescoring(runs, "speedup"),
        rsd_budget_low(runs, pairs),
        pf_over_p_budgets(runs, k, pairs),
        thompson_standalone(runs, pairs, best=True),
        beta_literal(runs),
        distill_temperatures(runs, k, pairs),
    ]
