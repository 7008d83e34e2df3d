"""The chunked loss and gradient checkpointing change the memory, not the loss or the gradients (to 1e-5)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from polydraft.models.early_exit import from_target
from polydraft.models.heads import Heads
from polydraft.train.chunked_loss import OutputHead, Teacher, chunked_loss, model_head
from polydraft.train.drafter import step_loss
from polydraft.train.early_exit import exit_loss
from polydraft.train.heads import ce_sums, chunked_ce_sums, head_labels, heads_forward
from polydraft.train.losses import IGNORE_INDEX, ce_sum, topk_kl_sum

TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB = 96


def tiny(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    shape = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    }  # fmt: skip
    if family == "gemma2":  # tied embeddings, and a cap low enough to bend these logits
        config = Gemma2Config(**shape, final_logit_softcapping=0.5, attn_implementation="eager")
        return Gemma2ForCausalLM(config).float()
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 11))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, :2] = IGNORE_INDEX
    labels[1, 7:] = IGNORE_INDEX  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, params))


def assert_same(a: torch.Tensor, b: torch.Tensor, params: list[torch.Tensor]) -> None:
    torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    for ga, gb in zip(grads(a, params), grads(b, params), strict=True):
        torch.testing.assert_close(ga, gb, **TOL)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("with_teacher", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_loss_equals_the_full_logits_loss(softcap, with_teacher, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    bias = torch.randn(VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    labels[1, 6:] = IGNORE_INDEX
    head = OutputHead(weight, bias, softcap)
    # logits ~ N(0, 1.2) against a cap of 1.5: bent, never saturated (tanh's ties would make the top-k
    # an arbitrary pick among equal tokens)
    teacher_hidden, teacher_head = torch.randn(2, 9, 16), OutputHead(0.3 * torch.randn(VOCAB, 16), None, 1.5)
    teacher = Teacher(teacher_hidden, teacher_head, 5, 0.3) if with_teacher else None

    chunked = chunked_loss(hidden, labels, head, chunk, teacher)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    full = ce_sum(logits, labels)[0]
    if with_teacher:
        capped = torch.tanh(teacher_hidden @ teacher_head.weight.T / 1.5) * 1.5
        full = full + 0.3 * topk_kl_sum(logits, capped, labels, 5)
    assert_same(chunked, full, [hidden, weight, bias])


def test_no_loss_token_gives_a_zero_that_reaches_the_head():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    loss = chunked_loss(hidden, torch.full((1, 4), IGNORE_INDEX), OutputHead(weight), 2)
    assert loss.item() == 0.0 and all(g.abs().sum() == 0 for g in grads(loss, [hidden, weight]))
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_loss(hidden, torch.zeros(1, 4, dtype=torch.long), OutputHead(weight), 0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("kd", [False, True])
def test_the_drafter_loss_chunked_equals_the_full_logits_loss(family, kd):
    drafter, teacher = tiny(family, 1), tiny(family, 2) if kd else None
    assert model_head(drafter.get_output_embeddings(), drafter.config).softcap == (
        0.5 if family == "gemma2" else None
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    full = step_loss(drafter, batch(), teacher, 8, 0.5)
    assert_same(step_loss(drafter, batch(), teacher, 8, 0.5, chunk_tokens=3), full, params)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("kl", [False, True])
def test_the_exit_loss_chunked_equals_the_full_logits_loss(family, kl):
    target = tiny(family, 3).eval()
    drafter = from_target(target, 2)
    head, teacher = drafter.exit, target if kl else None
    params = list(head.parameters())
    full = exit_loss(drafter, head, batch(), teacher, 0.5, 8)
    assert_same(exit_loss(drafter, head, batch(), teacher, 0.5, 8, chunk_tokens=3), full, params)


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_the_heads_loss_chunked_equals_the_full_logits_loss(kind):
    target = tiny("llama", 4)
    torch.manual_seed(5)
    heads = Heads(kind, 3, 32, VOCAB)
    for p in heads.parameters():  # away from the identity init, so that every block matters
        p.data.normal_(0, 0.1)
    shared = target.get_output_embeddings() if kind == "bpd" else None
    hidden, labels = torch.randn(2, 11, 32), head_labels(batch()["labels"], 3)
    full = ce_sums(*heads_forward(heads, shared, hidden, labels))
    chunked = chunked_ce_sums(heads, heads, shared, hidden, labels, 2)
    weights = torch.tensor([1.0, 0.8, 0.64])
    assert_same((chunked * weights).sum(), (full * weights).sum(), list(heads.parameters()))
    torch.testing.assert_close(chunked.detach(), full.detach(), **TOL)


def counted(layer: torch.nn.Module) -> list[int]:
    """Count the calls of the checkpoint function transformers' switch installed on `layer`."""
    calls, inner = [], layer._gradient_checkpointing_func

    def wrapper(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    layer._gradient_checkpointing_func = wrapper
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_exit_layer_checkpointing_keeps_the_loss_and_grads(family):
    target = tiny(family, 6).eval()
    drafter = from_target(target, 2, 2)
    head = drafter.exit.train()
    params = list(head.parameters())
    plain = exit_loss(drafter, head, batch(), target, 0.5, 8, chunk_tokens=4)
    head.gradient_checkpointing_enable()
    calls = [counted(layer) for layer in head.layers]
    checkpointed = exit_loss(drafter, head, batch(), target, 0.5, 8, chunk_tokens=4)
    assert [len(c) for c in calls] == [1, 1]  # each exit layer ran under torch.utils.checkpoint
    assert_same(checkpointed, plain, params)


def test_drafter_checkpointing_keeps_the_loss_and_grads():
    drafter = tiny("gemma2", 7).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    plain = step_loss(drafter, batch(), None, 8, 0.5, chunk_tokens=4)
    drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert drafter.is_gradient_checkpointing
    calls = [counted(layer) for layer in drafter.model.layers]
    checkpointed = step_loss(drafter, batch(), None, 8, 0.5, chunk_tokens=4)
    assert [len(c) for c in calls] == [1] * 4
    assert_same(checkpointed, plain, params)
