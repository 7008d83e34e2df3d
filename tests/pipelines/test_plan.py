"""`polydraft plan`: the GPU spec parser, the throughput arithmetic on a small recipe against hand-computed
values, and the idle-GPU and does-not-fit warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polydraft.pipelines.cli.main import EXIT_BAD_INPUT, main
from polydraft.pipelines.plan.estimate import estimate
from polydraft.pipelines.plan.printing import plan_table
from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.runtime.cluster import (
    CPU_RATES,
    DISTILL_PASSES,
    LAUNCH_S,
    RECORD_BYTES_PER_TOKEN,
    RECORDS_BYTES_PER_S,
    STEP_OVERHEAD_S,
    TOKENIZE_BYTES_PER_S,
    TRAIN_MFU,
    VLLM_MFU,
    VLLM_STARTUP_S,
    PlanError,
    parse_gpus,
)
from polydraft.pipelines.schema import Recipe


@pytest.mark.parametrize(
    ("spec", "gpu", "memory", "peak", "bandwidth"),
    [
        ("8xA100-80GB", "A100", 80, 312e12, 2039e9),
        ("8xA100-40GB", "A100", 40, 312e12, 1555e9),
        ("8xH100-80GB", "H100", 80, 989e12, 3350e9),
        ("1xH200-141GB", "H200", 141, 989e12, 4800e9),
    ],
)
def test_gpu_specs(spec, gpu, memory, peak, bandwidth):
    cluster = parse_gpus(spec, nodes=2)
    assert (cluster.gpu, cluster.memory_gib) == (gpu, memory)
    assert cluster.rates.train_flops == pytest.approx(peak * TRAIN_MFU)
    assert cluster.rates.vllm_flops == pytest.approx(peak * VLLM_MFU)
    assert cluster.rates.decode_bandwidth == pytest.approx(bandwidth * 0.6)
    assert cluster.total == 2 * int(spec.split("x")[0])


def test_a_cpu_profile_plans_with_the_measured_cpu_rates():
    cluster = parse_gpus("cpu", nodes=1)
    assert (cluster.gpu, cluster.per_node, cluster.rates) == ("CPU", 1, CPU_RATES)
    assert cluster.memory_gib >= 1


@pytest.mark.parametrize(
    ("spec", "nodes", "message"),
    [
        ("8xV100-32GB", 1, "unknown GPU V100-32GB"),
        ("8xA100-48GB", 1, "unknown GPU A100-48GB"),
        ("A100-80GB", 1, "expected COUNTxGPU-MEMORYGB"),
        ("8 A100", 1, "expected COUNTxGPU-MEMORYGB"),
        ("0xA100-80GB", 1, "at least one GPU"),
        ("8xA100-80GB", 0, "--nodes 0"),
    ],
)
def test_bad_gpu_specs(spec, nodes, message):
    with pytest.raises(PlanError, match=message):
        parse_gpus(spec, nodes)


def small_recipe(tmp_path, **blocks) -> Recipe:
    """A target of 2 layers, hidden 64, vocab 1000 (config.json in a folder); 100 de-en prompts."""
    folder = tmp_path / "target"
    folder.mkdir(parents=True)
    config = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 128,
              "num_attention_heads": 4}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    source = {"kind": "local", "path": "rows.jsonl", "pair": "de-en", "limit": 100}
    recipe = {
        "target": {"path": str(folder)},
        "data": {"pairs": ["de-en"], "distill": [source], "eval": [{**source, "limit": 30}]},
        "distill": {
            "backend": "vllm",
            "temperatures": [0.0, 1.0],
            "max_new_tokens": 512,
            "eval_fraction": 0.0,
        },
        "pretrain": {"enabled": False},
        "finetune": {
            "drafter": {
                "arch": "custom",
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "intermediate_size": 64,
            },
            "loop": {"epochs": 1.0, "per_device_batch_size": 4},
        },
        "early_exit": {"enabled": False},
        "calibrate": {"enabled": False},
        "measure": {"enabled": False},
        "export": {"enabled": False},
        "launch": {"num_processes": 2},
    }
    for key, value in blocks.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    return Recipe.model_validate(recipe)


def test_arithmetic_of_a_small_recipe(tmp_path):
    plan = estimate(small_recipe(tmp_path), parse_gpus("2xA100-80GB"), distill_engines=1)
    distill, finetune = plan.stages
    # 100 prompts x (T=0 once + T=1 once) = 200 answers of 45 tokens (a translation, under 512)
    assert distill.tokens == 200 * 45
    # target params: embeddings 1000x64 x2 (untied) + 2 layers x (attention 64x16x(2x4+2x4) + MLP 3x64x128
    # + two norms of 64) + the final norm 64 = 210240; prefill = 200 x (87 prompt - 42 cached template)
    params = 2 * 1000 * 64 + 2 * (64 * 16 * 16 + 3 * 64 * 128 + 2 * 64) + 64
    assert params == 210240
    flops = 2 * params * (200 * 45 + 200 * 45)
    # + the prompt and request files, the statistics and the mix: 3 passes over the records' bytes
    bookkeeping = (200 * 45 + 200 * 45) * RECORD_BYTES_PER_TOKEN * DISTILL_PASSES / RECORDS_BYTES_PER_S
    assert distill.hours * 3600 - VLLM_STARTUP_S == pytest.approx(flops / (312e12 * VLLM_MFU) + bookkeeping)
    assert distill.gpus == 1
    # finetune: 200 rows of 87 + 45 tokens, 1 epoch; micro-batch 4 x 132 on each of 2 processes
    assert finetune.tokens == 200 * 132
    drafter_matmul = 1 * (32 * 16 * 2 * 4 + 3 * 32 * 64 + 2 * 32) + 1000 * 32
    per_token = 6 * drafter_matmul + 12 * 1 * 32 * 132
    compute = 4 * 132 * per_token / (312e12 * TRAIN_MFU)
    steps = 200 * 132 / (4 * 132 * 2)
    assert steps == 25
    # + rank 0 tokenizing the mix first (one process: a small mix), the other ranks waiting
    tokenizing = 200 * 132 * RECORD_BYTES_PER_TOKEN / TOKENIZE_BYTES_PER_S
    # + the launch's fixed start
    assert finetune.hours == pytest.approx(
        (steps * (compute + STEP_OVERHEAD_S) + tokenizing + LAUNCH_S) / 3600
    )
    assert "tokenizing the mix (1 process(es)" in finetune.note
    assert finetune.gpus == 2 and finetune.gpu_hours == pytest.approx(2 * finetune.hours)
    assert plan.hours == pytest.approx(distill.hours + finetune.hours)


def test_open_rows_count_in_the_mix_and_max_steps_caps_a_trainer(tmp_path):
    plain = estimate(small_recipe(tmp_path / "a"), parse_gpus("2xA100-80GB"), distill_engines=1)
    source = {"kind": "local", "path": "rows.jsonl", "pair": "de-en"}
    opened = estimate(
        small_recipe(tmp_path / "b", distill={"open_fraction": 1.5}, data={"open": [source]}),
        parse_gpus("2xA100-80GB"), distill_engines=1,
    )  # fmt: skip
    # 200 answers and 1.5 open rows each (reference answers) in the mix, no more generated
    assert opened.stages[0].tokens == plain.stages[0].tokens
    assert opened.stages[1].tokens == pytest.approx(2.5 * plain.stages[1].tokens)
    capped = estimate(
        small_recipe(tmp_path / "c", finetune={"loop": {"epochs": 1.0, "per_device_batch_size": 4, "max_steps": 5}}),
        parse_gpus("2xA100-80GB"), distill_engines=1,
    )  # fmt: skip
    # 25 steps an epoch (see above), 5 with max_steps: 5 x 4 rows x 132 tokens on each of 2 processes
    assert capped.stages[1].tokens == pytest.approx(5 * 4 * 132 * 2)
    assert capped.stages[1].note.startswith("5 steps")


def test_the_plan_names_every_assumed_constant(tmp_path):
    table = plan_table(estimate(small_recipe(tmp_path), parse_gpus("2xA100-80GB"), distill_engines=1))
    assumed = table.split("assumed, not measured")[1]
    for name in ("VLLM_MFU 0.25", "TRAIN_MFU 0.3", "HF_LAYER_OVERHEAD_S 0.00035", "ANSWER_TOKENS[chat] 300"):
        assert name in assumed


def test_idle_gpus_are_reported(tmp_path):
    recipe = small_recipe(tmp_path, data={"distill": [{"kind": "local", "path": "r.jsonl", "pair": "de-en",
                                                       "limit": 1_000_000}]})  # fmt: skip
    one = estimate(recipe, parse_gpus("8xA100-80GB"), distill_engines=1)
    assert "distill: 7 of 8 GPUs idle" in "\n".join(one.warnings)
    assert "finetune de-en: 6 of 8 GPUs idle" in "\n".join(one.warnings)
    every = estimate(recipe, parse_gpus("8xA100-80GB"), distill_engines=8)
    assert not any(w.startswith("distill:") for w in every.warnings)
    # the generation divides over the engines; the engines' start and the bookkeeping over the records
    # (node 0's, `DISTILL_PASSES` passes) do not
    fixed = (
        VLLM_STARTUP_S
        + 1_000_000 * 2 * (45 + 45) * RECORD_BYTES_PER_TOKEN * DISTILL_PASSES / RECORDS_BYTES_PER_S
    )
    work = [plan.stages[0].hours * 3600 - fixed for plan in (one, every)]
    assert work[1] == pytest.approx(work[0] / 8)
    # on two nodes every node runs as many engines: twice the GPUs, half the time
    two = estimate(recipe, parse_gpus("8xA100-80GB", nodes=2), distill_engines=8)
    assert two.stages[0].gpus == 16
    assert two.stages[0].hours * 3600 - fixed == pytest.approx(work[1] / 2)


def test_measure_deals_its_groups_over_every_node():
    """A group (eval set, temperature, seed) goes to one process, on any node: vicuna-7b/de's 8 groups (2
    temperatures x 4 seeds) keep a node's 8 processes busy, no GPU idle; two nodes take as long (nothing
    to give node 1's processes) and are not reported idle; with 32 groups, two nodes' 16 processes halve
    one node's 4 groups each. With 3 seeds (6 groups) 2 of a node's 8 would wait."""
    recipe = load_recipe("recipes/vicuna-7b/de.yaml")
    one, two = (estimate(recipe, parse_gpus("8xA100-80GB", nodes=n)) for n in (1, 2))
    alone, both = (next(s for s in plan.stages if s.name == "measure") for plan in (one, two))
    assert (alone.gpus, both.gpus) == (8, 8) and both.hours == pytest.approx(alone.hours)
    assert alone.note.startswith("8 process(es) with a copy of the target on 1 GPU(s) each, 8 group(s)")
    assert both.note.startswith("8 process(es) on each of 2 nodes with a copy of the target on 1 GPU(s) each")
    assert not any(w.startswith("measure:") for w in one.warnings + two.warnings), two.warnings
    three = load_recipe("recipes/vicuna-7b/de.yaml", ["measure.seeds=[0, 1, 2]", "measure.num_prompts=160"])
    assert next(s for s in estimate(three, parse_gpus("8xA100-80GB")).stages if s.name == "measure").gpus == 6
    more = load_recipe(
        "recipes/vicuna-7b/de.yaml",
        ["measure.seeds=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]", "measure.num_prompts=30"],
    )
    one, two = (
        next(s for s in estimate(more, parse_gpus("8xA100-80GB", nodes=n)).stages if s.name == "measure")
        for n in (1, 2)
    )
    assert (one.gpus, two.gpus) == (8, 16)
    assert two.hours < one.hours  # 2 groups a process instead of 4 (each process still loads and probes once)


def test_export_deals_its_vllm_checks_over_a_copy_of_the_target_per_folder():
    """vicuna-7b/de exports 2 folders (the de-en drafter, the pretrained one): their vLLM checks run on 2
    copies at once, an engine for the target alone and one for the folder each; the 6 other GPUs have
    nothing to do and are not reported idle. With the check off, only the smoke checks on one copy."""
    recipe = load_recipe("recipes/vicuna-7b/de.yaml")
    plan = estimate(recipe, parse_gpus("8xA100-80GB"))
    export = next(s for s in plan.stages if s.name == "export")
    assert export.gpus == 2 and "vLLM's on 2 cop(ies)" in export.note
    assert export.hours * 3600 > 2 * VLLM_STARTUP_S
    assert not any(w.startswith("export:") for w in plan.warnings), plan.warnings
    off = load_recipe("recipes/vicuna-7b/de.yaml", ["export.vllm_check=off"])
    quiet = next(s for s in estimate(off, parse_gpus("8xA100-80GB")).stages if s.name == "export")
    assert quiet.gpus == 1 and quiet.hours * 3600 < VLLM_STARTUP_S


def test_small_batches_are_reported(tmp_path):
    warnings = estimate(small_recipe(tmp_path), parse_gpus("2xA100-80GB"), 1).warnings
    assert any("raise per_device_batch_size" in w for w in warnings)


def test_too_few_eval_prompts_are_reported_only_where_the_stage_would_stop(tmp_path):
    """30 held-out prompts against 3 seeds x 20: disjoint repetitions need 60 and stop; shared ones decode
    the 30 there are in every repetition."""
    warnings = {}
    for disjoint in (True, False):
        (tmp_path / str(disjoint)).mkdir()
        measure = {"enabled": True, "decoders": ["ar"], "num_prompts": 20, "disjoint_prompts": disjoint}
        recipe = small_recipe(tmp_path / str(disjoint), measure=measure)
        warnings[disjoint] = [
            w for w in estimate(recipe, parse_gpus("2xA100-80GB"), 1).warnings if "measure" in w
        ]
    assert warnings[False] == []
    assert warnings[True] == [
        "measure: eval source rows.jsonl has 30 prompts, fewer than the 60 that num_prompts x seeds asks for "
        "(disjoint_prompts: the stage will stop)"
    ]


def test_a_70b_target_is_spread_over_the_gpus_it_needs_and_does_not_fit_one():
    recipe = load_recipe("recipes/llama2-chat-7b/de.yaml", ["target.path=meta-llama/Llama-2-70b-chat-hf"])
    plan = estimate(recipe, parse_gpus("8xA100-80GB"), distill_engines=1)
    measure = next(s for s in plan.stages if s.name == "measure")
    assert measure.peak_gib < 80 * 0.9  # 69B bf16 weights (+10%): 2 x 71 GiB a copy
    # one measure process per copy: 4 copies of 2 GPUs each, the 8 groups dealt between them
    assert measure.gpus == 8 and measure.note.startswith(
        "4 process(es) with a copy of the target on 2 GPU(s) each, 8 group(s)"
    )
    one = estimate(recipe.model_copy(update={"measure": recipe.measure.model_copy(update={"processes": 1})}),
                   parse_gpus("8xA100-80GB"), distill_engines=1)  # fmt: skip
    alone_measure = next(s for s in one.stages if s.name == "measure")
    # one process decodes all 8 groups, the busiest of 4 decodes 2: 4x the decoding, the same loading
    # and latency probes once per process
    assert alone_measure.gpus == 2 and 3 < alone_measure.hours / measure.hours < 4
    text = plan_table(plan)
    assert "measure: ~" not in text
    assert "distill: ~" in text and "will not fit" in text  # tensor_parallel_size 1
    alone = plan_table(estimate(recipe, parse_gpus("1xA100-80GB"), distill_engines=1))
    assert "measure: ~" in alone and "will not fit a 80 GB A100" in alone
    split = estimate(recipe.model_copy(update={"distill": recipe.distill.model_copy(update={
        "vllm": recipe.distill.vllm.model_copy(update={"tensor_parallel_size": 4})})}),
        parse_gpus("8xA100-80GB"), distill_engines=2)  # fmt: skip
    assert not any(w.startswith("distill: ~") for w in split.warnings)


def test_unknown_hub_target_and_unsized_source_are_refused(tmp_path):
    recipe = load_recipe("recipes/vicuna-7b/de.yaml", ["target.path=someone/unknown-7b"])
    with pytest.raises(PlanError, match="someone/unknown-7b.*give a local folder"):
        estimate(recipe, parse_gpus("8xA100-80GB"))
    unsized = small_recipe(
        tmp_path, data={"distill": [{"kind": "local", "path": "r.jsonl", "pair": "de-en"}]}
    )
    with pytest.raises(PlanError, match="no `limit`"):
        estimate(unsized, parse_gpus("8xA100-80GB"))


def test_cli(capsys):
    assert main(["plan", "recipes/vicuna-7b/de.yaml", "--gpus", "8xA100-80GB", "--distill-engines", "8"]) == 0
    out = capsys.readouterr().out
    assert "| distill | 180.00M |" in out and "8 engine(s)" in out and "**total**" in out
    assert main(["plan", "recipes/vicuna-7b/de.yaml", "--gpus", "8xV100-32GB"]) == EXIT_BAD_INPUT
    assert "unknown GPU V100-32GB" in capsys.readouterr().err


def test_chunked_loss_and_checkpointing_lower_the_planned_memory():
    """Gemma's 256k vocabulary: the logits of a whole micro-batch against those of a 256-token chunk."""

    def finetune(*overrides: str):
        recipe = load_recipe("recipes/gemma-7b-it/de.yaml", list(overrides))
        plan = estimate(recipe, parse_gpus("8xA100-80GB"))
        return next(s for s in plan.stages if s.name.startswith("finetune"))

    full = finetune("finetune.loop.loss_chunk_tokens=null")
    chunked = finetune()
    checkpointed = finetune("finetune.loop.gradient_checkpointing=true")
    micro_tokens = int(chunked.note.split(" x ")[1].split()[0])  # "N steps of 8 x <micro-batch> tokens"
    vocab = 256_000
    assert full.peak_gib - chunked.peak_gib == pytest.approx(
        (micro_tokens - 256) * vocab * 8 / 2**30, rel=1e-3
    )
    assert checkpointed.peak_gib < chunked.peak_gib


