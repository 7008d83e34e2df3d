"""The study's report: `report.md` (titled with how many of the seeds' findings are reproduced,
contradicted and open; a summary table of the findings with each one's checks that hold, are contradicted
and are open, the sanity checks apart; then per finding the seed's numbers, each check's arms per prompt
(mean ± std, n), the interval of the paired difference, the smallest effect it could have detected beside
the seed's own, a plot and the verdict), `plots/<finding>.png`, and `study.json` (the same, machine-readable). Figures are drawn on matplotlib `Figure` objects with the Agg
canvas, so nothing touches pyplot's global state."""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polydraft.pipelines.runtime.contract import PROJECT_ROOT
from polydraft.pipelines.runtime.manifest import git_state, write_json_atomic
from polydraft.pipelines.runtime.nodes import usable_cores
from polydraft.pipelines.study import verdicts
from polydraft.pipelines.study.model import Finding, Panel
from polydraft.pipelines.study.verdicts import Check

REPORT = "report.md"
PLOTS = "plots"


@dataclass
class VariantRecord:
    """What one variant did in this study run."""

    name: str
    purpose: str
    overrides: list[str]
    command: str = ""
    """The `polydraft run` command that reproduces this variant alone."""
    status: str = "ok"
    seconds: float = 0.0
    """Wall time of this variant in this invocation."""
    ran: list[str] = field(default_factory=list)
    """Stages that ran in this invocation (the others were up to date, or copied from another variant)."""
    made: dict[str, float] = field(default_factory=dict)
    """Stage -> seconds (its manifest's duration) of each stage folder this variant made itself."""
    shared: dict[str, str] = field(default_factory=dict)
    """Stage -> the variant whose folder this variant holds a copy of."""


def _side(name: str, stat: verdicts.Stat | None) -> str:
    return f"{name} -" if stat is None else f"{name} {stat.mean:.3f} ± {stat.std:.3f} (n={stat.n})"


def measured_cell(checks: list[Check], shown: int = 2) -> str:
    """The first checks' numbers, for the summary table."""
    if not checks:
        return "-"
    parts = [f"{_side(c.first, c.a)} vs {_side(c.second, c.b)}" for c in checks[:shown]]
    more = f"; … {len(checks)} checks in all" if len(checks) > shown else ""
    return "; ".join(parts) + more


def _detectable(check: Check) -> str:
    """What the check could have found at 80% power, beside the seed's own effect."""
    found = "-" if check.interval is None else f"{check.interval.detectable:.3f}"
    return found if check.seed_effect is None else f"{found} (seed: {check.seed_effect:+.3f})"


def checks_table(checks: list[Check]) -> str:
    lines = [
        "| check | first (per prompt) | second (per prompt) | paired difference [interval] | "
        "detectable (the seed's effect) | outcome |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in checks:
        interval = "-" if c.interval is None else f"{c.interval.text()}, {c.interval.prompts} prompts"
        lines.append(
            f"| {cell(c.label)} | {_side(c.first, c.a)} | {_side(c.second, c.b)} | {interval} "
            f"| {_detectable(c)} | {c.outcome} |"
        )
    return "\n".join(lines)


def _bars(checks: list[Check], path: Path, title: str, quantity: str) -> None:
    from matplotlib.figure import Figure

    shown = [c for c in checks if c.a is not None and c.b is not None]
    figure = Figure(figsize=(max(6.0, 1.1 * len(shown) + 2), 4.5))
    axes = figure.add_subplot()
    for offset, side in ((-0.2, "a"), (0.2, "b")):
        stats = [getattr(c, side) for c in shown]
        axes.bar(
            [i + offset for i in range(len(shown))], [s.mean for s in stats], width=0.38,
            yerr=[s.std for s in stats], capsize=3,
            label="first (claimed larger)" if side == "a" else "second",
        )  # fmt: skip
    axes.set_xticks(range(len(shown)), [c.label for c in shown], rotation=30, ha="right", fontsize=7)
    axes.set_title(title, fontsize=9)
    axes.set_ylabel(quantity)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _panels(panels: list[Panel], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.0 * len(panels) + 1, 4.2))
    for index, panel in enumerate(panels, 1):
        axes = figure.add_subplot(1, len(panels), index)
        for series in panel.series:
            if series.style == "points":
                axes.scatter(series.x, series.y, s=14, label=series.label)
            elif series.style == "hline":
                axes.plot(series.x, series.y, linestyle="--", label=series.label)
            else:
                axes.errorbar(series.x, series.y, yerr=series.yerr, marker="o", capsize=3, label=series.label)
        if panel.log_x:
            axes.set_xscale("log")
        axes.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def draw(finding: Finding, folder: Path) -> str | None:
    """The finding's plot (its panels, else a bar per side of each check); None without numbers."""
    path = folder / f"{finding.key}.png"
    if finding.panels and any(s.x for p in finding.panels for s in p.series):
        _panels(finding.panels, path)
    elif any(c.a is not None and c.b is not None for c in finding.checks):
        _bars(finding.checks, path, finding.title, finding.quantity)
    else:
        return None
    return f"{PLOTS}/{path.name}"


