"""The throughput model behind `polydraft plan`: GPUs, model shapes and every constant the estimate uses,
each written once with its source. A constant marked ASSUMPTION is this project's guess, not a measurement:
replace it with a measured figure (bench/train_throughput.py, bench/vllm_acceptance.py on the GPU at hand)
when one exists.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from polydraft.models.drafters import drafter_shape
from polydraft.models.folders import is_local, mirrored
from polydraft.pipelines.schema import DrafterConfig, TargetConfig
from polydraft.train.throughput import peak_flops

GIB = 2**30

# ----------------------------------------------------------------------------- GPUs

# HBM bandwidth in GB/s, from NVIDIA's data sheets (A100: "NVIDIA A100 Tensor Core GPU" datasheet, SXM
# figures; H100 SXM5: H100 datasheet; H200 SXM: H200 datasheet). Peak dense bf16 FLOPs come from
# train.throughput.PEAK_BF16_FLOPS (same data sheets: A100 312 TFLOPS, H100/H200 SXM 989 TFLOPS).
GPU_BANDWIDTH_GBPS: dict[tuple[str, int], float] = {
    ("A100", 40): 1555.0,
    ("A100", 80): 2039.0,
    ("H100", 80): 3350.0,
    ("H200", 141): 4800.0,
}
GPU_SPEC = re.compile(r"^(\d+)x([A-Z]\d+)-(\d+)GB$")


class PlanError(ValueError):
    """A GPU spec, target or recipe the plan cannot size; the message says what to give instead."""


@dataclass(frozen=True)
class Rates:
    """What one device achieves: the figures every estimate divides by. A GPU's come from its data sheet
    and the shares below (`gpu_rates`); a CPU's were measured on one (`CPU_RATES`)."""

    train_flops: float
    """Model FLOPs/s of a trainer's step once a batch fills the device."""
    step_overhead_s: float
    """Fixed seconds of an optimizer step on top of its FLOPs."""
    generate_flops: float
    """Model FLOPs/s of the `hf` distill backend's padded `generate`."""
    vllm_flops: float
    """Model FLOPs/s of one vLLM engine on a large offline batch."""
    vllm_startup_s: float
    """Seconds from a vLLM engine's start to its first request (load, profiling, graph capture)."""
    vllm_import_s: float
    """Seconds a fresh Python takes to import vLLM, before its first engine."""
    decode_bandwidth: float
    """Bytes/s a batch-1 eager forward reads the weights at."""
    layer_s: float
    """Seconds per layer of a batch-1 eager forward on top of reading its weights."""
    load_bytes_per_s: float
    """Reading safetensors from a local disk into the device's memory."""
    launch_s: float
    """Fixed seconds of a training launch: its processes started, their libraries imported."""
    bytes_per_param: int
    """Bytes of a frozen weight: bf16 on a GPU, fp32 on a CPU (what the stages load there)."""


@dataclass(frozen=True)
class Cluster:
    """`per_node` devices of one kind (GPUs, or one CPU) on each of `nodes` nodes."""

    gpu: str
    memory_gib: int
    per_node: int
    nodes: int
    rates: Rates

    @property
    def total(self) -> int:
        return self.per_node * self.nodes

    def __str__(self) -> str:
        return f"{self.nodes} node(s) x {self.per_node}x{self.gpu}-{self.memory_gib}GB"


def parse_gpus(spec: str, nodes: int = 1) -> Cluster:
    """`8xA100-80GB` -> a Cluster of `nodes` such nodes, `cpu` -> this machine's memory at CPU_RATES;
    PlanError for anything else."""
    known = ", ".join(f"{g}-{m}GB" for g, m in GPU_BANDWIDTH_GBPS)
    match = GPU_SPEC.match(spec.strip())
    if nodes < 1:
        raise PlanError(f"--nodes {nodes}: at least 1")
    if spec.strip().lower() == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // GIB
        return Cluster("CPU", memory, 1, nodes, CPU_RATES)
    if match is None:
        raise PlanError(
            f"--gpus {spec!r}: expected COUNTxGPU-MEMORYGB, e.g. 8xA100-80GB (known: {known}), or cpu"
        )
    count, gpu, memory = int(match[1]), match[2], int(match[3])
    if (gpu, memory) not in GPU_BANDWIDTH_GBPS:
        raise PlanError(f"--gpus {spec!r}: unknown GPU {gpu}-{memory}GB (known: {known})")
    if count < 1:
        raise PlanError(f"--gpus {spec!r}: at least one GPU per node")
    peak = peak_flops(gpu)
    if peak is None:
        raise PlanError(f"--gpus {spec!r}: no bf16 peak known for {gpu} (train.throughput.PEAK_BF16_FLOPS)")
    return Cluster(gpu, memory, count, nodes, gpu_rates(peak, GPU_BANDWIDTH_GBPS[(gpu, memory)] * 1e9))


