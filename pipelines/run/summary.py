"""The table `polydraft run` prints at the end, read from the run's own result files."""

from __future__ import annotations

from pathlib import Path

from polydraft.decoding.measurement.mixed import markdown as mixed_markdown
from polydraft.decoding.measurement.mixed import read_groups
from polydraft.decoding.measurement.results import RESULTS_FILE, read_rows
from polydraft.decoding.measurement.tables import (
    BLOCKWISE,
    domain_table,
    repetitions,
    rescoring_table,
    speedup_table,
    table,
)
from polydraft.decoding.measurement.vllm_report import VLLM_NOTES, engine_differences
from polydraft.pipelines.export.records import INDEX_FILE, ExportIndex


def results_summary(run_dir: Path) -> str | None:
    """Block efficiency and speedup per method and eval set (from measure/results.jsonl), in-domain vs
    out-of-domain, local rescoring's gain over the heads alone, the mixed-language traffic (measure/mixed/),
    where vLLM's rows differ from polydraft's, and the exported folders with their smoke checks (from
    export/export.json)."""
    rows = read_rows(run_dir / "measure" / RESULTS_FILE)
    if not rows:
        return None
    parts = [
        f"Block efficiency (tokens per target call), mean ± std over n = {repetitions(rows)} repetitions:",
        table(rows, "block_efficiency"),
        "",
        "Wall-clock speedup over ar (same process, same prompts), with the speedup a latency model predicts from the measured "
        "forward latencies and the measured speedup's error against it (measured / predicted - 1):",
        speedup_table(rows),
        "",
        "In-domain vs out-of-domain (each language-specific drafter on its own pair and on the others; "
        "decided by the paired rule, decoding.measurement.claims.paired_interval, on the prompts' block "
        "efficiencies, the two eval sets' prompts paired by position):",
        domain_table(rows),
    ]
    if any(r.decoder in BLOCKWISE and r.rescorer for r in rows):
        parts += [
            "",
            "Local rescoring against the same heads alone (block-efficiency gain per prompt, both decoding the "
            "same prompts; decided by the paired rule, decoding.measurement.claims.paired_interval):",
            rescoring_table(rows),
        ]
    groups = read_groups(run_dir / "measure")
    if groups:
        parts += ["", mixed_markdown(groups).strip()]
    if any(r.engine == "vllm" for r in rows):
        differences = engine_differences(rows)
        parts += ["", "vLLM beside polydraft's engine (measure/summary.md has the table):"]
        parts += [f"  ENGINES DIFFER: {d}" for d in differences] or [
            f"  first-token acceptance agrees within noise (see {VLLM_NOTES} for what to expect at T > 0)"
        ]
    index = run_dir / "export" / INDEX_FILE
    if index.is_file():
        items = ExportIndex.model_validate_json(index.read_text(encoding="utf-8")).items
        parts += ["", "Exported (run_dir/export/<name>/, model card README.md inside):"]
        for item in items:
            smoke = "smoke check passed" if item.smoke_passed else "SMOKE CHECK FAILED"
            parts.append(f"  {item.name:<12} {item.kind:<10} {smoke}, best K {item.best_draft_length}")
    return "\n".join(parts)
