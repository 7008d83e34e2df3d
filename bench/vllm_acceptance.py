"""Why vLLM accepts far fewer draft tokens than polydraft's engine at temperature > 0 (issue 14).

On the same prompts and the same drafter, acceptance per draft position (the share of rounds whose
first i+1 drafts were all accepted, K=4) from:
- polydraft's engine (`decoding.sd`): drafts sampled from the drafter, accepted with min(1, q/p);
- polydraft's engine with `greedy_drafts` (argmax drafts, p one-hot): what vLLM's default does;
- vLLM's CPU build with `draft_sample_method` greedy (its default) and probabilistic, as installed,
  and with `rejection_sampler.expand_batch_to_tokens` replaced by a correct torch version (the CPU
  build's replacement kernel never writes its output, vLLM issue 55005).
The drafters: the run's exported de-en drafter, and the target drafting for itself (exact speculative
sampling then accepts every draft). Numbers and the explanation: bench/results/vllm_acceptance.md.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python bench/vllm_acceptance.py runs/demo/demo [--target DIR]

(the engine in this process, so that the replacement reaches vLLM's rejection sampler).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

TEMPERATURES = (0.0, 0.7, 1.0)
K = 4


def demo_prompts(run_dir: Path, tokenizer, count: int) -> list[list[int]]:
    from polydraft.data.prompts import encode_prompt

    rows = [json.loads(line) for line in (run_dir / "distill" / "prompts.jsonl").read_text().splitlines()]
    return [encode_prompt(tokenizer, row["prompt"]) for row in rows if row["pair"] == "de-en"][:count]


def per_position(rounds) -> list[float]:
    full = [r for r in rounds if r.drafted == K]
    return [sum(r.accepted > i for r in full) / len(full) for i in range(K)]


def polydraft_rows(target_dir: str, drafters: dict[str, str], prompts, max_new_tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from polydraft.decoding.control import FixedK
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.sampling import Sampling
    from polydraft.decoding.sd import speculative

    def load(path: str) -> CachedLM:
        return CachedLM(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), profile=False)

    target = load(target_dir)
    rows = []
    for name, path in drafters.items():
        drafter = load(path)
        for temperature in TEMPERATURES:
            for greedy_drafts in (False, True) if temperature else (False,):
                generator = torch.Generator().manual_seed(0)
                rounds = []
                for ids in prompts:
                    gen = speculative(
                        target, drafter, torch.tensor(ids), max_new_tokens, Sampling(temperature),
                        FixedK(K), generator, {2}, greedy_drafts=greedy_drafts,
                    )  # fmt: skip
                    rounds += gen.rounds
                engine = "polydraft, argmax drafts" if greedy_drafts else "polydraft"
                rows.append(
                    {"drafter": name, "engine": engine, "T": temperature, "acc": per_position(rounds)}
                )
                print(rows[-1], flush=True)
    return rows


def fixed_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """`expand_batch_to_tokens` as its docstring says: x[i] repeated for request i's draft tokens."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def vllm_rows(target_dir: str, drafters: dict[str, str], prompts, max_new_tokens: int) -> list[dict]:
    import vllm
    import vllm.v1.sample.rejection_sampler as rejection

    from polydraft.decoding.measurement.vllm_measure import counter_delta, spec_counters
    from polydraft.distill.vllm_backend import engine_kwargs

    shipped = rejection.expand_batch_to_tokens
    kwargs = engine_kwargs(target_dir, None, "auto", False, 1, 512, 0.4, 0, 0.25)
    kwargs.update(disable_log_stats=False)
    rows = []
    for name, path in drafters.items():
        for method in ("greedy", "probabilistic"):
            speculative = {"method": "draft_model", "model": path, "num_speculative_tokens": K,
                           "draft_sample_method": method}  # fmt: skip
            llm = vllm.LLM(**kwargs, speculative_config=speculative)
            for temperature in TEMPERATURES:
                for fixed in (False, True) if temperature else (False,):
                    rejection.expand_batch_to_tokens = fixed_expand if fixed else shipped
                    params = [vllm.SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=i)
                              for i in range(len(prompts))]  # fmt: skip
                    before = spec_counters(llm)
                    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    delta = counter_delta(before, spec_counters(llm))
                    drafts = delta["vllm:spec_decode_num_drafts"]
                    acc = [n / drafts for n in delta["vllm:spec_decode_num_accepted_tokens_per_pos"]]
                    engine = f"vLLM {method} drafts" + (", expand fixed" if fixed else "")
                    rows.append({"drafter": name, "engine": engine, "T": temperature, "acc": acc})
                    print(rows[-1], flush=True)
            rejection.expand_batch_to_tokens = shipped
            del llm
            gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--target", type=Path, default=next(Path("recipes/demo/target").glob("*/config.json")).parent
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    target_dir = str(args.target.resolve())
    drafters = {"de-en": str((args.run_dir / "export" / "de-en").resolve()), "target itself": target_dir}
    prompts = demo_prompts(args.run_dir, AutoTokenizer.from_pretrained(target_dir), args.prompts)
    rows = polydraft_rows(target_dir, drafters, prompts, args.max_new_tokens)
    rows += vllm_rows(target_dir, drafters, prompts, args.max_new_tokens)
    print("| drafter | engine | T | acceptance at positions 1-4 |\n| --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['drafter']} | {row['engine']} | {row['T']} | {' / '.join(f'{a:.2f}' for a in row['acc'])} |"
        )


if __name__ == "__main__":
    main()
