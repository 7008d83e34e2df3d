"""Training cost of the early-exit head vs Medusa-style heads on the full model (seed 001 Table 6).

    python -m bench.early_exit_memory                     # Llama-2-13B shape on a GPU (~26 GB of disk)
    python -m bench.early_exit_memory --preset cpu-small  # a small shape that runs on a CPU in a minute

A target of the chosen shape with random weights is saved once as a temporary checkpoint (26 GB for
13B, 140 GB for 70B in bf16; `--target-dir` reuses a saved one). Each method then runs in its own subprocess, so that its peak memory is its own:
- `eesd`: the early-exit drafter built by partial loading (embeddings, first N layers, last layer, norm,
  head; the rest never materialised), frozen part without autograd, exit layer + norm + head trained;
  the step is the trainer's own (`train.early_exit.head_forward`, AdamW).
- `medusa`: the whole target loaded and run forward (frozen, no autograd, as Medusa-1 trains), plus
  `--medusa-heads` trainable heads (a residual SiLU block and an lm head each) trained with AdamW.
Peak memory is `torch.cuda.max_memory_allocated` on a GPU and the process's peak RSS on a CPU. Step
time is the median of `--steps` steps after one warm-up step. Prints the figures, the ratios, the date
and the device; the numbers are recorded by hand, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

PRESETS = {
    "llama-2-13b": {"hidden": 5120, "layers": 40, "heads": 40, "intermediate": 13824, "vocab": 32000, "shared": 3, "seq": 2048, "batch": 2},
    "llama-2-70b": {"hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "intermediate": 28672, "vocab": 32000, "shared": 5, "seq": 4096, "batch": 1},
    "cpu-small": {"hidden": 256, "layers": 16, "heads": 4, "intermediate": 688, "vocab": 4096, "shared": 2, "seq": 128, "batch": 2},
}  # fmt: skip


def save_random_target(folder: Path, shape: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A Llama of `shape` with random weights, built directly on `device`, saved as a checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape.get("kv_heads", shape["heads"]),
        intermediate_size=shape["intermediate"], max_position_embeddings=max(4096, shape["seq"]),
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)


class MedusaHead(nn.Module):
    """Medusa's head: x + SiLU(W x), then its own lm head."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.block = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden + nn.functional.silu(self.block(hidden)))


def measure(method: str, target_dir: Path, shape: dict, args: argparse.Namespace) -> dict:
    """One method's loaded/trainable parameters, peak memory and step times (run in a fresh process)."""
    from polydraft.train.early_exit import head_forward

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    if method == "eesd":
        from polydraft.models.early_exit import build_early_exit

        drafter = build_early_exit(
            str(target_dir), shape["shared"], 1, dtype=dtype, exit_dtype=torch.float32, device=device
        )
        trainable_module, loaded = drafter.exit, sum(p.numel() for p in drafter.parameters())
    else:
        from transformers import AutoModelForCausalLM

        base = (
            AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
            .to(device)
            .eval()
            .requires_grad_(False)
        )
        trainable_module = nn.ModuleList(
            MedusaHead(shape["hidden"], shape["vocab"]) for _ in range(args.medusa_heads)
        ).to(device)
        loaded = sum(p.numel() for p in base.parameters()) + sum(
            p.numel() for p in trainable_module.parameters()
        )
    load_s = time.perf_counter() - started
    optimizer = torch.optim.AdamW(trainable_module.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            if method == "eesd":
                logits, _ = head_forward(drafter, trainable_module, ids)
                loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            else:
                with torch.no_grad():
                    hidden = base.get_decoder()(input_ids=ids).last_hidden_state
                loss = 0.0
                for k, head in enumerate(trainable_module):  # head k predicts the token k + 2 ahead
                    logits = head(hidden[:, : -(k + 2)].float())
                    loss = loss + nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), ids[:, k + 2 :].flatten()
                    )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first step warms up kernels and allocates optimizer states
            times.append(time.perf_counter() - begin)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "method": method,
        "loaded_params": loaded,
        "trainable_params": sum(p.numel() for p in trainable_module.parameters()),
        "load_s": load_s,
        "step_s": statistics.median(times),
        "peak_memory_gib": peak / 2**30,
        "peak_kind": "cuda max_memory_allocated" if cuda else "process peak RSS",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="default: llama-2-13b on a GPU, cpu-small otherwise",
    )
    parser.add_argument(
        "--target-dir", type=Path, default=None, help="reuse a saved random target of the preset's shape"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--medusa-heads", type=int, default=4, help="seed 001 trains Medusa with 4 heads")
    parser.add_argument("--cpu", action="store_true", help="measure on the CPU even when a GPU exists")
    parser.add_argument("--method", choices=["eesd", "medusa"], help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    shape = PRESETS[args.preset or ("llama-2-13b" if cuda else "cpu-small")]
    if args.method:
        print(json.dumps(measure(args.method, args.target_dir, shape, args)))
        return
    with tempfile.TemporaryDirectory(prefix="eesd-bench-") as scratch:
        target_dir = args.target_dir or Path(scratch) / "target"
        if args.target_dir is None:
            save_random_target(
                target_dir,
                shape,
                torch.device("cuda" if cuda else "cpu"),
                torch.bfloat16 if cuda else torch.float32,
            )
        results = {}
        for method in ("eesd", "medusa"):
            command = [
                sys.executable,
                "-m",
                "bench.early_exit_memory",
                "--method",
                method,
                "--target-dir",
                str(target_dir),
            ]
            command += [
                "--preset",
                args.preset or ("llama-2-13b" if cuda else "cpu-small"),
                "--steps",
                str(args.steps),
            ]
            command += ["--medusa-heads", str(args.medusa_heads)] + (["--cpu"] if args.cpu else [])
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[method] = json.loads(out.strip().splitlines()[-1])
    device = (
        torch.cuda.get_device_name()
        if cuda
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    print(
        f"# early-exit training vs Medusa-style heads, {datetime.datetime.now().isoformat(timespec='seconds')}, {device}"
    )
    print(f"# shape {shape}, {args.medusa_heads} Medusa heads, median of {args.steps} steps")
    print(f"{'method':8} {'loaded':>14} {'trainable':>14} {'peak GiB':>9} {'step s':>8} {'load s':>7}")
    for r in results.values():
        print(
            f"{r['method']:8} {r['loaded_params']:>14,} {r['trainable_params']:>14,} {r['peak_memory_gib']:>9.2f} {r['step_s']:>8.3f} {r['load_s']:>7.1f}"
        )
    eesd, medusa = results["eesd"], results["medusa"]
    print(
        f"medusa/eesd: peak memory {medusa['peak_memory_gib'] / eesd['peak_memory_gib']:.2f}x, step time {medusa['step_s'] / eesd['step_s']:.2f}x ({eesd['peak_kind']})"
    )
    print(
        json.dumps({"date": datetime.date.today().isoformat(), "device": device, "shape": shape, **results})
    )


if __name__ == "__main__":
    main()
