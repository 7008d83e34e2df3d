"""`polydraft status RUN_DIR`: what a rerun of the run directory's recipe would do to each stage, and why,
found with the runner's own keys and code fingerprints, without running, copying or deleting anything.

Each enabled stage is one of: `up to date`, `will run` (never ran, resumes an interrupted run, its config
or an upstream folder changed, an upstream stage will run), `ran with other code` (kept by a plain rerun;
`--rerun-stale` reruns it) or `failed` (the reason its `.partial/failure.json` gives).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polydraft.pipelines.run.runner import KEY_FILE, code_drift, stage_code, stage_key
from polydraft.pipelines.runtime.contract import Stage
from polydraft.pipelines.runtime.manifest import MANIFEST, ManifestError, file_hash, stage_manifest
from polydraft.pipelines.schema import Recipe, ResolvedTarget

SHOWN = 4
"""Changed config keys or modules named before `and N more`."""


@dataclass(frozen=True)
class StageState:
    name: str
    state: str
    """`disabled`, `up to date`, `will run`, `ran with other code` or `failed`."""
    why: str = ""


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= _flat(item, f"{prefix}{key}.")
        return out
    return {prefix.rstrip("."): value}


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose value differs between two stage configs."""
    before, after = _flat(old), _flat(new)
    return sorted(k for k in set(before) | set(after) if before.get(k, object()) != after.get(k, object()))


def _resumed_state(run_dir: Path, name: str, key: str | None) -> StageState | None:
    """The state of a stage whose `.partial` folder a rerun would resume (same key): failed, with the
    reason its `failure.json` gives, or interrupted. None when there is no such folder."""
    partial = run_dir / f"{name}.partial"
    key_file = partial / KEY_FILE
    if key is None or not key_file.is_file() or key_file.read_text().strip() != key:
        return None
    failure = partial / "failure.json"
    if not failure.is_file():
        return StageState(name, "will run", f"interrupted; a rerun resumes from {partial}")
    try:
        error = json.loads(failure.read_text(encoding="utf-8"))["error"].splitlines()[0]
    except (OSError, ValueError, KeyError, IndexError):
        error = f"see {failure}"
    return StageState(name, "failed", f"{error} (a rerun resumes from {partial})")


def stage_states(
    recipe: Recipe, run_dir: Path, stages: list[Stage], target: ResolvedTarget
) -> list[StageState]:
    """Every stage's state in pipeline order, as `run_pipeline` would find it with this recipe."""
    enabled = {s.name for s in stages if getattr(getattr(recipe, s.name), "enabled", True)}
    states: dict[str, StageState] = {}
    for stage in stages:
        name = stage.name
        if name not in enabled:
            states[name] = StageState(name, "disabled")
            continue
        upstream = [u for u in stage.upstream if u in enabled]
        pending = [u for u in upstream if states[u].state in ("will run", "failed")]
        config = stage.inputs(recipe, target).model_dump(mode="json")
        key = None if pending else stage_key(config, {u: file_hash(run_dir / u / MANIFEST) for u in upstream})
        try:
            manifest = stage_manifest(run_dir / name)
        except ManifestError as err:
            states[name] = StageState(name, "failed", f"{err}: a rerun stops here (`--only {name} --force`)")
            continue
        if manifest is None and (run_dir / name).is_dir():
            why = f"{run_dir / name} has no {MANIFEST}: a rerun stops here (`--only {name} --force`)"
            states[name] = StageState(name, "failed", why)
            continue
        resumed = _resumed_state(run_dir, name, key)
        partial = run_dir / f"{name}.partial"
        if resumed is not None:
            states[name] = resumed
        elif manifest is None and partial.is_dir():
            why = f"never completed; {partial}, left with another config, is moved aside"
            states[name] = StageState(name, "will run", why)
        elif manifest is None:
            states[name] = StageState(name, "will run", "never ran")
        elif pending:
            states[name] = StageState(name, "will run", f"upstream {', '.join(pending)} will run")
        elif manifest["key"] == key:
            drift = code_drift(manifest, stage_code(stage))
            states[name] = (
                StageState(name, "ran with other code", _listed(drift))
                if drift
                else StageState(name, "up to date")
            )
        else:
            reasons = []
            changed = config_changes(manifest.get("config", {}), config)
            if changed:
                reasons.append(f"config changed: {_listed(changed)}")
            recorded = manifest.get("upstream", {})
            moved = [u for u in upstream if recorded.get(u) != file_hash(run_dir / u / MANIFEST)]
            moved += [u for u in recorded if u not in upstream]
            if moved:
                reasons.append(f"upstream {', '.join(moved)} changed since it ran")
            states[name] = StageState(name, "will run", "; ".join(reasons) or "its key changed")
    return [states[s.name] for s in stages]


def status_table(states: list[StageState]) -> str:
    width = max(len(s.name) for s in states)
    state_width = max(len(s.state) for s in states)
    return "\n".join(f"{s.name.ljust(width)}  {s.state.ljust(state_width)}  {s.why}".rstrip() for s in states)
