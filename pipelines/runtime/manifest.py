"""Stage manifests: what a completed stage folder was made from, so reruns can skip it safely."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PACKAGES = (
    "polydraft",
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "tokenizers",
    "safetensors",
    "openai",
    "vllm",
    "deepspeed",
    "wandb",
    "huggingface_hub",
    "pydantic",
)


def canonical_hash(value: Any) -> str:
    """sha256 of a JSON value with sorted keys: equal configs hash equal, whatever their key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The manifest of a completed stage folder, or None when there is none (or it is unreadable)."""
    path = Path(stage_dir) / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class ManifestError(ValueError):
    """A manifest that exists but cannot be read: the stage folder it describes cannot be trusted."""


def stage_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The manifest of a stage folder; None when there is none; ManifestError when it is corrupt."""
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path}: corrupt manifest ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("key"), str):
        raise ManifestError(f"{path}: corrupt manifest (not an object with a `key`)")
    return manifest


def write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2, ensure_ascii=False, default=str)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def git_state(root: Path) -> dict[str, Any]:
    """Commit and dirty flag of the checkout polydraft runs from (None outside a git checkout)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def host_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info