# ----------------------------------------------------------------------------- throughput constants

VLLM_MFU = 0.25
"""ASSUMPTION: share of the bf16 peak one vLLM engine turns into model FLOPs (2N per prompt or generated
token) on a large offline batch of short requests. 0.25 gives ~5.8k tokens/s for a 7B model on one A100,
the order of public vLLM offline figures for 7-8B models on one A100 (a few thousand output tokens/s
besides their prompts); not measured by this project."""
VLLM_PREFIX_CACHED = True
"""vLLM's automatic prefix caching is on by default since its V1 engine: the template every prompt
shares (the system prompt) is computed once, so only the rest of a prompt costs prefill FLOPs."""
VLLM_STARTUP_S = 180.0
"""ASSUMPTION: load, profiling and CUDA-graph capture of one vLLM engine (engines start in parallel)."""
HF_GENERATE_MFU = 0.05
"""ASSUMPTION: the `hf` distill backend (padded transformers `generate`, one GPU) at this share of peak."""
TRAIN_MFU = 0.30
"""ASSUMPTION: share of the bf16 peak the trainers' matmuls reach once a batch fills the GPU (eager
PyTorch, bf16 autocast). bench/results/train_throughput.md has only a CPU figure so far; rerun
`python -m bench.train_throughput` on the GPU and put its MFU here."""
STEP_OVERHEAD_S = 0.030
"""ASSUMPTION: fixed cost of one optimizer step on top of its FLOPs (kernel launches of an eager HF
model, fused AdamW, gradient clipping, the DDP all-reduce, the Python loop). A batch whose FLOPs take
less than this leaves the GPU mostly waiting: the plan warns."""
HF_DECODE_BANDWIDTH_SHARE = 0.6
"""ASSUMPTION: share of HBM bandwidth a batch-1 eager transformers forward reaches reading the weights
(a public vLLM sweep measured 77% for its own batch-1 decode of Llama-3.1-8B on an A100; eager
transformers is slower)."""
HF_LAYER_OVERHEAD_S = 0.00035
"""ASSUMPTION: per-layer launch overhead of an eager transformers forward at batch 1 (~25 kernels a
Llama layer at ~14 us each)."""
SPEC_SPEEDUP = 2.0
"""ASSUMPTION: wall-time speedup of a speculative decoder over `ar` while measuring (seed 003 Table 1
reports 2.42x for Vicuna-7B de-en at T=0; less at T=1)."""
CROSS_PAIR_SPEEDUP = 0.8
"""ASSUMPTION: wall-time speedup over `ar` of a language drafter or head measured on another pair's eval
set (`measure.cross_pairs`): it drafts little, and a round costs more than what it commits (the demo's
cross-pair rows: 0.57-1.17, bench/results/demo_runs.md)."""
LOAD_BYTES_PER_S = 2e9
"""ASSUMPTION: reading safetensors from a local disk into GPU memory."""
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 34
"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1):
34·s·b·h bytes of 16-bit activations a transformer layer keeps for its backward pass (flash attention
drops the 5·a·s²·b term)."""
LOGITS_BYTES_PER_VALUE = 8
"""Full-vocabulary logits upcast to fp32 (4 bytes) plus their gradient (4 bytes), per token x vocab, for
the tokens whose logits exist at once (a chunk of `loop.loss_chunk_tokens`, or every token unchunked)."""
TRAINABLE_BYTES_PER_PARAM = 16
"""Mixed-precision AdamW: fp32 weights (4) + fp32 gradients (4) + Adam's two fp32 moments (8)."""
FROZEN_BYTES_PER_PARAM = 2
"""A frozen bf16 model (the target under heads, early_exit, kd, measure)."""
MEMORY_HEADROOM = 0.9
"""Share of a GPU's memory an estimate may reach before the plan warns (CUDA context, fragmentation)."""

