"""Training throughput of a drafter: tokens/s and MFU of the trainer's own step (issue 4 benchmark).

The step is the one `train/drafter.py` runs: the Accelerator from `train.runtime` (bf16 autocast on a
GPU, fp32 on a CPU), fused AdamW from `train.schedule`, the summed cross-entropy of `train.losses`,
gradient clipping. Tokens are random ids (throughput does not depend on them); every sequence is full
length, as in packed pretraining. Each mode gets a fresh model; the first `--warmup` steps (compilation,
allocator warm-up) are not timed.

    python -m bench.train_throughput                     # llama-68m, 2048 tokens, eager + compiled on a GPU
    python -m bench.train_throughput --arch custom --hidden-size 64 --num-layers 2 --num-heads 4 \\
        --intermediate-size 128 --vocab-size 512 --seq-len 128 --batch-size 2 --steps 3 --warmup 1

Prints one line per mode with the date and the device, and writes them as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from polydraft.models.drafters import build_drafter
from polydraft.train.losses import ce_sum
from polydraft.train.runtime import make_accelerator, resolve_attn_implementation, resolve_mixed_precision
from polydraft.train.schedule import build_optimizer
from polydraft.train.throughput import matmul_params, mfu, peak_flops, train_flops_per_token


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measure(args: argparse.Namespace, accelerator, compiled: bool) -> dict:
    """Time `args.steps` optimizer steps after `args.warmup` untimed ones."""
    device = accelerator.device
    cuda = device.type == "cuda"
    model = build_drafter(
        args.arch,
        args.vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=max(2048, args.seq_len),
        attn_implementation=resolve_attn_implementation("auto", cuda),
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
    ).to(device)
    config = model.config
    flops_per_token = train_flops_per_token(
        matmul_params(model), config.num_hidden_layers, config.hidden_size, args.seq_len
    )
    if compiled:
        model.compile()
    optimizer = build_optimizer(model, 3e-4, 0.01, (0.9, 0.999), 1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    generator = torch.Generator(device="cpu").manual_seed(0)
    batch = torch.randint(3, args.vocab_size, (args.batch_size, args.seq_len), generator=generator).to(device)

    def step() -> torch.Tensor:
        logits = model(input_ids=batch).logits
        loss, count = ce_sum(logits, batch)
        accelerator.backward(loss / count)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss.item()  # waits for the GPU
    elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * args.batch_size * args.seq_len / elapsed
    peak = peak_flops(torch.cuda.get_device_name(device)) if cuda else None
    utilisation = mfu(tokens_per_s, flops_per_token, peak)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "arch": args.arch,
        "params_M": round(sum(p.numel() for p in accelerator.unwrap_model(model).parameters()) / 1e6, 2),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "precision": accelerator.mixed_precision if accelerator.mixed_precision != "no" else "fp32",
        "compiled": compiled,
        "steps": args.steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": None if utilisation is None else round(utilisation, 4),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
    }
    accelerator.free_memory()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", default="llama-68m", choices=["llama-68m", "vicuna-68m", "gemma-250m", "custom"]
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="Llama/Vicuna's tokenizer by default")
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=None, help="default: 16 on a GPU, 1 on a CPU")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps; default: 30 on a GPU, 3 on a CPU"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps; default: 10 on a GPU, 1 on a CPU"
    )
    parser.add_argument(
        "--modes", default=None, help="comma-separated eager,compiled; default: both on a GPU, eager on a CPU"
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.batch_size = args.batch_size or (16 if cuda else 1)
    args.steps = args.steps or (30 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    modes = (args.modes or ("eager,compiled" if cuda else "eager")).split(",")
    accelerator = make_accelerator(1, resolve_mixed_precision("auto", cuda))
    results = []
    for mode in modes:
        if mode not in ("eager", "compiled"):
            parser.error(f"unknown mode {mode!r}")
        result = measure(args, accelerator, compiled=mode == "compiled")
        results.append(result)
        shown = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (no GPU peak known)"
        print(
            f"{result['date']}  {result['device']}  {result['arch']} ({result['params_M']}M)  "
            f"seq {result['seq_len']} x batch {result['batch_size']}  {result['precision']}  {mode}: "
            f"{result['tokens_per_s']:,.0f} tokens/s, MFU {shown}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
