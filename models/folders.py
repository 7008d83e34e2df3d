"""Checking a model folder before a stage loads it, so that a wrong path, a missing config or a truncated
weights file is named in one line instead of surfacing as a loader's traceback."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


class ModelFolderError(ValueError):
    """A local model folder that cannot be loaded; the message names the folder or file and why."""


def is_local(path: str) -> bool:
    """A local folder rather than a hub id (`name` or `org/name`): it exists, or is written like a path."""
    return (
        Path(os.path.expanduser(path)).exists()
        or path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or "\\" in path
    )


MIRROR_ENV = "POLYDRAFT_HUB_MIRROR"
"""A folder holding local copies of hub repositories, read instead of the hub: `models/<org>/<name>` and
`datasets/<org>/<name>` (a dataset at a revision other than the default: `datasets/<org>/<name>@<revision>`,
`/` written `%2F`). For machines that cannot reach the hub (air-gapped clusters), and the tests' fixtures."""


def mirrored(repo_id: str, kind: str, revision: str | None = None) -> str | None:
    """The local copy of hub repository `repo_id` (`kind`: `models` or `datasets`) in the folder that
    $POLYDRAFT_HUB_MIRROR names, or None (no mirror, a local path, or not in the mirror)."""
    root = os.environ.get(MIRROR_ENV)
    if not root or is_local(repo_id):
        return None
    suffix = f"@{revision.replace('/', '%2F')}" if revision and revision != "main" else ""
    folder = Path(os.path.expanduser(root)) / kind / f"{repo_id}{suffix}"
    return str(folder) if folder.is_dir() else None


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be read (a short or corrupt header, data cut short), or None."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{file}: truncated ({size} bytes, not even a header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"{file}: truncated (header of {length} bytes, file of {size})"
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return f"{file}: corrupt header (not JSON)"
    end = max(
        (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)),
        default=0,
    )
    if 8 + length + end > size:
        return f"{file}: truncated ({size} bytes, its header needs {8 + length + end})"
    return None


def check_model_folder(path: str) -> None:
    """Raise ModelFolderError unless `path` is a folder with a config.json and readable weights."""
    folder = Path(os.path.expanduser(path))
    if not folder.exists():
        raise ModelFolderError(f"{path}: no such folder")
    if not folder.is_dir():
        raise ModelFolderError(f"{path}: a file, not a model folder")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelFolderError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ModelFolderError(f"{config}: corrupt ({err})") from err
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")):
        raise ModelFolderError(f"{path}: no weights file (*.safetensors or *.bin)")
    for file in weights:
        problem = safetensors_problem(file)
        if problem:
            raise ModelFolderError(problem)