_SOURCES = [{"kind": "local", "path": "rows.jsonl", "pair": p, "limit": 100} for p in ("de-en", "fr-en")]
TWO_PAIRS = {"pairs": ["de-en", "fr-en"], "distill": _SOURCES, "eval": [{**s, "limit": 30} for s in _SOURCES]}
"""data: two pairs of 100 local rows, 30 held out each."""
SD_OWN_PAIR = {"enabled": True, "decoders": ["ar", "sd"], "controls": ["fixed"], "k_sweep": [], "cross_pairs": False,
               "include_pretrained": False, "seeds": [0], "num_prompts": 10}  # fmt: skip
"""measure: ar and sd at one K, each language drafter on its own pair, 10 prompts."""


def test_the_multilingual_drafter_and_the_mixed_traffic_are_planned(tmp_path):
    data, measure, gpus = TWO_PAIRS, SD_OWN_PAIR, parse_gpus("2xA100-80GB")
    plans = {}
    for name, finetune, mixed in [
        ("base", False, False),
        ("multilingual", True, False),
        ("mixed", True, True),
    ]:
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, data=data, finetune={"multilingual": finetune},
                              measure={**measure, "mixed": mixed, "cross_pairs": mixed})  # fmt: skip
        plans[name] = {s.name: s for s in estimate(recipe, gpus, distill_engines=1).stages}
    base, multilingual, mixed = plans["base"], plans["multilingual"], plans["mixed"]
    assert "finetune multilingual" not in base
    # the union balanced by pair has every pair's tokens per epoch
    union = multilingual["finetune multilingual"].tokens
    assert union == pytest.approx(base["finetune de-en"].tokens + base["finetune fr-en"].tokens)
    # per eval set, one method more (sd with the multilingual drafter), on 10 prompts x T=0 and T=1
    per_method = base["measure"].tokens / (2 * 2)  # 2 sets x (ar + sd with the set's own drafter)
    assert multilingual["measure"].tokens == pytest.approx(base["measure"].tokens + 2 * per_method)
    # mixed traffic: composed from the per-pair groups (each drafter on every set), nothing decoded again
    assert mixed["measure"].tokens == pytest.approx(base["measure"].tokens * 4 / 2)  # ar and 3 drafters a set


