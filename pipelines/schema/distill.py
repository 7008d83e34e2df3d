"""The distill block: self-distillation of the target at several temperatures."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.schema.common import StrictModel


class DistillConfig(StrictModel):
    """The target answers the data.distill prompts; records feed finetune and early_exit."""

    enabled: bool = True
    backend: Literal["hf", "vllm", "openai"] = "hf"
    """`hf`: local transformers generate; `vllm`: the offline vLLM engine (GPU); `openai`: any
    OpenAI-compatible server (vllm serve, transformers serve, SGLang)."""
    prompt_format: Literal["vicuna", "chat_template"] = "vicuna"
    """`vicuna`: the Vicuna v1.1 system prompt and `USER: ... ASSISTANT:` (seed 003 F.2);
    `chat_template`: the target tokenizer's own chat template."""
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 0.3, 0.7, 1.0])
    samples_per_prompt: int = 1
    """Samples per prompt and temperature > 0 (greedy is generated once)."""
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: list[str] = Field(default_factory=list)
    seed: int = 0
    batch_size: int = 32
    """Prompts per generate call (hf) or per flushed batch of records."""
    open_fraction: float = 0.0
    """Open-source rows (data.open) added to the mix, as a fraction of the distilled records."""
    eval_fraction: float = 0.02
    """Share of the mix held out for the trainers' eval loss and top-1 agreement."""
