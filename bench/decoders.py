"""Every polydraft decoder side by side: tokens/s, speedup over `ar`, block efficiency, engine overhead.

The overhead is the share of wall time spent outside the models' forward passes: sampling, tree
building, verification, cache crops and Python. Methods alternate prompt by prompt after a warm-up;
at temperature 0 every output is checked against `ar`'s. `eesd` runs with an early-exit head made
from the target's own modules (the first `--draft-layers` layers shared, one exit layer initialised
from the target's last layer, untrained), so its acceptance is low; it shows the engine's cost.

    python bench/decoders.py                        # the built pair of bench/sd_vs_assisted.py
    python bench/decoders.py --temperature 1.0 --prompts 10 --max-new-tokens 96
    python bench/decoders.py --target DIR --drafter DIR --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from bench.sd_vs_assisted import build_pair, load_pair  # noqa: E402
from polydraft.decoding.control import BetaTS, FixedK  # noqa: E402
from polydraft.decoding.eesd import SelfSpeculative, self_speculative  # noqa: E402
from polydraft.decoding.engine import Generation, autoregressive  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.metrics import summarize  # noqa: E402
from polydraft.decoding.rsd import recursive_speculative  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402
from polydraft.decoding.sd import speculative  # noqa: E402
from polydraft.decoding.tree import TreeShape  # noqa: E402
from polydraft.models.early_exit import from_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--tail-scale", type=float, default=0.02)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--branching", type=int, nargs="+", default=[2, 2, 1])
    parser.add_argument("--beam", type=int, nargs=2, default=[3, 3], metavar=("W", "L"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter = load_pair(args) if args.target else build_pair(args)
    target.to(args.device)
    drafter.to(args.device)
    device = torch.device(args.device)
    sampling = Sampling(args.temperature)
    target_lm, drafter_lm = CachedLM(target), CachedLM(drafter)
    new = args.max_new_tokens

    def gen(index: int) -> torch.Generator:
        return torch.Generator(device).manual_seed(index)

    methods = {
        "ar": lambda p, i: autoregressive(target_lm, p, new, sampling, gen(i), set()),
        f"sd K={args.k}": lambda p, i: speculative(
            target_lm, drafter_lm, p, new, sampling, FixedK(args.k), gen(i), set()
        ),
        "sd beta_ts": lambda p, i: speculative(
            target_lm, drafter_lm, p, new, sampling, BetaTS(1, 1, 10, i), gen(i), set()
        ),
        "rsd_c " + "-".join(map(str, args.branching)): lambda p, i: recursive_speculative(
            target_lm, drafter_lm, p, new, sampling, TreeShape.constant(args.branching), gen(i), set()
        ),
        f"rsd_s {args.beam[0]}x{args.beam[1]}": lambda p, i: recursive_speculative(
            target_lm, drafter_lm, p, new, sampling, TreeShape.beam(*args.beam), gen(i), set()
        ),
    }
    model = SelfSpeculative(target, from_target(target, args.draft_layers, 1))
    methods[f"eesd K={args.k}"] = lambda p, i: self_speculative(
        model, p, new, sampling, FixedK(args.k), gen(i), set()
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, target.config.vocab_size, (args.prompt_length,), generator=generator)
        for _ in range(args.prompts)
    ]
    for method in methods.values():
        method(prompts[0], -1)
    names = list(methods)
    results: dict[str, list[Generation]] = {name: [] for name in names}
    for index, prompt in enumerate(prompts):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            results[name].append(methods[name](prompt, index))
    print(f"device {args.device}, T={args.temperature:g}, {args.prompts} prompts x {new} new tokens")
    if args.temperature == 0:
        same = all(
            g.tokens == r.tokens for name in names for g, r in zip(results[name], results["ar"], strict=True)
        )
        print(f"identical to ar: {'yes' if same else 'NO'}")
    ar_rate = summarize(results["ar"], None)["token_rate"]
    print(f"{'decoder':<16}{'tokens/s':>10}{'speedup':>9}{'block eff.':>12}{'accept':>8}{'overhead':>10}")
    for name in names:
        m = summarize(results[name], None)
        accept = f"{m['acceptance_rate']:.0%}" if m["acceptance_rate"] is not None else "-"
        print(f"{name:<16}{m['token_rate']:>10.1f}{m['token_rate'] / ar_rate:>9.2f}{m['block_efficiency']:>12.2f}"
              f"{accept:>8}{m['overhead_share']:>10.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
