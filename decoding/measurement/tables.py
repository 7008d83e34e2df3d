"""summary.md and PNG plots from the rows of results.jsonl (`decoding.measurement.results.ResultRow`).

Tables are shaped like the seeds' (seed 000 Tables A-D, seed 003 Table 1): one row per method, one
column per dataset x temperature, each cell the mean +- sample std over seeds (repetitions); a cell
measured once says `(n=1)` instead of a spread it does not have; methods measured inside vLLM are
labelled `(vLLM)` and also get a table beside polydraft's own rows, with the differences beyond noise
said in words. Speedup cells carry the latency model's prediction from the measured forward latencies
(`decoding.measurement.latency`) and its error, measured / predicted - 1 (a prediction, not a bound). The in-domain vs out-of-domain table
and the table of local rescoring's gain over the same proposal heads alone decide their differences by
the one paired rule (`decoding.measurement.claims.paired_interval`) on the rows' per-prompt values. Plots: block
efficiency and speedup per dataset and temperature (bars with std error bars), and speedup against
the draft length K for fixed-K chain decoders. Figures are drawn on matplotlib `Figure` objects with
the Agg canvas, so nothing touches pyplot's global state.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from polydraft.decoding.measurement.claims import LEVEL, paired_interval
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


NOT_PAIRED = "no per-prompt values (rows written before them, or vLLM's)"
"""Why a table row has no interval: the paired rule needs every prompt's value."""


def _paired_cells(differences: dict[int, list[float]], how: str) -> list[str]:
    """The mean difference A - B with its interval, the smallest difference it could have detected, and
    the outcome of the claim A > B (`how` the arms were paired), by the one rule
    (`claims.paired_interval`); `differences`: prompt position -> its differences, one per repetition."""
    interval = paired_interval({0: differences})
    if interval is None:
        return ["-", "-", "too few prompts"]
    return [
        f"{interval.mean:+.2f} [{interval.low:+.2f}, {interval.high:+.2f}]",
        f"{interval.detectable:.2f}",
        f"{interval.outcome('>')} ({how})",
    ]


def _positions(rows: list[Row]) -> dict[tuple[int, int], list[float]] | None:
    """Block efficiency per (repetition, prompt position) over `rows` (one list per key, a value per eval
    set); None when a row lacks per-prompt values."""
    values: dict[tuple[int, int], list[float]] = defaultdict(list)
    for row in rows:
        if row.per_prompt is None:
            return None
        for position, result in enumerate(row.per_prompt):
            values[row.seed, position].append(result.block_efficiency)
    return values


def domain_table(rows: list[Row]) -> str:
    """Block efficiency and speedup of each language-specific drafter's methods on its own pair vs the
    other pairs (seed 003 Fig. 5), the block-efficiency difference decided by the paired rule
    (`claims.paired_interval`). The two arms decode different eval sets, so no prompt is in both: the
    differences are taken prompt position by position (the mean over the other pairs' eval sets at that
    position), between independent prompts, so each difference carries both arms' spread across prompts
    and the interval is as wide as an unpaired one (the study's in vs out-of-domain checks do the same,
    `pipelines.study.arms`). A position's repetitions are one unit: with the default shared prompts they
    decoded the same prompt, with `measure.disjoint_prompts` different ones, then fewer units than
    prompts and a wider interval, never a narrower one."""

    def split() -> dict[bool, list[Row]]:
        return {True: [], False: []}

    arms: dict[tuple[str, float], dict[bool, list[Row]]] = defaultdict(split)
    for row in rows:
        if row.engine == "polydraft" and row.in_domain is not None and row.block_efficiency is not None:
            arms[(row.method, row.temperature)][row.in_domain].append(row)
    if not arms:
        return "No language-specific drafter was measured on pair-specific eval sets."
    lines = [
        f"| method | T | in-domain BE | out-of-domain BE | difference [{LEVEL:.0%} interval] | detectable "
        "| in > out | in-domain speedup | out-of-domain speedup |",
        "|" + " --- |" * 9,
    ]
    for key, by_flag in sorted(arms.items()):
        cells = []
        for metric in ("block_efficiency", "speedup"):
            for flag in (True, False):
                values = [getattr(r, metric) for r in by_flag[flag] if getattr(r, metric) is not None]
                cells.append(format_cell((*mean_std(values), len(values)), False))
        inside, outside = _positions(by_flag[True]), _positions(by_flag[False])
        if not by_flag[True] or not by_flag[False]:
            decided = ["-", "-", "-"]
        elif inside is None or outside is None:
            decided = ["-", "-", NOT_PAIRED]
        else:
            differences: dict[int, list[float]] = defaultdict(list)
            for (repetition, position), values in sorted(inside.items()):
                other = outside.get((repetition, position))
                if other:
                    differences[position].append(sum(values) / len(values) - sum(other) / len(other))
            decided = _paired_cells(dict(differences), "independent prompts, by position")
        lines.append(
            f"| {key[0]} | {key[1]:g} | {cells[0]} | {cells[1]} | " + " | ".join(decided)
            + f" | {cells[2]} | {cells[3]} |"
        )  # fmt: skip
    return "\n".join(lines)