def test_extra_drafters_in_a_pair_folder_are_planned_on_their_pair_only(tmp_path):
    """Without cross_pairs, an extra drafter at `.../de-en` decodes the de-en set only; one elsewhere, both."""
    data, measure, gpus = TWO_PAIRS, SD_OWN_PAIR, parse_gpus("2xA100-80GB")
    tokens = {}
    for name, extras in [("none", {}), ("paired", {"a": "x/de-en"}), ("generic", {"a": "x/mine"})]:
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, data=data, finetune={"enabled": False},
                              measure={**measure, "extra_drafters": extras})  # fmt: skip
        tokens[name] = {s.name: s for s in estimate(recipe, gpus, distill_engines=1).stages}["measure"].tokens
    per_method = tokens["none"] / 2  # 2 sets x ar
    assert tokens["paired"] == pytest.approx(tokens["none"] + per_method)
    assert tokens["generic"] == pytest.approx(tokens["none"] + 2 * per_method)


def test_eagle3_heads_are_planned_with_the_whole_target_in_each_trainer_and_measured(tmp_path):
    """One trainer per pair (and the multilingual union); each runs the whole target forward over its rows
    (2 FLOPs a parameter and token) and the unrolled head; measure decodes with each head on its own pair
    at K and with Beta-TS; the mixed traffic decodes nothing more."""
    data, gpus = TWO_PAIRS, parse_gpus("2xA100-80GB")
    measure = {**SD_OWN_PAIR, "decoders": ["ar", "sd", "eagle3"], "controls": ["fixed", "beta_ts"]}
    plans = {}
    for name, eagle3, mixed in [("base", {}, False), ("heads", {"enabled": True, "multilingual": True}, False),
                                ("mixed", {"enabled": True, "multilingual": True}, True)]:  # fmt: skip
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, data=data, eagle3=eagle3, finetune={"multilingual": True},
                              measure={**measure, "mixed": mixed, "cross_pairs": mixed})  # fmt: skip
        plans[name] = {s.name: s for s in estimate(recipe, gpus, distill_engines=1).stages}
    base, heads, mixed = plans["base"], plans["heads"], plans["mixed"]
    assert {"eagle3 de-en", "eagle3 fr-en", "eagle3 multilingual"} <= set(
        heads
    ) and "eagle3 de-en" not in base
    trainer = heads["eagle3 de-en"]
    assert trainer.tokens == pytest.approx(base["finetune de-en"].tokens * 6)  # 6 epochs against finetune's 1
    assert heads["eagle3 multilingual"].tokens == pytest.approx(2 * trainer.tokens)
    # measure: base has ar + 2 x sd (fixed, beta_ts) with the own drafter + the multilingual's per set
    per_method = base["measure"].tokens / (2 * (1 + 2 * 2))
    assert heads["measure"].tokens == pytest.approx(base["measure"].tokens + 2 * 2 * 2 * per_method)
    # mixed: nothing decoded again; cross_pairs (which it needs) puts every drafter and head on both sets:
    # ar + 2 x 3 drafters + 2 x 3 heads a set
    assert mixed["measure"].tokens == pytest.approx(2 * (1 + 6 + 6) * per_method)