RECORD_BYTES_PER_TOKEN = 14.4
"""Bytes a distilled record (a JSONL line: texts, the answer's token ids, metadata) takes per prompt and
answer token: 2,955,582 bytes for 204,778 tokens of a demo run's 1,600 records (bench/results/run_disk.md,
`python -m bench.run_disk runs/demo/demo`)."""
RECORDS_BYTES_PER_S = 1.08e8
"""Distilled records (JSONL) read and parsed per second, one process: 4,288,589 bytes of a demo run's 2,400
records (`python -m bench.run_disk <run> --record bench/results/run_disk.md`, 2026-11-29). The distill
stage passes over them about `DISTILL_PASSES` times besides generating."""
DISTILL_PASSES = 3
"""The prompt and request files written, the records read back for the statistics and the mix, the mix
written (each about the records' bytes)."""
MIX_CACHE_BYTES_PER_TOKEN = 8.0
"""The tokenized mix each trainer caches (`train.mix_cache`): int32 input ids and labels."""
CHECKPOINT_BYTES_PER_PARAM = 12.0
"""A training checkpoint per trained parameter: fp32 weights and AdamW's two fp32 moments (8,879,944 bytes
for a demo drafter of 737,664 parameters, 12.04 a parameter, bench/results/run_disk.md)."""
TOKENIZE_BYTES_PER_S = 1.66e6
"""Mix bytes (JSONL) rank 0 tokenizes per second into the trainers' cache (`train.mix_cache`), while the
other ranks wait in a collective: 2,984,918 bytes in 1.80 s on these 2 CPU cores (bench/results/run_disk.md)."""
COLLECTIVE_TIMEOUT_S = 1800.0
"""The least collective timeout polydraft sets: torch's default for NCCL is 10 minutes, which a rank waiting
for rank 0's work on a big mix can outlast."""
EXPORT_BYTES_PER_PARAM = 4.0
"""An exported folder per parameter: fp32 safetensors (bf16 weights would take half)."""

LAUNCH_S = 60.0
"""ASSUMPTION: a training launch on a GPU node before its first step: `accelerate launch` starting a
process per GPU, each importing torch, transformers and accelerate and joining the process group."""


def gpu_rates(peak: float, bandwidth: float) -> Rates:
    """A GPU's rates: its data sheet's bf16 peak and HBM bandwidth at the shares above."""
    return Rates(
        train_flops=peak * TRAIN_MFU,
        step_overhead_s=STEP_OVERHEAD_S,
        generate_flops=peak * HF_GENERATE_MFU,
        vllm_flops=peak * VLLM_MFU,
        vllm_startup_s=VLLM_STARTUP_S,
        vllm_import_s=0.0,  # counted in VLLM_STARTUP_S
        decode_bandwidth=bandwidth * HF_DECODE_BANDWIDTH_SHARE,
        layer_s=HF_LAYER_OVERHEAD_S,
        load_bytes_per_s=LOAD_BYTES_PER_S,
        launch_s=LAUNCH_S,
        bytes_per_param=FROZEN_BYTES_PER_PARAM,
    )


# ----------------------------------------------------------------------------- a CPU (`--gpus cpu`)

# Measured on this project's machine (2 cores of an AMD EPYC with AVX-512, torch 2.13 CPU, fp32) by
# `python -m bench.cpu_rates --repeats 3 --record bench/results/cpu_rates.md` (its second section of
# 2026-11-29, the one with the launch): the means of its 3 repetitions (std 2-18%). On another CPU, run it
# and put its figures here.
CPU_TRAIN_FLOPS = 100e9
"""Model FLOPs/s of the trainers' step on a 1-layer Llama of hidden 128 (16 x 128 tokens vs 1 x 16)."""
CPU_STEP_OVERHEAD_S = 0.00497
"""What the 1 x 16-token step takes beyond its FLOPs at CPU_TRAIN_FLOPS."""
CPU_GENERATE_FLOPS = 45.4e9
"""Model FLOPs/s of `generate` on a 12-layer Llama of hidden 128, 64 rows."""
CPU_BANDWIDTH = 37e9
"""Bytes/s of a 256 MiB copy (read and written)."""
CPU_LAYER_S = 0.000333
"""A layer of a batch-1 cached forward beyond reading its weights (hidden 128; 4 vs 16 layers)."""
CPU_LAUNCH_S = 6.17
"""`accelerate launch` of a script importing a training stage and building its Accelerator."""
CPU_VLLM_IMPORT_S = 3.0
CPU_VLLM_STARTUP_S = 6.8
"""One engine of vLLM's CPU build started, enforce_eager, on the demo's target."""
CPU_RATES = Rates(
    train_flops=CPU_TRAIN_FLOPS,
    step_overhead_s=CPU_STEP_OVERHEAD_S,
    generate_flops=CPU_GENERATE_FLOPS,
    vllm_flops=CPU_GENERATE_FLOPS,
    vllm_startup_s=CPU_VLLM_STARTUP_S,
    vllm_import_s=CPU_VLLM_IMPORT_S,
    decode_bandwidth=CPU_BANDWIDTH,
    layer_s=CPU_LAYER_S,
    load_bytes_per_s=CPU_BANDWIDTH,
    launch_s=CPU_LAUNCH_S,
    bytes_per_param=4,
)

