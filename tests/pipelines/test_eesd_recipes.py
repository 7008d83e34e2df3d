"""The EESD recipes carry seed 001's Table 9 settings and §4.1 choices of N."""

from __future__ import annotations

import pytest

from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.runtime.contract import PROJECT_ROOT

TABLE_9 = {  # recipe: (target, N, sequence, epochs, the seed's GPUs)
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", 3, 2048, 4.0, 2),
    "vicuna-13b": ("lmsys/vicuna-13b-v1.3", 3, 2048, 4.0, 2),
    "codellama-13b": ("codellama/CodeLlama-13b-hf", 3, 16384, 4.0, 8),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", 5, 4096, 6.0, 8),
    "llama-2-70b-chat": ("meta-llama/Llama-2-70b-chat-hf", 5, 4096, 6.0, 8),
}


@pytest.mark.parametrize("name", sorted(TABLE_9))
def test_eesd_recipe_follows_table_9(name):
    path = PROJECT_ROOT / "recipes" / "eesd" / f"{name}.yaml"
    first, second = path.read_text().splitlines()[:2]
    assert first == f"# polydraft run recipes/eesd/{name}.yaml" and second.startswith("# EESD for")
    recipe = load_recipe(path)
    target, n, sequence, epochs, seed_gpus = TABLE_9[name]
    block, loop = recipe.early_exit, recipe.early_exit.loop
    assert recipe.target.path == target
    assert (block.num_shared_layers, block.num_exit_layers, loop.max_length, loop.epochs) == (
        n,
        1,
        sequence,
        epochs,
    )
    # Table 9's batch of 64 sequences, on a node's 8 GPUs: the 13B models' 2 GPUs were the seed's hardware,
    # and the same batch on 8 trains the same way 4x faster
    assert recipe.launch.num_processes == 8 and seed_gpus in (2, 8)
    assert loop.per_device_batch_size * loop.grad_accum_steps * recipe.launch.num_processes == 64
    assert block.optim.lr == 1e-3
    assert not recipe.pretrain.enabled and not recipe.finetune.enabled