def section(number: int, finding: Finding, plot: str | None) -> str:
    parts = [
        f"### {number}. {finding.title} (`{finding.key}`)",
        "",
        f"**Verdict: {finding.verdict}** — {finding.reason}",
        "",
        f"- Seed claim: {finding.claim}"
        if finding.seed_claim
        else f"- {label(finding).strip(' ()')}: {finding.claim}",
        f"- Seed: {finding.source}. {finding.seed_numbers}",
        f"- Measured: {finding.metric}; variants {', '.join(f'`{v}`' for v in finding.variants) or '-'}.",
        "",
    ]
    if finding.checks:
        parts += [checks_table(finding.checks), ""]
    if finding.details:
        parts += [finding.details, ""]
    if plot:
        parts += [f"![{finding.key}]({plot})", ""]
    return "\n".join(parts)


def variants_table(records: list[VariantRecord]) -> str:
    lines = [
        "| variant | what | status | stages it made (s, from their manifests) | stages copied from |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in records:
        made = ", ".join(f"{s} {t:.0f}" for s, t in r.made.items()) or "-"
        shared = ", ".join(f"{s} (`{v}`)" for s, v in r.shared.items()) or "-"
        lines.append(f"| `{r.name}` | {cell(r.purpose)} | {cell(r.status)} | {made} | {shared} |")
    return "\n".join(lines)


def label(finding: Finding) -> str:
    """What a finding is when it is no headline seed claim, for titles and tables."""
    if finding.side_remark:
        return " (**a seed's side remark**, counted apart)"
    return "" if finding.seed_claim else " (**not a seed claim**)"


def summary_table(findings: list[Finding], first: int) -> list[str]:
    """The summary's rows, numbered from `first`: the report's and docs/study.md's (`bench/study_docs.py`)."""
    lines = [
        "| # | finding | seed | measured (mean ± std over prompts, n) | checks: holds / contradicted / open "
        "| verdict | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for number, f in enumerate(findings, first):
        held, against, unsettled = verdicts.counts(f.checks)
        lines.append(
            f"| {number} | `{f.key}`: {cell(f.title)}{label(f)} | {cell(f.source)} | "
            f"{cell(measured_cell(f.checks))} | {held} / {against} / {unsettled} | **{f.verdict}** | {cell(f.reason)} |"
        )
    return lines


def headline(findings: list[dict]) -> str:
    """How many of the seeds' findings (as in `study.json`) are reproduced, contradicted and open, e.g. `1 of
    the seeds' 12 findings reproduced, 3 contradicted, 8 open`: the report's title and the heading of
    docs/study.md (tests/pipelines/test_study.py holds that heading to bench/results/study.json)."""
    claims = [f["verdict"] for f in findings if f.get("seed_claim", True)]
    reproduced, contradicted = claims.count("reproduced"), claims.count("not reproduced")
    return (
        f"{reproduced} of the seeds' {len(claims)} findings reproduced, {contradicted} contradicted, "
        f"{len(claims) - reproduced - contradicted} open"
    )


def tally(findings: list[Finding]) -> str:
    """How many of the seeds' claims got each verdict, e.g. `2 reproduced, 0 consistent, ...` (a seed's side
    remark and the study items that are no seed claim are counted apart)."""
    claims = [f for f in findings if f.seed_claim]
    counts = ", ".join(f"{sum(f.verdict == v for f in claims)} {v}" for v in verdicts.VERDICTS)
    apart = [f"`{f.key}` {f.verdict}" for f in findings if not f.seed_claim]
    return f"Of the seeds' {len(claims)} findings: {counts}" + (
        f"; counted apart ({len(apart)}: a seed's side remark and study items that are no seed claim, labelled "
        f"so): {', '.join(apart)}."
        if apart
        else "."
    )


def claims_table(findings: list[Finding]) -> str:
    """Finding -> the seed claim it tests, in the seed's words and setting, and what the study measures."""
    lines = [
        "| finding | seed | the seed's claim (its setting) | measured here |",
        "| --- | --- | --- | --- |",
    ]
    for f in findings:
        claim = f.claim if f.seed_claim else f"{label(f).strip(' ()')}: {f.claim}"
        lines.append(f"| `{f.key}` | {cell(f.source)} | {cell(claim)} | {cell(f.metric)} |")
    return "\n".join(lines)


def write_report(
    study_dir: Path,
    findings: list[Finding],
    sanity: list[Finding],
    records: list[VariantRecord],
    *,
    command: str,
    quick: bool,
    total_seconds: float,
) -> Path:
    """Write report.md, plots/ and study.json into `study_dir`; returns the report's path. `findings` are
    the seeds' claims, `sanity` the sanity checks (reported apart, never counted among the findings)."""
    folder = study_dir / PLOTS
    folder.mkdir(parents=True, exist_ok=True)
    plots = {f.key: draw(f, folder) for f in [*findings, *sanity]}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    git = git_state(PROJECT_ROOT)
    head = [
        f"# polydraft study: {headline([f.model_dump() for f in findings])}",
        "",
        f"- Command: `{command}`" + (" (`--quick`: tiny models; the numbers mean nothing)" if quick else ""),
        f"- Date: {date}; machine: {_machine()}, Python {platform.python_version()}; git {git.get('commit')}"
        + (" (dirty)" if git.get("dirty") else ""),
        f"- Time: {sum(sum(r.made.values()) for r in records):.0f} s of stages, each stage folder made once "
        f"and copied where its key recurs (the variants table); this invocation took {total_seconds:.0f} s",
        "",
        "## Summary",
        "",
        tally(findings),
        "",
        *summary_table(findings, 1),
        "",
        "Sanity checks (they cannot come out otherwise when the code is right, so they are no finding):",
        "",
        *summary_table(sanity, len(findings) + 1),
        "",
        "## Finding → seed claim",
        "",
        claims_table(findings),
        "",
        "## The rule",
        "",
        " ".join(line.strip() for line in (verdicts.__doc__ or "").strip().splitlines()),
        "",
        "## Findings",
        "",
        *(section(n, f, plots[f.key]) for n, f in enumerate(findings, 1)),
        "## Sanity checks",
        "",
        *(section(n, f, plots[f.key]) for n, f in enumerate(sanity, len(findings) + 1)),
        "## Variants",
        "",
        "Each variant is the recipe plus overrides, in its own run directory; rerun one alone with its "
        "command in `study.json`. A stage whose key another variant already made is copied, not rerun.",
        "",
        variants_table(records),
        "",
    ]
    path = study_dir / REPORT
    path.write_text("\n".join(head), encoding="utf-8")
    write_json_atomic(
        study_dir / "study.json",
        {
            "command": command,
            "date": date,
            "quick": quick,
            "total_seconds": round(total_seconds, 1),
            "variants": [asdict(r) for r in records],
            "findings": [f.model_dump() for f in findings],
            "sanity_checks": [f.model_dump() for f in sanity],
        },
    )
    return path


def _machine() -> str:
    """The CPU model and the cores this process may use (and the GPU, when there is one)."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        model = names[0] if names else model
    text = f"{model}, {usable_cores()} cores"
    import torch

    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def cell(text: str) -> str:
    """Text for a markdown table cell (a `|` would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ")