TEMPLATE_TOKENS = {"vicuna": 42, "chat_template": 20, "raw": 0}
"""ASSUMPTION: tokens of the prompt wrapper (Vicuna v1.1's system prompt and `USER: ... ASSISTANT:`
is ~42 Llama tokens; a chat template's turn markers ~20)."""
SOURCE_TOKENS = {"translation": 45, "chat": 200, "prompts": 100}
"""ASSUMPTION: tokens of a source sentence with its `Translate X to English:` prefix (a WMT sentence is
~25 words), of a ShareGPT user turn, of a prompt-list row. `text` sources use distill.text_prompt_tokens."""
ANSWER_TOKENS = {"translation": 45, "chat": 300, "prompts": 200, "text": 256}
"""ASSUMPTION: tokens a target answers before its end of sequence (a translation ~ its source's length),
capped by max_new_tokens."""


def assumptions(cluster: Cluster) -> dict[str, float]:
    """The constants behind this cluster's plan marked ASSUMPTION (not measured, no public figure pins
    them), by name: the plan prints them with its table."""
    if cluster.rates is CPU_RATES:
        device = {"CPU vLLM FLOPs/s (the hf figure, CPU_GENERATE_FLOPS)": CPU_GENERATE_FLOPS}
    else:
        device = {
            "VLLM_MFU": VLLM_MFU,
            "VLLM_STARTUP_S": VLLM_STARTUP_S,
            "HF_GENERATE_MFU": HF_GENERATE_MFU,
            "TRAIN_MFU": TRAIN_MFU,
            "STEP_OVERHEAD_S": STEP_OVERHEAD_S,
            "HF_DECODE_BANDWIDTH_SHARE": HF_DECODE_BANDWIDTH_SHARE,
            "HF_LAYER_OVERHEAD_S": HF_LAYER_OVERHEAD_S,
            "LOAD_BYTES_PER_S": LOAD_BYTES_PER_S,
            "LAUNCH_S": LAUNCH_S,
        }
    return {
        **device,
        "SPEC_SPEEDUP": SPEC_SPEEDUP,
        "CROSS_PAIR_SPEEDUP": CROSS_PAIR_SPEEDUP,
        **{f"TEMPLATE_TOKENS[{k}]": v for k, v in TEMPLATE_TOKENS.items()},
        **{f"SOURCE_TOKENS[{k}]": v for k, v in SOURCE_TOKENS.items()},
        **{f"ANSWER_TOKENS[{k}]": v for k, v in ANSWER_TOKENS.items()},
    }


