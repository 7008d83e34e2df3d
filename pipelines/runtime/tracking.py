"""Weights & Biases tracking: one wandb run per stage, all runs of a pipeline run in one group."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Tracker:
    """Logs metrics to wandb (when enabled) and always to the console logger.

    The wandb run starts lazily, at the first call that logs something, so a stage whose work happens
    in a training subprocess (which opens its own run) leaves no empty run behind.
    """

    def __init__(self, run: Any | None, stage: str, start: Any | None = None, model_artifacts: bool = False):
        self._run = run
        self._start = start
        self.stage = stage
        self.model_artifacts = model_artifacts

    def _ensure(self) -> Any | None:
        if self._run is None and self._start is not None:
            self._run, self._start = self._start(), None
        return self._run

    def log(self, metrics: dict[str, Any], step: int | None = None, echo: bool = True) -> None:
        """Send `metrics` to wandb; `echo` also writes them to the console (the training loop's metrics
        have their own readable line, `train.loop`)."""
        if echo:
            shown = ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
            )
            log.info("[%s]%s %s", self.stage, f" step {step}" if step is not None else "", shown)
        if self._ensure() is not None:
            self._run.log(metrics, step=step)

    def summary(self, metrics: dict[str, Any]) -> None:
        if self._ensure() is not None:
            for key, value in metrics.items():
                self._run.summary[key] = value

    def log_table(self, key: str, rows: list[dict[str, Any]]) -> None:
        """A list of flat dicts as a wandb Table (results tables of measure/export)."""
        if not rows or self._ensure() is None:
            return
        import wandb

        columns = list(rows[0])
        self._run.log(
            {key: wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])}
        )

    def log_artifact(self, name: str, folder: Path, metadata: dict[str, Any]) -> None:
        """A folder as a wandb `model` artifact (its files are copied to wandb's staging area now); only
        with `tracking.model_artifacts`."""
        if not self.model_artifacts or self._ensure() is None:
            return
        import wandb

        artifact = wandb.Artifact(name, type="model", metadata=metadata)
        artifact.add_dir(str(folder))
        self._run.log_artifact(artifact)

    @property
    def run_dir(self) -> Path | None:
        return Path(self._run.dir) if self._run is not None else None

    def finish(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


def start_tracking(
    *,
    stage: str,
    group: str,
    wandb_dir: Path,
    config: dict[str, Any],
    project: str,
    entity: str | None,
    tags: list[str],
    mode: str,
    model_artifacts: bool = False,
) -> Tracker:
    """A wandb run named `<group>/<stage>` in group `group`; mode `disabled` logs to the console only."""
    if mode == "disabled":
        return Tracker(None, stage, model_artifacts=model_artifacts)

    def start() -> Any:
        import wandb

        wandb_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=f"{group}/{stage}",
            job_type=stage,
            tags=tags,
            config=config,
            dir=str(wandb_dir),
            mode=mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    return Tracker(None, stage, start, model_artifacts)
