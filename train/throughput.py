"""Training throughput and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import time

import torch

# Dense bf16 tensor-core peak per GPU (no sparsity), from the vendors' data sheets. Matched on the
# CUDA device name; the first matching key wins, so more specific names come first.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "RTX 3090": 71e12,
    "RTX 4090": 165e12,
}


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU by its name (`torch.cuda.get_device_name()`); None when unknown."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matrix multiplies: every Linear weight, the LM head included even when tied.

    Embedding lookups cost no FLOPs, but a tied output head is a full matmul; counting Linear weights
    gets both right.
    """
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def train_flops_per_token(matmul_param_count: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """FLOPs of one training token (forward + backward): 6N + 12·L·d·T (PaLM, appendix B).

    The second term is attention's score and value products, counted in full as PaLM and nanoGPT do.
    """
    return 6.0 * matmul_param_count + 12.0 * num_layers * hidden_size * seq_len


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved model FLOPs over the hardware peak, or None without a known peak."""
    if not peak:
        return None
    return tokens_per_second * flops_per_token / peak


class Throughput:
    """Tokens per second over the interval since the last `rate()` call (per process)."""

    def __init__(self) -> None:
        self._tokens = 0
        self._since = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        elapsed = max(now - self._since, 1e-9)
        value = self._tokens / elapsed
        self._tokens, self._since = 0, now
        return value