# ----------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's size."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def params(self, layers: int | None = None) -> int:
        """Parameters of the whole model, or of its embedding and first `layers` layers only."""
        if layers is not None:
            return self.vocab * self.hidden + layers * self.layer_params()
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * self.layer_params() + self.hidden

    def matmul_params(self) -> int:
        """Parameters in matrix multiplies: every layer and the LM head (train.throughput.matmul_params)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden


def _shape(hidden: int, layers: int, vocab: int, inter: int, heads: int, kv: int, tied: bool = False,
           head_dim: int | None = None) -> Shape:  # fmt: skip
    return Shape(hidden, layers, vocab, inter, heads, kv, head_dim or hidden // heads, tied)


# Configs of the hub targets the shipped recipes name (their config.json; /work/research/models.json
# gathered them), used when the target is a hub id that cannot be read here.
KNOWN_TARGETS: dict[str, Shape] = {
    "lmsys/vicuna-7b-v1.3": _shape(4096, 32, 32000, 11008, 32, 32),
    "lmsys/vicuna-13b-v1.3": _shape(5120, 40, 32000, 13824, 40, 40),
    "meta-llama/Llama-2-7b-chat-hf": _shape(4096, 32, 32000, 11008, 32, 32),
    "meta-llama/Llama-2-13b-hf": _shape(5120, 40, 32000, 13824, 40, 40),
    "meta-llama/Llama-2-70b-hf": _shape(8192, 80, 32000, 28672, 64, 8),
    "meta-llama/Llama-2-70b-chat-hf": _shape(8192, 80, 32000, 28672, 64, 8),
    "codellama/CodeLlama-13b-hf": _shape(5120, 40, 32016, 13824, 40, 40),
    "google/gemma-7b-it": _shape(3072, 28, 256000, 24576, 16, 16, tied=True, head_dim=256),
}


def shape_of_config(config: dict) -> Shape:
    """A Shape from a transformers config.json (text_config of a multimodal one)."""
    config = config.get("text_config", config)
    missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size",
                           "intermediate_size") if k not in config]  # fmt: skip
    if missing:
        raise PlanError(f"its config.json has no {', '.join(missing)}")
    heads = config["num_attention_heads"]
    return Shape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        vocab=config["vocab_size"],
        intermediate=config["intermediate_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        tied=bool(config.get("tie_word_embeddings", False)),
    )


def target_shape(target: TargetConfig) -> Shape:
    """The target's size: the bootstrap block, a local folder's (or mirrored) config.json, else the
    table of known hub targets."""
    if target.bootstrap is not None:
        b = target.bootstrap
        return _shape(
            b.hidden_size, b.num_layers, b.vocab_size, b.intermediate_size, b.num_heads, b.num_heads
        )
    path = str(target.path)
    folder = Path(os.path.expanduser(path)) if is_local(path) else mirrored(path, "models", target.revision)
    if folder is not None and (Path(folder) / "config.json").is_file():
        return shape_of_config(json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")))
    if path in KNOWN_TARGETS:
        return KNOWN_TARGETS[path]
    raise PlanError(
        f"target.path {path!r}: no config.json to read its size (known hub targets: "
        f"{', '.join(KNOWN_TARGETS)}); give a local folder"
    )


def drafter_size(drafter: DrafterConfig, vocab: int) -> Shape:
    """A named or custom drafter on the target's vocabulary (models.drafters' shapes)."""
    s = drafter_shape(drafter.arch, **drafter.shape())
    return _shape(
        s["hidden_size"], s["num_layers"], vocab, s["intermediate_size"], s["num_heads"], s["num_kv_heads"],
        tied=s["tie_word_embeddings"], head_dim=s.get("head_dim"),
    )  # fmt: skip


def decode_latency(shape: Shape, cluster: Cluster) -> float:
    """Seconds of one batch-1 eager forward: the weights read at the device's decode bandwidth, and each
    layer's fixed cost (kernel launches, Python)."""
    r = cluster.rates
    return shape.params() * r.bytes_per_param / r.decode_bandwidth + shape.layers * r.layer_s


def train_memory(
    trainable: int,
    frozen: int,
    tokens: int,
    layers_hidden: int,
    vocab: int,
    logit_tokens: int,
    checkpointed_hidden: int | None = None,
) -> float:
    """Peak bytes on one GPU of a trainer: AdamW state of the trainable parameters, frozen bf16 weights,
    activations of `tokens` tokens per micro-batch through layers (sum of layers x hidden), and the logits
    of `logit_tokens` at once (`loop.loss_chunk_tokens`). With gradient checkpointing
    (`checkpointed_hidden`: the width of the recomputed layer) each layer keeps only its bf16 input, and
    one layer's activations exist at a time."""
    if checkpointed_hidden is None:
        activations = tokens * layers_hidden * ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN
    else:
        activations = tokens * (
            layers_hidden * 2 + checkpointed_hidden * ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN
        )
    return (
        trainable * TRAINABLE_BYTES_PER_PARAM
        + frozen * FROZEN_BYTES_PER_PARAM
        + activations
        + logit_tokens * vocab * LOGITS_BYTES_PER_VALUE
    )


def device(cluster: Cluster) -> str:
    """What the plan's notes call a cluster's device."""
    return "CPU" if cluster.gpu == "CPU" else "GPU"


def spread(needed: float, cluster: Cluster) -> tuple[int, float]:
    """A target loaded for decoding (`models/placement.py`): on one GPU when it fits, else over as many of
    a node's GPUs as it takes, whole layers each (returns the GPUs and the GiB on each). Decoding a spread
    target reads the same weights one GPU after the other: its step costs what one GPU's would."""
    usable = cluster.memory_gib * MEMORY_HEADROOM * GIB
    gpus = min(cluster.per_node, max(1, math.ceil(needed / usable)))
    return gpus, needed / gpus / GIB
