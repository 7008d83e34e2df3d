"""A drafter measured inside vLLM (`speculative_config={"method": "draft_model", ...}`), beside polydraft's
own engine: acceptance per draft position, mean accepted length and block efficiency from vLLM's own
spec-decode counters, and tokens/s with and without the drafter at several batch sizes on the same prompts.
The measure stage turns the results into result rows of engine `vllm` (`decoding.measurement.vllm_rows`).

The definitions are those of `decoding.measurement.metrics`, computed from vLLM's counters: a request's first target
step (the prefill) yields one token and drafts nothing, every later step verifies one draft of K tokens, so
- block efficiency = generated tokens / (requests + drafts);
- mean accepted length = accepted draft tokens / drafts;
- acceptance per position i = drafts whose first i+1 tokens were all accepted / drafts;
- acceptance rate (v_d) = accepted draft tokens / draft tokens.
Every request carries its own seed (`seed + prompt index`), so the target's samples do not depend on the
batch they are in.

Two behaviours of vLLM 0.32 matter at temperature > 0 (see `bench/results/vllm_acceptance.md`):
- by default the draft model proposes its argmax token and the rejection sampler treats the draft
  distribution as one-hot (`draft_sample_method="greedy"`, vLLM pull request 16899): lossless, but a token
  is accepted with the target's probability of the draft's argmax, not min(1, p/q) as in polydraft's
  engine; `draft_sample_method="probabilistic"` samples drafts and keeps their probabilities;
- on the CPU build the verification divides the target's logits by uninitialised memory instead of the
  requests' temperatures (the CPU replacement of `expand_batch_to_tokens` writes a temporary copy; vLLM
  issue 55005), so at temperature > 0 both acceptance and the sampled tokens are wrong there.
Each result says which engine, build and draft method produced it.

The engines are created in the calling process (the CPU build also changes that process: it replaces
`torch.set_num_threads` and binds OpenMP threads); run this in a process of its own.
"""

from __future__ import annotations