def test_eagle3_feature_cache_runs_the_target_once_per_kept_row(tmp_path):
    """`eagle3.feature_cache_gib` holding every row: the target runs in each pair's head's first epoch only
    (of 6), never in the multilingual head's; a cache too small for a row changes nothing."""
    data, gpus = TWO_PAIRS, parse_gpus("2xA100-80GB")
    hours = {}
    for name, gib in (("none", 0.0), ("tiny", 1e-9), ("all", 1000.0)):
        (tmp_path / name).mkdir()
        eagle3 = {"enabled": True, "multilingual": True, "feature_cache_gib": gib}
        recipe = small_recipe(tmp_path / name, data=data, eagle3=eagle3)
        big = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000, "intermediate_size": 11008,
               "num_attention_heads": 32}  # a 7B target: its forward pass is most of a step  # fmt: skip
        (tmp_path / name / "target" / "config.json").write_text(json.dumps(big))
        stages = estimate(recipe, gpus, distill_engines=1).stages
        hours[name] = {s.name: s.hours for s in stages if s.name.startswith("eagle3")}
    assert hours["tiny"] == pytest.approx(hours["none"], rel=1e-6)
    # hours are linear in the target's passes a token: the multilingual head gives both ends (0 and 1), and
    # a pair's head has half its rows
    head_only, target = hours["all"]["eagle3 multilingual"], hours["none"]["eagle3 multilingual"]
    assert head_only < 0.8 * target
    # (fr-en: the first head's row also carries the time tokenizing the mix)
    assert hours["none"]["eagle3 fr-en"] == pytest.approx(target / 2)
    assert hours["all"]["eagle3 fr-en"] == pytest.approx(head_only / 2 + (target - head_only) / 2 / 6)


