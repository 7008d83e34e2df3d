"""The rates `polydraft plan --gpus cpu` divides by, measured on this machine's cores.

A GPU's plan starts from its data sheet (peak FLOPs, HBM bandwidth) and shares of them; a CPU has no such
sheet, so this bench measures the same quantities with small Llamas of the width the CPU runs
(`--hidden`, default 128, vocabulary 2048), on every core torch uses:

- **training**: optimizer steps of the trainers' own step (`bench.train_throughput.measure`: the
  Accelerator, fused AdamW, the summed cross-entropy, clipping) at two batch shapes; the rate is the
  extra model FLOPs (6N + attention per token) over the extra time, the step's fixed cost what the small
  batch takes beyond its FLOPs at that rate;
- **batch-1 decoding**: the latency probe of the measure stage (`decoding.measurement.latency`) on a
  cached context, at two depths; the difference over the extra layers is one layer's cost, of which
  reading its fp32 weights at the memory bandwidth (a 256 MiB copy: bytes read and written per second)
  is the plan's bandwidth term and the rest its fixed per-layer cost;
- **batched generation**: `generate` at `--batch` rows, as the `hf` distill backend runs it: model
  FLOPs (2N per prompt and generated token) per second;
- **a stage's launch**: `accelerate launch` (single process) of a script that imports a training stage
  and builds its Accelerator;
- **vLLM**: a fresh Python importing vLLM's CPU build, then starting one engine (`enforce_eager`, as the
  export's check does) on the demo's committed target (`--vllm-model`; `--no-vllm` skips it).

Every quantity is measured `--repeats` times, interleaved; the table gives mean ± std, and the plan's
CPU constants (`pipelines/runtime/cluster.py`, CPU_*) are the means of a recorded run.

    python -m bench.cpu_rates [--repeats 3] [--record bench/results/cpu_rates.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.held_out import record
from bench.train_throughput import measure as train_measure
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.measurement.latency import lm_latencies
from polydraft.train.runtime import make_accelerator
from polydraft.train.throughput import train_flops_per_token

VOCAB = 2048
DEMO_TARGET = next(Path(__file__).resolve().parent.parent.glob("recipes/demo/target/*/"), Path("."))
LAUNCHED = """from polydraft.train.runtime import make_accelerator
import polydraft.pipelines.stages.finetune  # what a training stage's process imports
make_accelerator(1, "no")
"""
SINGLE = Path(__file__).resolve().parent.parent / "recipes" / "accelerate" / "single.yaml"
VLLM_PROBE = """
import json, sys, time
start = time.perf_counter()
import vllm
from polydraft.distill.vllm_backend import engine_kwargs
imported = time.perf_counter()
kwargs = engine_kwargs(sys.argv[1], None, "auto", False, 1, 512, 0.5, 0, cpu_kv_cache_gib=1.0)
kwargs["enforce_eager"] = True
llm = vllm.LLM(**kwargs)
print(json.dumps({"import": imported - start, "engine": time.perf_counter() - imported}))
"""


def llama(hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=3 * hidden, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def train_rate(hidden: int, layers: int, accelerator) -> tuple[float, float]:
    """(model FLOPs/s, fixed seconds per step) of the trainers' step, from a big and a small batch."""
    points = []
    for batch, seq in ((16, 128), (1, 16)):
        args = argparse.Namespace(
            arch="custom", vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=4,
            intermediate_size=3 * hidden, seq_len=seq, batch_size=batch, steps=20, warmup=3,
        )  # fmt: skip
        result = train_measure(args, accelerator, compiled=False)
        matmul = layers * (4 * hidden * hidden + 3 * hidden * 3 * hidden) + VOCAB * hidden
        flops = train_flops_per_token(matmul, layers, hidden, seq) * batch * seq
        points.append((flops, batch * seq / result["tokens_per_s"]))
    (big_flops, big_s), (small_flops, small_s) = points
    rate = (big_flops - small_flops) / (big_s - small_s)
    return rate, max(0.0, small_s - small_flops / rate)


def layer_seconds(hidden: int, depths: tuple[int, int]) -> float:
    """One layer's share of a batch-1 cached forward: the latency difference over the extra layers."""
    context = torch.randint(3, VOCAB, (1, 180), generator=torch.Generator().manual_seed(0))
    steps = []
    for layers in depths:
        lm = CachedLM(llama(hidden, layers))
        steps.append(lm_latencies(lm, context, [1], [], 20).chain[1])
    return (steps[1] - steps[0]) / (depths[1] - depths[0])


