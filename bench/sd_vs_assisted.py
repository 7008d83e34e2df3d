"""polydraft `sd` against transformers assisted generation at temperature 0: same target, drafter, prompts.

For each prompt the methods run one after another in an order that rotates with the prompt (timing
noise on a shared CPU is large, so no method always runs first), after a warm-up. It checks that
`ar`, `sd` and assisted generation produce identical tokens, then prints tokens/s of each method,
the ratio sd / assisted (goal: >= 1, target 1.5), block efficiency, and the share of wall time spent
outside the models' forward passes (the engine's own overhead).

Assisted generation runs twice: like for like (`num_assistant_tokens` = K, constant, no confidence
threshold) and with transformers' defaults (20 tokens, confidence threshold 0.4).

Without --target/--drafter it builds a pair from configs: a deep, narrow random Llama target whose
layers after the first `--draft-layers` barely change the residual stream (their output projections
are scaled by `--tail-scale`), and a drafter made of the target's embeddings, first layers, norm and
head, so that the two agree often, as a trained drafter would.

    python bench/sd_vs_assisted.py                                     # tiny pair, small settings
    python bench/sd_vs_assisted.py --target DIR --drafter DIR --prompts 20 --max-new-tokens 128
    python bench/sd_vs_assisted.py --device cuda --layers 24 --hidden 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from polydraft.decoding.assisted import assisted  # noqa: E402
from polydraft.decoding.control import FixedK  # noqa: E402
from polydraft.decoding.engine import Generation, autoregressive  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.metrics import summarize  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402
from polydraft.decoding.sd import speculative  # noqa: E402


def build_pair(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import LlamaForCausalLM

    from polydraft.models.tiny import build_llama

    heads = max(1, args.hidden // 64)
    target = build_llama(args.vocab, args.hidden, args.layers, heads, 4 * args.hidden, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in target.parameters():
            if parameter.dim() == 2:  # larger weights than the init's: varied, non-repeating outputs
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
        for layer in target.model.layers[args.draft_layers :]:
            layer.self_attn.o_proj.weight.mul_(args.tail_scale)
            layer.mlp.down_proj.weight.mul_(args.tail_scale)
    config = target.config.to_dict()
    config["num_hidden_layers"] = args.draft_layers
    drafter = LlamaForCausalLM(type(target.config).from_dict(config))
    drafter.load_state_dict(target.state_dict(), strict=False)
    return target.eval(), drafter.eval()


def load_pair(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=dtype)
    if target.config.vocab_size != drafter.config.vocab_size:
        raise SystemExit(
            f"vocabulary sizes differ: {target.config.vocab_size} vs {drafter.config.vocab_size}"
        )
    return target.eval(), drafter.eval()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="a Hugging Face folder (default: a pair built from configs)")
    parser.add_argument("--drafter", help="a Hugging Face folder sharing the target's vocabulary")
    parser.add_argument("--layers", type=int, default=8, help="built target: layers")
    parser.add_argument("--hidden", type=int, default=128, help="built target: hidden size")
    parser.add_argument("--vocab", type=int, default=2048, help="built pair: vocabulary size")
    parser.add_argument(
        "--draft-layers", type=int, default=1, help="built drafter: the target's first layers"
    )
    parser.add_argument(
        "--tail-scale", type=float, default=0.02, help="built target: scale of later layers' outputs"
    )
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="draft length K of sd and like-for-like assisted")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.target is None) != (args.drafter is None):
        raise SystemExit("give both --target and --drafter, or neither")
    target, drafter = load_pair(args) if args.target else build_pair(args)
    target.to(args.device)
    drafter.to(args.device)
    vocab = target.config.vocab_size
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    greedy = Sampling()
    target_lm, drafter_lm = CachedLM(target), CachedLM(drafter)
    methods = {
        "ar": lambda p: autoregressive(target_lm, p, args.max_new_tokens, greedy, torch.Generator(), eos_ids),
        "sd": lambda p: speculative(
            target_lm, drafter_lm, p, args.max_new_tokens, greedy, FixedK(args.k), torch.Generator(), eos_ids
        ),
        f"assisted (K={args.k})": lambda p: assisted(
            target, drafter, p, args.max_new_tokens, greedy, args.k, 0.0, 0, eos_ids
        ),
        "assisted (defaults)": lambda p: assisted(
            target, drafter, p, args.max_new_tokens, greedy, 20, 0.4, 0, eos_ids
        ),
    }
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, vocab, (args.prompt_length,), generator=generator) for _ in range(args.prompts)
    ]
    for method in methods.values():  # warm-up: first calls allocate and compile kernels
        method(prompts[0])
    results: dict[str, list[Generation]] = {name: [] for name in methods}
    names = list(methods)
    for index, prompt in enumerate(prompts):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            results[name].append(methods[name](prompt))
    mismatches = [
        (name, i)
        for name in names
        for i, gen in enumerate(results[name])
        if gen.tokens != results["ar"][i].tokens
    ]
    print(f"device {args.device}, {args.prompts} prompts x {args.max_new_tokens} new tokens, K = {args.k}")
    print(f"target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters")  # fmt: skip
    print(f"identical outputs: {'yes' if not mismatches else f'NO, {mismatches}'}")
    rates = {}
    print(f"{'method':<22}{'tokens/s':>10}{'block eff.':>12}{'overhead':>10}{'median ms/prompt':>18}")
    for name in names:
        m = summarize(results[name], None)
        rates[name] = m["token_rate"]
        median = statistics.median(g.wall_seconds for g in results[name]) * 1e3
        print(
            f"{name:<22}{m['token_rate']:>10.1f}{m['block_efficiency']:>12.2f}{m['overhead_share']:>10.1%}{median:>18.1f}"
        )
    like = rates[f"assisted (K={args.k})"]
    print(f"sd / assisted (K={args.k}): {rates['sd'] / like:.2f}x   "
          f"sd / assisted (defaults): {rates['sd'] / rates['assisted (defaults)']:.2f}x   "
          f"sd / ar: {rates['sd'] / rates['ar']:.2f}x")  # fmt: skip
    print(time.strftime("%Y-%m-%d %H:%M:%S"))


if __name__ == "__main__":
    main()