import gc
import time
from typing import Any

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters so far (`LLM(..., disable_log_stats=False)`)."""
    found: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS}
    found[PER_POSITION] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            found[metric.name] = int(metric.value)
        elif metric.name == PER_POSITION:
            found[PER_POSITION] = [int(v) for v in metric.values]
    return found


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    delta = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    old = before[PER_POSITION] or [0] * len(after[PER_POSITION])
    delta[PER_POSITION] = [a - b for a, b in zip(after[PER_POSITION], old)]
    return delta


def acceptance_metrics(counters: dict[str, Any], requests: int, new_tokens: int) -> dict[str, Any]:
    """The metrics of `decoding.measurement.metrics` from vLLM's counters over `requests` generations of `new_tokens`
    tokens in all."""
    drafts = counters["vllm:spec_decode_num_drafts"]
    draft_tokens = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "generated_tokens": new_tokens,
        "target_calls": requests + drafts,
        "block_efficiency": new_tokens / (requests + drafts) if requests + drafts else None,
        "mean_accepted_length": accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_per_position": [n / drafts for n in counters[PER_POSITION]] if drafts else [],
    }


def timed_generate(llm: Any, prompts: list[list[int]], params: list[Any], batch_size: int):
    """All prompts, `batch_size` per `generate` call; returns (token ids per prompt, requests that stopped
    at an end-of-sequence token, seconds)."""
    outputs: list[list[int]] = []
    stops = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": ids} for ids in prompts[first : first + batch_size]]
        for output in llm.generate(batch, params[first : first + batch_size], use_tqdm=False):
            outputs.append(list(output.outputs[0].token_ids))
            stops += output.outputs[0].finish_reason == "stop"
    return outputs, stops, time.perf_counter() - start


def measure_in_vllm(
    target: str,
    drafter: str,
    prompt_sets: dict[str, list[list[int]]],
    temperatures: list[float],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    top_p: float = 1.0,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    repeats: int = 1,
    seed: int = 0,
    draft_sample_method: str = "greedy",
    max_model_len: int | None = None,
    cpu_kv_cache_gib: float = 1.0,
) -> list[dict[str, Any]]:
    """Measure `drafter` as vLLM's draft model for `target` (folders or hub ids) on each named set of
    prompts (token ids), one result per set and temperature (`top_p` applies at temperature > 0).

    Two engines, the target alone and the target with the drafter, decode every prompt at every batch
    size, alternating engine by engine within each of `repeats` rounds so that timing noise hits both.
    Acceptance comes from the drafter engine's counters over all its passes; tokens/s per batch size is
    the mean over the repeats. At temperature 0 `matches_target` says whether both engines generated the
    same tokens for every prompt.
    """
    import vllm

    from polydraft.distill.vllm_backend import engine_kwargs, on_cpu

    cpu = on_cpu()
    longest = max(len(p) for prompts in prompt_sets.values() for p in prompts)
    context = max_model_len or longest + max_new_tokens + num_speculative_tokens + 8
    kwargs = engine_kwargs(
        target, None, "auto", False, 1, context, 0.4, seed, cpu_kv_cache_gib if cpu else None
    )
    kwargs.update(enforce_eager=True, disable_log_stats=False)
    speculative = {
        "method": "draft_model",
        "model": drafter,
        "num_speculative_tokens": num_speculative_tokens,
        "draft_sample_method": draft_sample_method,
    }
    engines = {"target": vllm.LLM(**kwargs), "drafter": vllm.LLM(**kwargs, speculative_config=speculative)}
    results = []
    for name, prompts in prompt_sets.items():
        for temperature in temperatures:
            params = [
                vllm.SamplingParams(
                    temperature=temperature,
                    top_p=top_p if temperature > 0 else 1.0,
                    max_tokens=max_new_tokens,
                    seed=seed + index,
                )
                for index in range(len(prompts))
            ]
            results.append(
                _one_temperature(engines, prompts, params, batch_sizes, repeats)
                | {
                    "engine": "vllm",
                    "vllm": vllm.__version__,
                    "device": "cpu" if cpu else "cuda",
                    "target": target,
                    "drafter": drafter,
                    "dataset": name,
                    "temperature": temperature,
                    "top_p": top_p if temperature > 0 else 1.0,
                    "seed": seed,
                    "draft_length": num_speculative_tokens,
                    "draft_sample_method": draft_sample_method,
                    "repeats": repeats,
                }
            )
    del engines
    gc.collect()
    return results


def _one_temperature(
    engines: dict[str, Any],
    prompts: list[list[int]],
    params: list[Any],
    batch_sizes: tuple[int, ...],
    repeats: int,
) -> dict[str, Any]:
    seconds: dict[tuple[str, int], float] = {}
    tokens: dict[tuple[str, int], int] = {}
    outputs: dict[str, list[list[int]]] = {}
    stops: dict[str, int] = {}
    before = spec_counters(engines["drafter"])
    passes, drafted_tokens = 0, 0
    for _ in range(repeats):
        for batch_size in batch_sizes:
            for name, llm in engines.items():
                generated, stopped, elapsed = timed_generate(llm, prompts, params, batch_size)
                seconds[(name, batch_size)] = seconds.get((name, batch_size), 0.0) + elapsed
                tokens[(name, batch_size)] = sum(len(g) for g in generated)
                outputs.setdefault(name, generated)
                stops.setdefault(name, stopped)
            passes += 1
            drafted_tokens += tokens[("drafter", batch_size)]
    counters = counter_delta(before, spec_counters(engines["drafter"]))
    result: dict[str, Any] = {
        "prompts": len(prompts),
        "new_tokens": sum(len(g) for g in outputs["drafter"]),
        "eos_stops": stops["drafter"],
        **acceptance_metrics(counters, passes * len(prompts), drafted_tokens),
        "matches_target": outputs["target"] == outputs["drafter"] if params[0].temperature == 0 else None,
        "token_rate": {},
    }
    for batch_size in batch_sizes:
        rates = {
            name: tokens[(name, batch_size)] / (seconds[(name, batch_size)] / repeats) for name in engines
        }
        result["token_rate"][batch_size] = {
            "without_drafter": rates["target"],
            "with_drafter": rates["drafter"],
            "speedup": rates["drafter"] / rates["target"],
        }
    return result


def _main() -> None:
    """`python -m polydraft.decoding.measurement.vllm_measure < request.json`: the keyword arguments of `measure_in_vllm` as a
    JSON object on stdin, the result as one JSON line on stdout (a process of its own, as it needs)."""
    import json
    import sys

    from polydraft.distill.engines import die_with_parent

    die_with_parent()  # no vLLM process outlives a killed measure stage
    request = json.loads(sys.stdin.read())
    request["batch_sizes"] = tuple(request.get("batch_sizes", (1, 8, 32)))
    print(json.dumps(measure_in_vllm(**request)), flush=True)


if __name__ == "__main__":
    _main()
