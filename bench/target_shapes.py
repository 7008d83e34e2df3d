"""What a different bootstrap target would allow: forward latencies and the predicted `sd` speedup by shape.

The demo's speedup is bounded by two ratios of forward latencies (docs/demo.md): verifying K+1
tokens against one target step, and a drafter step against a target step. Both depend on the target's
shape, so before rebuilding the bootstrap target (an hour or more on 2 cores) this bench measures them
on randomly initialised Llama targets of each shape, beside the demo's 1-layer drafter (hidden 128),
with the measure stage's own latency probe (`decoding.measurement.latency.lm_latencies`, a context of
`--context` tokens). Shapes are measured in turn within each repetition; cells are mean ± std over the
repetitions. The predicted speedup BE x t_T(1) / (t_T(K+1) + K t_D(1)) is printed for block efficiencies
given on the command line: a new target changes what the drafter can learn, so BE is an assumption
here, not a measurement. `fp32 MB` is the size of the weights as committed (limit 30 MB), `ar s` the
time of the demo's `ar` decoding (3 x 2 x 8 prompts of ~45 tokens) at that step latency.

    python bench/target_shapes.py
    python bench/target_shapes.py --shapes 128:16:384 192:16:576 --be 2.7 3.0 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from polydraft.decoding.lm import CachedLM, parameter_count  # noqa: E402
from polydraft.decoding.measurement.latency import lm_latencies  # noqa: E402


def llama(hidden: int, layers: int, intermediate: int, vocab: int, heads: int) -> CachedLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return CachedLM(LlamaForCausalLM(config).eval())


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["128:16:384", "128:24:384", "192:12:576", "192:16:576", "256:12:768"],
        help="hidden:layers:intermediate of each target (the demo's is 128:16:384)",
    )
    parser.add_argument("--drafter", default="128:1:384", help="hidden:layers:intermediate of the drafter")
    parser.add_argument("--be", type=float, nargs="+", default=[2.7, 3.0], help="assumed block efficiencies")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--context", type=int, default=180, help="tokens in the cache (prompt + half an answer)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="repetitions (mean ± std over them)")
    parser.add_argument(
        "--probe-repeats", type=int, default=20, help="calls per size per repetition (median)"
    )
    parser.add_argument(
        "--ar-tokens", type=int, default=2200, help="tokens `ar` decodes in the demo's measure"
    )
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 for a std")
    torch.manual_seed(0)
    shapes = [tuple(int(x) for x in s.split(":")) for s in [args.drafter, *args.shapes]]
    models = [llama(h, n, i, args.vocab, args.heads) for h, n, i in shapes]
    context = torch.randint(0, args.vocab, (1, args.context))
    t1: list[list[float]] = [[] for _ in models]
    tk: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first pass warms the kernels up and is dropped
            for index, lm in enumerate(models):
                sizes = [1] if index == 0 else [1, args.k + 1]
                lat = lm_latencies(lm, context, sizes, [], args.probe_repeats)
                if repeat == 0:
                    continue
                t1[index].append(lat.chain[1] * 1e3)
                if index:
                    tk[index].append(lat.chain[args.k + 1] * 1e3)
    draft = statistics.mean(t1[0])
    print(
        f"{torch.get_num_threads()} threads, context {args.context}, K={args.k}, {args.repeats} repetitions "
        f"(mean ± std), drafter {args.drafter}: t_D(1) {mean_std(t1[0])} ms"
    )
    be_cols = " | ".join(f"predicted at BE {be}" for be in args.be)
    print(
        f"| target h:L:I | params | fp32 MB | t_T(1) ms | t_T(K+1) ms | verify / step | t_D / t_T | ar s | {be_cols} |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(args.be))
    for index in range(1, len(models)):
        params = parameter_count(models[index].model)
        step, verify = statistics.mean(t1[index]), statistics.mean(tk[index])
        predictions = [be * step / (verify + args.k * draft) for be in args.be]
        print(
            f"| {args.shapes[index - 1]} | {params / 1e6:.1f}M | {params * 4 / 2**20:.1f} | {mean_std(t1[index])} | "
            f"{mean_std(tk[index])} | {verify / step:.2f} | {draft / step:.3f} | {args.ar_tokens * step / 1e3:.1f} | "
            + " | ".join(f"{x:.2f}" for x in predictions)
            + " |"
        )


if __name__ == "__main__":
    main()
