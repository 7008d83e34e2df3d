"""Stage `heads` (seed 000): Medusa-1 or BPD proposal heads on the frozen target's last hidden states,
trained on the distill stage's mix of every pair.

Runner side: `run` launches `main` through `accelerate launch`. Subprocess side: `train_heads` loads the
frozen target (bf16 on a GPU), builds the heads (`models.heads.heads_for_target`) and trains them with
`train.heads.fit`. Output: `heads/` (`heads.safetensors`, `heads.json`, whose `training` holds the
metrics; and vLLM's medusa `config.json`, plus the target's lm head for BPD heads, so that the same
folder loads in vLLM: `models.heads.add_vllm_medusa`), which the measure stage decodes with (`bpd`, `medusa` and their `+rescore` variants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polydraft.models.heads import Heads, add_vllm_medusa, heads_for_target, save_heads
from polydraft.models.placement import load_target, process_device
from polydraft.pipelines.runtime.contract import StageContext, StageResult, StageSpec
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.inputs import HeadsInputs
from polydraft.pipelines.stages.mix_training import main_on_mix, run_on_mix, start_on_mix
from polydraft.train.heads import HEADS_DIR, LOG_FILE, HeadsSettings, fit
from polydraft.train.stage_metrics import HeadsMetrics


def run(inputs: HeadsInputs, ctx: StageContext) -> StageResult:
    """Launch the training subprocess, return its metrics."""
    return run_on_mix("heads", inputs, ctx, HeadsMetrics)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.heads SPEC.json`, started by `accelerate launch` on every process."""
    main_on_mix(argv, HeadsInputs, lambda inputs: inputs.heads, train_heads)


def train_heads(
    spec: StageSpec, inputs: HeadsInputs, accelerator: Any, tracker: Tracker
) -> tuple[Heads, HeadsMetrics]:
    """Load the frozen target, train the heads, write `heads/`; returns the heads and their metrics."""
    target_spec, block = inputs.target, inputs.heads
    start = start_on_mix("heads", spec, inputs, block, accelerator, tracker, "response")

    target = load_target(
        target_spec.path, target_spec.revision, target_spec.dtype, target_spec.trust_remote_code,
        target_spec.max_memory_per_gpu_gib, process_device(accelerator.device, accelerator.num_processes),
    )  # fmt: skip
    target.requires_grad_(False)
    heads = heads_for_target(target, block.kind, block.num_heads, block.num_layers)
    shared_head = target.get_output_embeddings() if block.kind == "bpd" else None
    prepared, optimization = start.prepare(heads)
    trained = fit(
        accelerator, target, prepared, optimization, start.batches, start.evals, start.loop(),
        HeadsSettings(block.num_heads, block.loss_decay, shared_head), start.job(LOG_FILE),
    )  # fmt: skip
    origin = {"path": target_spec.path, "revision": target_spec.revision}

    def save(folder: Path, metrics: HeadsMetrics, state: dict[str, Any]) -> None:
        save_heads(heads, folder, origin, extra={"training": metrics.model_dump()}, state=state)
        add_vllm_medusa(folder, target.get_output_embeddings())  # the same folder loads in vLLM's medusa

    return heads, start.finish(HeadsMetrics, prepared, trained, HEADS_DIR, save)


if __name__ == "__main__":
    main()
