"""summary.md and PNG plots from the rows of results.jsonl (`decoding.measurement.results.ResultRow`).

Tables are shaped like the seeds' (seed 000 Tables A-D, seed 003 Table 1): one row per method, one
column per dataset x temperature, each cell the mean +- sample std over seeds (repetitions); a cell
measured once says `(n=1)` instead of a spread it does not have; methods measured inside vLLM are
labelled `(vLLM)` and also get a table beside polydraft's own rows, with the differences beyond noise
said in words. Speedup cells carry the latency model's prediction from the measured forward latencies
(`decoding.measurement.latency`) and its error, measured / predicted - 1 (a prediction, not a bound). The in-domain vs out-of-domain table
compares block efficiencies against their pooled spread, and so does the table of local rescoring's gain
over the same proposal heads alone (also paired by seed). Plots: block
efficiency and speedup per dataset and temperature (bars with std error bars), and speedup against
the draft length K for fixed-K chain decoders. Figures are drawn on matplotlib `Figure` objects with
the Agg canvas, so nothing touches pyplot's global state.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

from polydraft.decoding.measurement.metrics import format_cell, mean_std
from polydraft.decoding.measurement.results import ResultRow
from polydraft.decoding.measurement.vllm_report import vllm_section

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


def repetitions(rows: list[Row]) -> str:
    """How many repetitions (seeds) the cells average: `3`, or `1-3` when cells differ."""
    counts = Counter((r.method, r.dataset, r.temperature) for r in rows).values()
    low, high = min(counts, default=0), max(counts, default=0)
    return str(low) if low == high else f"{low}-{high}"


def table(rows: list[Row], metric: str, percent: bool = False, methods: list[str] | None = None) -> str:
    """A markdown table: methods x (dataset, temperature), mean ± std over seeds."""
    columns = _columns(rows)
    cells = _cells(rows, metric)
    header = "| method | " + " | ".join(f"{d} T={t:g}" for d, t in columns) + " |"
    lines = [header, "|" + " --- |" * (len(columns) + 1)]
    for method in methods or _methods(rows):
        values = [format_cell(cells.get((method, d, t)), percent) for d, t in columns]
        lines.append(f"| {method} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def speedup_table(rows: list[Row]) -> str:
    """Measured speedup (mean ± std) with the latency model's prediction and its error (measured / predicted - 1)."""
    columns = _columns(rows)
    measured = _cells(rows, "speedup")
    predicted = _cells(rows, "predicted_speedup")
    header = "| method | " + " | ".join(f"{d} T={t:g}" for d, t in columns) + " |"
    lines = [header, "|" + " --- |" * (len(columns) + 1)]
    for method in _methods(rows):
        values = []
        for d, t in columns:
            cell, model = measured.get((method, d, t)), predicted.get((method, d, t))
            text = format_cell(cell, False)
            if cell is not None and cell[0] is not None and model is not None and model[0]:
                text += f" (predicted {model[0]:.2f}, error {cell[0] / model[0] - 1:+.0%})"
            values.append(text)
        lines.append(f"| {method} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def pooled_std(first: list[float], second: list[float]) -> float | None:
    """The pooled sample standard deviation of two groups (None without 2 values in each)."""
    if len(first) < 2 or len(second) < 2:
        return None
    squares = sum((v - sum(g) / len(g)) ** 2 for g in (first, second) for v in g)
    return math.sqrt(squares / (len(first) + len(second) - 2))


def domain_table(rows: list[Row]) -> str:
    """Block efficiency and speedup of each language-specific drafter's methods on its own pair vs the
    other pairs (seed 003 Fig. 5), with the block-efficiency difference against twice the pooled std."""

    def split() -> dict[bool, list[float]]:
        return {True: [], False: []}

    efficiency: dict[tuple[str, float], dict[bool, list[float]]] = defaultdict(split)
    speedup: dict[tuple[str, float], dict[bool, list[float]]] = defaultdict(split)
    for row in rows:
        if row.in_domain is not None and row.block_efficiency is not None:
            efficiency[(row.method, row.temperature)][row.in_domain].append(row.block_efficiency)
            if row.speedup is not None:
                speedup[(row.method, row.temperature)][row.in_domain].append(row.speedup)
    if not efficiency:
        return "No language-specific drafter was measured on pair-specific eval sets."
    lines = [
        "| method | T | in-domain BE | out-of-domain BE | difference | 2 x pooled std | beyond noise "
        "| in-domain speedup | out-of-domain speedup |",
        "|" + " --- |" * 9,
    ]
    for key, values in sorted(efficiency.items()):
        inside, outside = values[True], values[False]
        cells = [format_cell((*mean_std(values[flag]), len(values[flag])), False) for flag in (True, False)]
        cells += [
            format_cell((*mean_std(speedup[key][flag]), len(speedup[key][flag])), False)
            for flag in (True, False)
        ]
        noise = pooled_std(inside, outside)
        difference = (
            f"{sum(inside) / len(inside) - sum(outside) / len(outside):+.2f}" if inside and outside else "-"
        )
        verdict = (
            "-" if noise is None or difference == "-" else "yes" if float(difference) > 2 * noise else "no"
        )
        spread = "-" if noise is None else f"{2 * noise:.2f}"
        lines.append(
            f"| {key[0]} | {key[1]:g} | {cells[0]} | {cells[1]} | {difference} | {spread} | {verdict} "
            f"| {cells[2]} | {cells[3]} |"
        )
    return "\n".join(lines)


BLOCKWISE = ("bpd", "bpd+rescore", "medusa", "medusa+rescore")


def rescoring_table(rows: list[Row]) -> str:
    """Each `+rescore` method against the same heads without rescoring (seed 000's question: does local
    rescoring raise block efficiency?), per eval set and temperature, seed by seed (with
    `measure.disjoint_prompts` a seed is a set of prompts): the gain against twice the pooled std of the two
    methods' repetitions (unpaired) and against twice the std of the per-seed gains (paired)."""
    alone: dict[tuple, tuple[str, float]] = {}
    for row in rows:
        if (
            row.engine == "polydraft"
            and row.decoder in ("bpd", "medusa")
            and row.block_efficiency is not None
        ):
            alone[(row.decoder, row.drafter, row.dataset, row.temperature, row.seed)] = (
                row.method,
                row.block_efficiency,
            )
    pairs: dict[tuple[str, str, str, float], list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        if row.decoder not in ("bpd+rescore", "medusa+rescore") or row.block_efficiency is None:
            continue
        key = (row.decoder.removesuffix("+rescore"), row.drafter, row.dataset, row.temperature, row.seed)
        if key in alone:
            base, value = alone[key]
            pairs[(row.method, base, row.dataset, row.temperature)].append((row.block_efficiency, value))
    if not pairs:
        return "No `+rescore` decoder was measured beside the same heads alone."
    lines = [
        "| method | against | dataset | T | rescored BE | heads alone BE | gain | 2 x pooled std | beyond "
        "(unpaired) | gain per seed (paired) | beyond (paired) |",
        "|" + " --- |" * 11,
    ]
    for (method, base, dataset, temperature), values in pairs.items():
        rescored, heads = [v[0] for v in values], [v[1] for v in values]
        gains = [a - b for a, b in values]
        gain = sum(gains) / len(gains)
        noise = pooled_std(rescored, heads)
        gain_std = mean_std(gains)[1] if len(gains) > 1 else None
        cells = [
            format_cell((*mean_std(rescored), len(rescored)), False),
            format_cell((*mean_std(heads), len(heads)), False),
            f"{gain:+.2f}",
            "-" if noise is None else f"{2 * noise:.2f}",
            "-" if noise is None else "yes" if gain > 2 * noise else "no",
            f"{gain:+.2f} ± {gain_std:.2f}" if gain_std is not None else f"{gain:+.2f} (n=1)",
            "-" if gain_std is None else "yes" if gain > 2 * gain_std else "no",
        ]
        lines.append(f"| {method} | {base} | {dataset} | {temperature:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blockwise_sections(rows: list[Row]) -> list[str]:
    """Seed 000's Tables A-D: bpd, medusa and their `+rescore` variants (block efficiency, speedup), and
    the rescoring's own cost per round; nothing when no blockwise decoder ran."""
    methods = [m for m in _methods(rows) if any(r.method == m and r.decoder in BLOCKWISE for r in rows)]
    if not methods:
        return []
    rescored = [m for m in methods if any(r.method == m and r.rescorer for r in rows)]
    return [
        "## Blockwise decoders: block efficiency (seed 000 Tables A, C)",
        table(rows, "block_efficiency", methods=methods),
        "",
        "## Blockwise decoders: wall-clock speedup over ar (seed 000 Tables B, D)",
        table(rows, "speedup", methods=methods),
        "",
        "## Local rescoring: the rescoring drafter's time per round (ms)",
        table(rows, "rescore_ms_per_round", methods=rescored) if rescored else "No rescoring measured.",
        "",
        "## Local rescoring against the heads alone (block efficiency gain)",
        rescoring_table(rows),
        "",
    ]


def markdown(rows: list[Row]) -> str:
    first = rows[0]
    seeds = sorted({r.seed for r in rows})
    chain = [m for m in _methods(rows) if m != "ar" and not m.startswith("assisted")]
    mismatched = sorted({(r.method, r.dataset) for r in rows if r.matches_ar is False})
    parts = [
        "# Measured speedups",
        "",
        f"Target `{first.target}` on {first.hardware} ({first.device}), torch {first.torch}, "
        f"transformers {first.transformers}; {first.prompts} prompts per set and seed, up to "
        f"{first.max_new_tokens} new tokens, seeds {seeds}; cells are mean ± std over the seeds "
        f"(n = {repetitions(rows)} repetitions). "
        "Speedup is the token rate over `ar`'s, measured in the same process on the same prompts with "
        "the methods alternating; the predicted speedup is a latency model's, from the measured forward latencies "
        "(`latency.json`): block efficiency x t_target_step / (t_verify(K+1) + K x t_draft_step) per round, "
        "the chain decoders' calls timed inside rounds (a drafter step right after a verification costs "
        "more), the trees' apart.",
        "",
        "## Block efficiency (tokens per target call)",
        table(rows, "block_efficiency"),
        "",
        "## Wall-clock speedup over ar (latency-model prediction; error = measured / predicted - 1)",
        speedup_table(rows),
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
        *blockwise_sections(rows),
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
        *vllm_section(rows, "## vLLM beside polydraft's engine"),
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
        r
        for r in rows
        if r.engine == "polydraft"
        and r.control == "fixed"
        and r.decoder in ("sd", "eesd")
        and r.in_domain is not False
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
