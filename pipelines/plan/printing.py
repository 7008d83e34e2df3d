"""What `polydraft plan` prints: the plan as a Markdown table, its total, its warnings and the constants it
assumed."""

from __future__ import annotations

from polydraft.pipelines.plan.estimate import Plan
from polydraft.pipelines.runtime.cluster import assumptions


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def plan_table(plan: Plan) -> str:
    """The plan as a Markdown table, its total and its warnings."""
    lines = [
        f"plan on {plan.cluster} (constants: pipelines/runtime/cluster.py)",
        "",
        "| stage | tokens | hours | GPUs | GPU-hours | peak GiB/GPU | how |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in plan.stages:
        lines.append(
            f"| {s.name} | {_si(s.tokens)} | {s.hours:.2f} | {s.gpus} | {s.gpu_hours:.1f} | {s.peak_gib:.1f} | {s.note} |"
        )
    gpu_hours = sum(s.gpu_hours for s in plan.stages)
    lines.append(
        f"| **total** | | **{plan.hours:.2f}** | | {gpu_hours:.1f} of {plan.hours * plan.cluster.total:.1f} | | |"
    )
    lines += ["", *(f"warning: {w}" for w in plan.warnings)] if plan.warnings else []
    assumed = ", ".join(f"{name} {value:g}" for name, value in assumptions(plan.cluster).items())
    lines += [
        "",
        f"assumed, not measured (pipelines/runtime/cluster.py; replace with your hardware's figures): {assumed}",
    ]
    return "\n".join(lines)
