"""Peak memory of the output head's loss, forward + backward: today's full logits vs the chunked loss.

    python -m bench.loss_memory                   # Gemma's 256k vocabulary x 4,096 tokens, hidden 256
    python -m bench.loss_memory --runs 1 --vocab 32000

The two ways a trainer computes its loss from final hidden states [1, T, H] and an lm head [V, H]:
- `full` (before `loop.loss_chunk_tokens`): `ce_sum(F.linear(hidden, weight), labels)`, the whole
  [T, V] fp32 logits, and their log-softmax and gradient in backward;
- `chunked`: `train.chunked_loss.chunked_loss` with `--chunk` rows at a time.
Every position carries loss (the chunked loss's worst case: it skips the others). Each measurement runs
in a fresh subprocess: after the inputs (hidden states, head weight, labels) are allocated, its resident
set (/proc/self/statm) is the baseline; the figure is the process's peak RSS (getrusage ru_maxrss) after
forward + backward, minus that baseline. The head's weight gradient ([V, H] fp32) is inside both figures.
Runs of the variants are interleaved. The full loss at `--tokens` can need more memory than a shared CPU
machine has; `--full-tokens` then measures it at fewer tokens, and the figure at `--tokens` is the
straight line through those points (memory is linear in T), labelled as extrapolated. Writes
bench/results/loss_memory.md; the numbers are measured, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "loss_memory.md"
GIB = 1024**3


def measure(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict[str, float]:
    """In this process: allocate the inputs, then run the loss forward and backward once."""
    import torch
    import torch.nn.functional as F

    from polydraft.train.chunked_loss import OutputHead, chunked_loss
    from polydraft.train.losses import ce_sum

    torch.set_num_threads(2)
    torch.manual_seed(0)
    states = torch.randn(1, tokens, hidden, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, hidden)).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    baseline = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if variant == "full":
        loss = ce_sum(F.linear(states, weight), labels)[0]
    else:
        loss = chunked_loss(states, labels, OutputHead(weight), chunk)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_gib": (peak - baseline) / GIB, "loss": loss.item() / tokens}


def child(variant: str, tokens: int, chunk: int, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.loss_memory", "--child", variant, "--tokens", str(tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(chunk)]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # see the module docstring
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def stats(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=256_000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--full-tokens", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", choices=["full", "chunked"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.hidden, args.chunk[0])))
        return
    points = [("full", t, 0) for t in args.full_tokens] + [("chunked", args.tokens, c) for c in args.chunk]
    peaks: dict[tuple[str, int, int], list[float]] = {p: [] for p in points}
    for run in range(args.runs):
        for variant, tokens, chunk in points:  # interleaved
            result = child(variant, tokens, chunk, args)
            peaks[(variant, tokens, chunk)].append(result["peak_gib"])
            print(f"run {run + 1}: {variant:7s} T={tokens:5d} chunk {chunk:4d} peak +{result['peak_gib']:.3f} "
                  f"GiB (loss/token {result['loss']:.4f})", flush=True)  # fmt: skip
    full_points = [(t, statistics.mean(peaks[("full", t, 0)])) for t in args.full_tokens]
    (t0, m0), (t1, m1) = full_points[0], full_points[-1]
    slope = (m1 - m0) / (t1 - t0)
    full_at_tokens = m0 + slope * (args.tokens - t0)
    chunked = {c: statistics.mean(peaks[("chunked", args.tokens, c)]) for c in args.chunk}
    measured_full = args.tokens in args.full_tokens
    label = "measured" if measured_full else f"extrapolated from T={t0} and T={t1}"
    lines = [
        "# Peak memory of the loss: full logits vs chunked",
        "",
        f"`python -m bench.loss_memory` ({datetime.date.today()}, {platform.machine()} CPU, "
        f"{platform.platform()}, torch threads 2). V={args.vocab:,}, hidden {args.hidden}, fp32, every "
        f"position carrying loss. Figure: peak RSS (getrusage ru_maxrss) after "
        "forward + backward minus the RSS once the inputs are allocated, each run a fresh subprocess, "
        f"variants interleaved, {args.runs} runs each (mean ± std, GiB); glibc's mmap threshold is fixed at "
        "128 KiB (MALLOC_MMAP_THRESHOLD_) in every run, else freed chunk buffers stay in its heap and "
        f"count in the RSS although no tensor holds them. The full [T, V] logits alone are "
        f"{args.tokens * args.vocab * 4 / GIB:.2f} GiB at T={args.tokens}.",
        "",
        "| loss | tokens | peak over inputs (GiB) |",
        "|---|---|---|",
    ]
    for (variant, tokens, chunk), values in peaks.items():
        name = "full logits (`ce_sum`)" if variant == "full" else f"chunked ({chunk} rows)"
        lines.append(f"| {name} | {tokens} | {stats(values)} |")
    if not measured_full:
        lines.append(
            f"| full logits, **extrapolated** (linear in T) | {args.tokens} | {full_at_tokens:.3f} |"
        )
    lines += ["", f"At T={args.tokens}, full logits {full_at_tokens:.2f} GiB ({label}) vs"]
    lines += [
        f"- chunks of {c}: {m:.2f} GiB (measured), **{full_at_tokens / m:.1f}x less**"
        for c, m in chunked.items()
    ]
    lines += [
        "",
        f"The full loss grows by {slope * 1024:.2f} GiB per 1,024 tokens; the chunked one is bounded by "
        "the chunk, not by T.",
        "",
    ]
    RESULTS.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
