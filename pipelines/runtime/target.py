"""Resolving the recipe's target: a hub id or local folder as is, or a bootstrap build from the cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from polydraft.pipelines.runtime.manifest import canonical_hash
from polydraft.pipelines.schema import DataConfig, ResolvedTarget, TargetConfig

log = logging.getLogger(__name__)

BOOTSTRAP_VERSION = 1
"""Bumped when the bootstrap recipe itself changes, so old cached builds are not reused."""


def bootstrap_key(target: TargetConfig, data: DataConfig) -> str:
    assert target.bootstrap is not None
    settings = target.bootstrap.model_dump(mode="json")
    settings.pop("cache_dir")
    settings.pop("pairs")  # the pairs count below, once, whichever key gives them
    return canonical_hash(
        {
            "version": BOOTSTRAP_VERSION,
            "bootstrap": settings,
            "pairs": bootstrap_pairs(target, data),
            "offline": data.offline.model_dump(mode="json"),
        }
    )[:16]


def bootstrap_pairs(target: TargetConfig, data: DataConfig) -> list[str]:
    """The pairs a bootstrap target is trained on: `target.bootstrap.pairs`, else `data.pairs`."""
    assert target.bootstrap is not None
    return sorted(target.bootstrap.pairs or data.pairs)


def resolve_target(
    target: TargetConfig, data: DataConfig, show_progress: bool = True, build: bool = True
) -> ResolvedTarget:
    """The target as stages load it; a bootstrap target is built once per settings hash, then reused
    (`build=False`: where it would be, built or not, for questions that must not start work)."""
    if target.path is not None:
        return ResolvedTarget(
            path=target.path,
            revision=target.revision,
            dtype=target.dtype,
            trust_remote_code=target.trust_remote_code,
            max_memory_per_gpu_gib=target.max_memory_per_gpu_gib,
        )
    from polydraft.train.bootstrap import DONE, BootstrapTraining, Corpus, TargetShape, build_bootstrap_target

    boot = target.bootstrap
    assert boot is not None
    folder = Path(os.path.expanduser(boot.cache_dir)) / bootstrap_key(target, data)
    if (folder / DONE).is_file():
        log.info("bootstrap target: reusing %s", folder)
    elif build:
        log.info("bootstrap target: building %s (%d steps on the offline corpus)", folder, boot.steps)
        folder.parent.mkdir(parents=True, exist_ok=True)
        offline = data.offline
        build_bootstrap_target(
            folder,
            bootstrap_pairs(target, data),
            TargetShape(
                boot.vocab_size, boot.hidden_size, boot.num_layers, boot.num_heads, boot.intermediate_size,
                boot.max_position_embeddings,
            ),
            BootstrapTraining(boot.steps, boot.batch_size, boot.seq_len, boot.lr, boot.seed),
            Corpus(
                offline.samples_per_pair, (offline.entries_per_sample[0], offline.entries_per_sample[1]),
                offline.test_fraction, dict(offline.kind_weights),
            ),
            show_progress=show_progress,
        )  # fmt: skip
    return ResolvedTarget(
        path=str(folder.resolve()),
        revision=None,
        dtype=target.dtype,
        trust_remote_code=False,
        max_memory_per_gpu_gib=target.max_memory_per_gpu_gib,
    )


def gpus_per_copy(target: ResolvedTarget) -> int:
    """GPUs one copy of the target takes for decoding: its 16-bit weights and 10% more, against GPU 0's
    memory (or `target.max_memory_per_gpu_gib`); every GPU when its size is unknown."""
    import math

    import torch

    from polydraft.pipelines.runtime.cluster import GIB, MEMORY_HEADROOM, PlanError, target_shape

    try:
        shape = target_shape(TargetConfig(path=target.path, revision=target.revision))
    except PlanError:
        return torch.cuda.device_count()
    usable = torch.cuda.get_device_properties(0).total_memory * MEMORY_HEADROOM
    if target.max_memory_per_gpu_gib is not None:
        usable = min(usable, target.max_memory_per_gpu_gib * GIB)
    return max(1, math.ceil(shape.params() * 2 * 1.1 / usable))


def copy_devices(target: ResolvedTarget) -> list[str]:
    """One `CUDA_VISIBLE_DEVICES` value per copy of the target this node's GPUs hold, each copy on as few
    GPUs as it fits (`gpus_per_copy`); none on a machine without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return []
    per = gpus_per_copy(target)
    copies = max(1, torch.cuda.device_count() // per)
    return [",".join(str(copy * per + i) for i in range(per)) for copy in range(copies)]