BLOCKWISE = ("bpd", "bpd+rescore", "medusa", "medusa+rescore")


def rescoring_table(rows: list[Row]) -> str:
    """Each `+rescore` method against the same heads without rescoring (seed 000's question: does local
    rescoring raise block efficiency?), per eval set and temperature: both decoded the same prompts in the
    same group, so each prompt's block-efficiency gain is paired (prompt position -> one gain per
    repetition) and decided by the paired rule (`claims.paired_interval`)."""
    alone: dict[tuple, Row] = {}
    for row in rows:
        if (
            row.engine == "polydraft"
            and row.decoder in ("bpd", "medusa")
            and row.block_efficiency is not None
        ):
            alone[(row.decoder, row.drafter, row.dataset, row.temperature, row.seed)] = row
    pairs: dict[tuple[str, str, str, float], list[tuple[Row, Row]]] = defaultdict(list)
    for row in rows:
        if row.decoder not in ("bpd+rescore", "medusa+rescore") or row.block_efficiency is None:
            continue
        key = (row.decoder.removesuffix("+rescore"), row.drafter, row.dataset, row.temperature, row.seed)
        if key in alone:
            pairs[(row.method, alone[key].method, row.dataset, row.temperature)].append((row, alone[key]))
    if not pairs:
        return "No `+rescore` decoder was measured beside the same heads alone."
    lines = [
        f"| method | against | dataset | T | rescored BE | heads alone BE | gain [{LEVEL:.0%} interval, paired "
        "by prompt] | detectable | rescored > alone |",
        "|" + " --- |" * 9,
    ]
    for (method, base, dataset, temperature), matched in pairs.items():
        rescored = [a.block_efficiency for a, _ in matched if a.block_efficiency is not None]
        heads = [b.block_efficiency for _, b in matched if b.block_efficiency is not None]
        cells = [format_cell((*mean_std(v), len(v)), False) for v in (rescored, heads)]
        if any(a.per_prompt is None or b.per_prompt is None for a, b in matched):
            decided = ["-", "-", NOT_PAIRED]
        else:
            gains: dict[int, list[float]] = defaultdict(list)
            for a, b in matched:
                for position, (x, y) in enumerate(zip(a.per_prompt or [], b.per_prompt or [], strict=True)):
                    gains[position].append(x.block_efficiency - y.block_efficiency)
            decided = _paired_cells(dict(gains), "same prompts")
        lines.append(
            f"| {method} | {base} | {dataset} | {temperature:g} | " + " | ".join(cells + decided) + " |"
        )
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
    # tall enough for the legend beside the bars (about 0.17 inch per method at x-small)
    height = max(4.5, 1.0 + 0.17 * len(methods))
    figure = Figure(figsize=(max(6.0, 1.2 * len(datasets) * len(temperatures) + 3), height))
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
