"""summary.md and PNG plots from the rows of results.jsonl (`decoding.results.ResultRow`).

Tables are shaped like the seeds' (seed 000 Tables A-D, seed 003 Table 1): one row per method, one
column per dataset x temperature, each cell the mean +- sample std over seeds. Plots: block
efficiency and speedup per dataset and temperature (bars with std error bars), and speedup against
the draft length K for fixed-K chain decoders. Figures are drawn on matplotlib `Figure` objects with
the Agg canvas, so nothing touches pyplot's global state.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from decoding.metrics import mean_std
from decoding.results import ResultRow

Row = ResultRow


def _columns(rows: list[Row]) -> list[tuple[str, float]]:
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    temperatures = sorted({r.temperature for r in rows})
    return [(d, t) for d in datasets for t in temperatures]


def _methods(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.method for r in rows))


def _cells(
    rows: list[Row], metric: str
) -> dict[tuple[str, str, float], tuple[float | None, float | None, int]]:
    """(method, dataset, temperature) -> (mean, std, number of seeds) of a metric."""
    values: dict[tuple[str, str, float], list[float | None]] = defaultdict(list)
    for row in rows:
        values[(row.method, row.dataset, row.temperature)].append(getattr(row, metric))
    return {key: (*mean_std(v), len(v)) for key, v in values.items()}


def _format(cell: tuple[float | None, float | None, int] | None, percent: bool) -> str:
    if cell is None or cell[0] is None:
        return "-"
    mean, std, _ = cell
    if percent:
        return f"{mean:.1%} ± {std:.1%}"
    return f"{mean:.2f} ± {std:.2f}"


def table(rows: list[Row], metric: str, percent: bool = False, methods: list[str] | None = None) -> str:
    """A markdown table: methods x (dataset, temperature), mean ± std over seeds."""
    columns = _columns(rows)
    cells = _cells(rows, metric)
    header = "| method | " + " | ".join(f"{d} T={t:g}" for d, t in columns) + " |"
    lines = [header, "|" + " --- |" * (len(columns) + 1)]
    for method in methods or _methods(rows):
        values = [_format(cells.get((method, d, t)), percent) for d, t in columns]
        lines.append(f"| {method} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def domain_table(rows: list[Row]) -> str:
    """Speedup of each language-specific drafter's methods on its own pair vs the other pairs (seed 003 Fig. 5)."""
    values: dict[tuple[str, float], dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
    for row in rows:
        if row.in_domain is not None and row.speedup is not None:
            values[(row.method, row.temperature)][row.in_domain].append(row.speedup)
    if not values:
        return "No language-specific drafter was measured on pair-specific eval sets."
    lines = ["| method | T | in-domain speedup | out-of-domain speedup |", "| --- | --- | --- | --- |"]
    for (method, temperature), split in sorted(values.items()):
        cells = [_format((*mean_std(split[flag]), len(split[flag])), False) for flag in (True, False)]
        lines.append(f"| {method} | {temperature:g} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def markdown(rows: list[Row]) -> str:
    first = rows[0]
    seeds = sorted({r.seed for r in rows})
    chain = [m for m in _methods(rows) if m != "ar" and not m.startswith("assisted")]
    mismatched = sorted({(r.method, r.dataset) for r in rows if r.matches_ar is False})
    parts = [
        "# Measured speedups",
        "",
        f"Target `{first.target}` on {first.hardware} ({first.device}), torch {first.torch}, "
        f"transformers {first.transformers}; {first.prompts} prompts per set, up to "
        f"{first.max_new_tokens} new tokens, seeds {seeds}; cells are mean ± std over seeds. "
        "Speedup is the token rate over `ar`'s, measured in the same process on the same prompts with "
        "the methods alternating.",
        "",
        "## Block efficiency (tokens per target call)",
        table(rows, "block_efficiency"),
        "",
        "## Wall-clock speedup over ar",
        table(rows, "speedup"),
        "",
        "## MBSU (memory-bound speedup, seed 002 C.2)",
        table(rows, "mbsu"),
        "",
        "## Token rate (tokens/s)",
        table(rows, "token_rate"),
        "",
        "## Acceptance rate v_d (accepted / drafted tokens)",
        table(rows, "acceptance_rate", percent=True, methods=chain),
        "",
        "## Draft proportion r_d (accepted draft tokens / output tokens)",
        table(rows, "draft_proportion", percent=True, methods=chain),
        "",
        "## HM = 2 v_d r_d / (v_d + r_d) (seed 001 App. D)",
        table(rows, "hm", percent=True, methods=chain),
        "",
        "## Engine overhead (share of wall time outside the models' forward passes)",
        table(rows, "overhead_share", percent=True),
        "",
        "## In-domain vs out-of-domain",
        domain_table(rows),
        "",
        "## Losslessness at temperature 0",
        (
            "Every method produced exactly `ar`'s tokens on every prompt."
            if not mismatched
            else "Outputs that differ from `ar`'s (numerical ties in low precision can cause this): "
            + ", ".join(f"{m} on {d}" for m, d in mismatched)
        )
        if any(r.temperature == 0 for r in rows)
        else "No greedy (temperature 0) measurement in this run.",
        "",
    ]
    return "\n".join(parts)


def _bars(rows: list[Row], metric: str, title: str, path: Path) -> None:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    palette = colormaps["tab20"]
    temperatures = sorted({r.temperature for r in rows})
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    methods = _methods(rows)
    cells = _cells(rows, metric)
    figure = Figure(figsize=(max(6.0, 1.2 * len(datasets) * len(temperatures) + 3), 4.5))
    axes = figure.subplots(1, len(temperatures), squeeze=False)[0]
    width = 0.8 / max(1, len(methods))
    for ax, temperature in zip(axes, temperatures, strict=True):
        for j, method in enumerate(methods):
            xs, ys, errors = [], [], []
            for i, dataset in enumerate(datasets):
                cell = cells.get((method, dataset, temperature))
                if cell is not None and cell[0] is not None:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(cell[0])
                    errors.append(cell[1] or 0.0)
            ax.bar(xs, ys, width, yerr=errors, capsize=2, label=method, color=palette(j % 20))
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(f"{title}, T={temperature:g}")
    axes[-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _speedup_vs_k(rows: list[Row], path: Path) -> bool:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fixed = [
        r for r in rows if r.control == "fixed" and r.decoder in ("sd", "eesd") and r.in_domain is not False
    ]
    if not fixed:
        return False
    temperatures = sorted({r.temperature for r in fixed})
    figure = Figure(figsize=(5.0 * len(temperatures) + 2, 4.0))
    axes = figure.subplots(1, len(temperatures), squeeze=False)[0]
    lines: dict[tuple[str, float], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in fixed:
        family = row.method.rsplit(" K=", 1)[0]
        if row.speedup is not None:
            lines[(f"{family} on {row.dataset}", row.temperature)][row.draft_length].append(row.speedup)
    for ax, temperature in zip(axes, temperatures, strict=True):
        for (label, t), points in sorted(lines.items()):
            if t != temperature:
                continue
            ks = sorted(points)
            means = [mean_std(points[k])[0] for k in ks]
            stds = [mean_std(points[k])[1] for k in ks]
            ax.errorbar(ks, means, yerr=stds, marker="o", capsize=2, label=label)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft length K")
        ax.set_ylabel("speedup over ar")
        ax.set_title(f"T={temperature:g}")
    axes[-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def write_report(rows: list[Row], folder: Path) -> list[Path]:
    """Write summary.md and the plots into `folder`; returns the files written."""
    folder = Path(folder)
    if not rows:
        (folder / "summary.md").write_text("# Measured speedups\n\nNothing was measured.\n", encoding="utf-8")
        return [folder / "summary.md"]
    (folder / "summary.md").write_text(markdown(rows), encoding="utf-8")
    written = [folder / "summary.md", folder / "block_efficiency.png", folder / "speedup.png"]
    _bars(rows, "block_efficiency", "block efficiency", written[1])
    _bars(rows, "speedup", "speedup over ar", written[2])
    if _speedup_vs_k(rows, folder / "speedup_vs_k.png"):
        written.append(folder / "speedup_vs_k.png")
    return written