def test_eagle3_keeps_the_distilled_rows_of_its_temperatures_at_their_length(tmp_path):
    data, gpus = TWO_PAIRS, parse_gpus("2xA100-80GB")
    stages = {}
    for name, temperatures in (("all", None), ("greedy", [0.0])):
        (tmp_path / name).mkdir()
        recipe = small_recipe(
            tmp_path / name, data=data, eagle3={"enabled": True, "temperatures": temperatures}
        )
        stages[name] = {s.name: s for s in estimate(recipe, gpus, distill_engines=1).stages}["eagle3 de-en"]
    assert stages["greedy"].tokens == pytest.approx(stages["all"].tokens / 2)  # T=0 of T in {0, 1}
    assert stages["greedy"].note.split(" x ")[-1] == stages["all"].note.split(" x ")[-1]  # same rows


GPU_RECIPES = sorted(
    str(p) for p in Path("recipes").glob("*/*.yaml") if p.parent.name not in ("demo", "accelerate")
)


def test_the_readme_two_node_example_is_planned_without_a_warning():
    """vicuna-7b/de on two 8xA100 nodes (the README's example): distillation, training and measure on
    every node's GPUs, export on a copy per folder: no GPU reported idle."""
    plan = estimate(load_recipe("recipes/vicuna-7b/de.yaml"), parse_gpus("8xA100-80GB", nodes=2))
    assert plan.warnings == [], plan.warnings