def bandwidth() -> float:
    """Bytes/s of a 256 MiB copy (read + written), the best of 5."""
    source, dest = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dest.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best


def generate_rate(hidden: int, layers: int, batch: int) -> float:
    """Model FLOPs/s of `generate` on `batch` rows of 64 prompt tokens, 32 new tokens each (no stop)."""
    model = llama(hidden, layers)
    params = sum(p.numel() for p in model.parameters()) - VOCAB * hidden  # the embedding is a lookup
    ids = torch.randint(3, VOCAB, (batch, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    return 2.0 * params * batch * (64 + 32) / seconds


def launch_seconds() -> float:
    """`accelerate launch` of a script that imports what a training stage imports and builds its
    Accelerator, as a stage's launch does before its first step."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "launched.py"
        script.write_text(LAUNCHED, encoding="utf-8")
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(SINGLE),
            str(script),
        ]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        return time.perf_counter() - start


def vllm_seconds(model: Path) -> tuple[float, float]:
    """(importing vLLM, starting one engine) in a fresh Python."""
    done = subprocess.run(
        [sys.executable, "-c", VLLM_PROBE, str(model)], check=True, capture_output=True, text=True,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # as the export's check runs it
    )  # fmt: skip
    timings = json.loads(done.stdout.strip().splitlines()[-1])
    return timings["import"], timings["engine"]


def mean_std(values: list[float], scale: float = 1.0) -> str:
    return f"{statistics.mean(values) * scale:.3g} ± {statistics.stdev(values) * scale:.2g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12, help="depth of the generation and training models")
    parser.add_argument("--batch", type=int, default=64, help="rows of the batched generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-model", type=Path, default=DEMO_TARGET, help="a local model folder")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM probe")
    parser.add_argument("--record", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    accelerator = make_accelerator(1, "no")
    rows: dict[str, list[float]] = {
        k: []
        for k in ("train", "step", "layer", "bandwidth", "generate", "start", "vllm import", "vllm engine")
    }
    for _ in range(args.repeats):
        rate, overhead = train_rate(args.hidden, 1, accelerator)
        rows["train"].append(rate)
        rows["step"].append(overhead)
        rows["bandwidth"].append(bandwidth())
        layer_bytes = 4 * (4 * args.hidden**2 + 3 * args.hidden * 3 * args.hidden)
        rows["layer"].append(
            layer_seconds(args.hidden, (4, 4 + args.layers)) - layer_bytes / rows["bandwidth"][-1]
        )
        rows["generate"].append(generate_rate(args.hidden, args.layers, args.batch))
        rows["start"].append(launch_seconds())
        if not args.no_vllm:
            imported, engine = vllm_seconds(args.vllm_model)
            rows["vllm import"].append(imported)
            rows["vllm engine"].append(engine)
    table = [
        "| quantity | value | plan constant |",
        "| --- | ---: | --- |",
        f"| training, model FLOPs/s (1 layer; 16 x 128 vs 1 x 16 tokens) | {mean_std(rows['train'], 1e-9)} G | CPU_TRAIN_FLOPS |",
        f"| fixed cost of a training step | {mean_std(rows['step'], 1e3)} ms | CPU_STEP_OVERHEAD_S |",
        f"| memory bandwidth (256 MiB copy) | {mean_std(rows['bandwidth'], 1e-9)} GB/s | CPU_BANDWIDTH |",
        f"| one layer of a batch-1 cached forward beyond its weights (4 vs {4 + args.layers} layers) | {mean_std(rows['layer'], 1e3)} ms | CPU_LAYER_S |",
        f"| generate, model FLOPs/s ({args.layers} layers, batch {args.batch}) | {mean_std(rows['generate'], 1e-9)} G | CPU_GENERATE_FLOPS |",
        f"| a training launch: `accelerate launch` of a script importing a stage, building its Accelerator | {mean_std(rows['start'])} s | CPU_LAUNCH_S |",
    ]  # fmt: skip
    if not args.no_vllm:
        table += [
            f"| a fresh Python importing vLLM | {mean_std(rows['vllm import'])} s | CPU_VLLM_IMPORT_S |",
            f"| one vLLM engine started (enforce_eager) | {mean_std(rows['vllm engine'])} s | CPU_VLLM_STARTUP_S |",
        ]  # fmt: skip
    setting = (
        f"Llamas of hidden {args.hidden}, vocabulary {VOCAB}, {torch.get_num_threads()} threads; mean ± std over "
        f"{args.repeats} interleaved repetitions."
    )
    record("cpu_rates", setting, table, args.record)


if __name__ == "__main__":
    main()