@pytest.mark.parametrize("path", GPU_RECIPES)
def test_no_shipped_gpu_recipe_is_planned_with_a_warning(path):
    """Every shipped recipe for a GPU target, on the node it is written for (8 A100s): no GPU idle for long,
    no micro-batch too small to keep a GPU busy, nothing that does not fit (the demo's recipes are for a
    CPU: on A100s their tiny models leave every GPU idle)."""
    assert len(GPU_RECIPES) >= 20
    plan = estimate(load_recipe(path), parse_gpus("8xA100-80GB"))
    assert plan.warnings == [], plan.warnings


def test_every_control_that_runs_is_planned_and_cali_ts_only_where_a_calibration_model_is(tmp_path):
    """The study's controls count like the others (`measure_methods.controls_for`): Beta-TS as written for
    every chain decoder, the EAGLE-3 heads included; the Cali-TS ones only for drafters with a calibration
    model (`calibrate.drafters: all` for the finetuned ones), never for the heads."""
    data, gpus = TWO_PAIRS, parse_gpus("2xA100-80GB")
    tokens = {}
    for name, controls, calibrate in [
        ("fixed", ["fixed"], {"enabled": False}),
        ("beta", ["fixed", "beta_ts", "beta_ts_literal"], {"enabled": False}),
        ("cali_off", ["fixed", "cali_ts", "cali_ts_model", "cali_ts_sampling"], {"enabled": False}),
        ("cali_all", ["fixed", "cali_ts", "cali_ts_model", "cali_ts_sampling"], {"enabled": True, "drafters": "all"}),
    ]:  # fmt: skip
        (tmp_path / name).mkdir()
        measure = {**SD_OWN_PAIR, "decoders": ["ar", "sd", "eagle3"], "controls": controls}
        recipe = small_recipe(tmp_path / name, data=data, eagle3={"enabled": True}, calibrate=calibrate,
                              measure=measure)  # fmt: skip
        tokens[name] = {s.name: s for s in estimate(recipe, gpus, distill_engines=1).stages}["measure"].tokens
    per_method = tokens["fixed"] / (2 * 3)  # 2 sets x (ar, sd with the set's drafter, the set's head)
    assert tokens["beta"] == pytest.approx(tokens["fixed"] + 2 * 2 * 2 * per_method)  # sd and head, 2 each
    assert tokens["cali_off"] == pytest.approx(tokens["fixed"])
    assert tokens["cali_all"] == pytest.approx(tokens["fixed"] + 2 * 3 * per_method)  # sd only
