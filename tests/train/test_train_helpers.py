"""The shared training helpers: packing, loss masking, schedules, step-normalised losses, checkpoints."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from polydraft.pipelines.schema.common import SourceConfig, reader_args
from polydraft.train.checkpoint import (
    STATE_FILE,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from polydraft.train.data import collate, encode_texts, epoch_order, micro_batch_indices
from polydraft.train.losses import IGNORE_INDEX, ce_sum, scale_for_step, top1_matches, topk_kl_sum
from polydraft.train.packing import PackedStream, PackPosition
from polydraft.train.runtime import NonFiniteLoss, check_finite
from polydraft.train.schedule import build_scheduler, lr_multiplier, warmup_steps_for
from polydraft.train.stream import StreamPosition, texts
from polydraft.train.stream import documents as stream_documents


def _docs(count: int, seed: int = 0) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=rng).tolist()
    # distinct token values everywhere, so that a lost or duplicated token is visible
    out, next_token = [], 10
    for n in lengths:
        out.append(list(range(next_token, next_token + n)))
        next_token += n
    return out


def _listed(epochs: dict[int, list]):
    """A document source over in-memory epochs, as `train/stream.py` gives it: each document with the
    position after it."""

    def documents(start):
        epoch, row = (start["readers"][0]["epoch"], start["readers"][0]["row"]) if start else (0, 0)
        while epoch in epochs:
            for index in range(row, len(epochs[epoch])):
                yield epochs[epoch][index], {"readers": [{"epoch": epoch, "row": index + 1}]}
            epoch, row = epoch + 1, 0

    return documents


def test_packing_loses_and_duplicates_no_token():
    docs = _docs(50)
    expected = [t for d in docs for t in [*d, 2]]
    stream = PackedStream(_listed({0: docs}), seq_len=16, eos_id=2)
    sequences = stream.take(len(expected) // 16)
    assert all(len(s) == 16 for s in sequences)
    flat = [t for s in sequences for t in s]
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 16
    assert flat.count(2) == sum(1 for t in expected[: len(flat)] if t == 2)


def test_packed_stream_resumes_at_the_same_sequence_across_epochs():
    epochs = {e: [None if i == 3 else d for i, d in enumerate(_docs(7, seed=e))] for e in range(10)}
    straight = PackedStream(_listed(epochs), seq_len=24, eos_id=2)
    first = straight.take(5)
    saved = PackPosition(dict(straight.position.stream), list(straight.position.carry))
    rest = straight.take(20)
    assert straight.epoch >= 1  # crossed an epoch boundary
    resumed = PackedStream(_listed(epochs), seq_len=24, eos_id=2, position=saved)
    assert resumed.take(20) == rest
    # across the epoch boundary nothing is dropped either: the stream is the concatenation of all epochs
    flat = [t for s in first + rest for t in s]
    expected = [t for e in range(10) for d in epochs[e] if d is not None for t in [*d, 2]]
    assert flat == expected[: len(flat)]


def test_an_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="no documents"):
        next(texts([], 0, StreamPosition()))


def _sources(tmp_path, rows=(5, 3)):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"alpha {i} " * (i % 3 + 1)}) + "\n" for i in range(rows[0])))
    b.write_text("".join(json.dumps({"text": f"beta {i}"}) + "\n" for i in range(rows[1])))
    return [reader_args(SourceConfig(kind="local", format="text", path=str(p)), 0, None) for p in (a, b)]


def test_the_stream_takes_sources_in_turn_and_resumes_without_reading_what_was_used(tmp_path, monkeypatch):
    sources = _sources(tmp_path)
    whole = [text for text, _ in itertools.islice(texts(sources, 7, StreamPosition()), 20)]
    # in turn while both last, then the longer one alone; then the next epoch, shuffled anew
    assert [t.split()[0] for t in whole[:8]] == ["alpha", "beta"] * 3 + ["alpha", "alpha"]
    assert sorted(whole[:8]) != whole[:8] or sorted(whole[8:16]) != whole[8:16]
    position = None
    for index, (_, after) in enumerate(texts(sources, 7, StreamPosition())):
        if index == 10:  # 3 documents into the second epoch
            position = after
            break
    import polydraft.train.stream as stream

    read = []
    normalised = stream.document_text
    monkeypatch.setattr(stream, "document_text", lambda row, fmt: read.append(row) or normalised(row, fmt))
    resumed = [text for text, _ in itertools.islice(texts(sources, 7, position), 9)]
    assert resumed == whole[11:20]
    assert len(read) == 9, "the resume read documents it had already used"


def test_every_rank_and_worker_reads_a_disjoint_share_whose_union_is_the_corpus(tmp_path):
    from polydraft.train.stream import Shard

    sources = _sources(tmp_path, rows=(40, 24))
    whole = [text for text, _ in texts(sources, 3, StreamPosition(), epochs=1)]
    shares = [[text for text, _ in texts(sources, 3, StreamPosition(), 1, Shard(s, 4))] for s in range(4)]
    assert sorted(t for share in shares for t in share) == sorted(whole)  # every document once
    assert all(abs(len(share) - len(whole) / 4) <= 2 for share in shares)  # a quarter each


def test_two_ranks_of_two_workers_consume_their_shares_in_order_and_resume_their_own(
    tmp_path, tiny_tokenizer
):
    """What the 4 readers (2 processes x 2 DataLoader workers) hand the packer: each reader's documents in
    its share's order, none twice over all of them; a process resumed from its position after its k-th
    document continues with exactly the documents that followed."""
    from polydraft.train.stream import Shard

    sources = _sources(tmp_path, rows=(40, 24))
    shares = [[text for text, _ in texts(sources, 3, StreamPosition(), 1, Shard(s, 4))] for s in range(4)]

    def decoded(ids):
        return tiny_tokenizer.decode(ids)

    seen = []
    for rank in range(2):
        got = list(itertools.islice(stream_documents(tiny_tokenizer, sources, 3, None, 2, rank, 2), 20))
        texts_got = [decoded(ids) for ids, _ in got]
        for worker in range(2):  # the DataLoader hands out its workers' documents in turn
            mine = texts_got[worker::2]
            expected = [
                decoded(tiny_tokenizer(t, add_special_tokens=False)["input_ids"])
                for t in shares[2 * rank + worker]
            ]
            assert mine == expected[: len(mine)]
        seen += texts_got
        position = got[10][1]  # after 11 documents: worker 1's turn
        resumed = [
            decoded(ids)
            for ids, _ in itertools.islice(
                stream_documents(tiny_tokenizer, sources, 3, position, 2, rank, 2), 9
            )
        ]
        assert resumed == texts_got[11:20]
    assert len(seen) == len(set(seen)) == 40  # the 40 consumed documents: none read by two readers
    prefix = [
        decoded(tiny_tokenizer(t, add_special_tokens=False)["input_ids"])
        for t, _ in itertools.islice(texts(sources, 3, StreamPosition()), 40)
    ]
    assert sorted(seen) == sorted(prefix)  # and together the stream's first 40, as one reader reads them


def test_only_response_tokens_carry_loss(tiny_tokenizer):
    prompt = "A chat. USER: Translate German to English: Guten Morgen ASSISTANT:"
    response = " Good morning, my friend"
    example = encode_texts(tiny_tokenizer, [(prompt, response)], 512)[0]
    ids, labels = example["input_ids"], example["labels"]
    assert ids[0] == tiny_tokenizer.bos_token_id and ids[-1] == tiny_tokenizer.eos_token_id
    supervised = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    # the supervised tokens are a suffix: the response then EOS, and decode to exactly the response
    assert supervised == list(range(supervised[0], len(ids)))
    assert [ids[i] for i in supervised] == [labels[i] for i in supervised]
    assert tiny_tokenizer.decode(ids[supervised[0] : -1]) == response
    assert tiny_tokenizer.decode(ids[: supervised[0]], skip_special_tokens=True) == prompt


def test_batched_encoding_equals_one_by_one_and_never_doubles_bos(tiny_tokenizer):
    pairs = [("USER: Hallo ASSISTANT:", " Hello"), ("<s>USER: Merci ASSISTANT:", " Thanks"), ("x" * 80, " y")]
    batched = encode_texts(tiny_tokenizer, pairs, max_length=64, chunk=2)
    assert batched == [encode_texts(tiny_tokenizer, [(p, r)], 64)[0] for p, r in pairs]
    with_bos = batched[1]["input_ids"]
    assert with_bos[0] == tiny_tokenizer.bos_token_id and with_bos[1] != tiny_tokenizer.bos_token_id


def test_truncation_that_leaves_no_response_drops_the_row(tiny_tokenizer):
    assert encode_texts(tiny_tokenizer, [("word " * 50, " answer")], 8)[0] is None
    kept = encode_texts(tiny_tokenizer, [("short", " a long answer " * 20)], 16)[0]
    assert len(kept["input_ids"]) == 16


def test_collate_pads_with_no_loss_and_no_attention():
    batch = collate([{"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [1], "labels": [1]}], 0)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6], [1, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_batch_order_is_a_function_of_seed_and_epoch_and_splits_the_same_global_batch():
    assert epoch_order(100, 0, 1) == epoch_order(100, 0, 1)
    assert epoch_order(100, 0, 1) != epoch_order(100, 0, 2)
    order = epoch_order(100, 0, 0)
    one = micro_batch_indices(order, 3, 0, 0, num_processes=1, per_device=8, grad_accum_steps=1)
    split = [
        i
        for micro in range(2)
        for rank in range(2)
        for i in micro_batch_indices(order, 3, micro, rank, num_processes=2, per_device=2, grad_accum_steps=2)
    ]
    assert sorted(one) == sorted(split) and len(set(split)) == 8


def test_step_normalised_loss_is_the_mean_over_all_tokens_of_the_step():
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 11)
    labels = torch.randint(0, 11, (4, 7))
    labels[0, :5] = IGNORE_INDEX
    labels[2, 1:] = IGNORE_INDEX
    full, count = ce_sum(logits, labels)
    # two ranks x two micro-batches of one row: what DDP averaging and accelerate's /accum then give
    total_tokens = int(count)
    parts = [ce_sum(logits[i : i + 1], labels[i : i + 1])[0] for i in range(4)]
    effective = sum(p * scale_for_step(total_tokens, 2, 2) for p in parts) / 2 / 2
    assert torch.allclose(effective, full / total_tokens)
    assert torch.allclose(
        full / total_tokens,
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1)),
    )


def test_top1_matches_and_topk_kl():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 9)
    labels = torch.cat([torch.zeros(2, 1, dtype=torch.long), logits[:, :-1].argmax(-1)], dim=1)
    labels[1, :3] = IGNORE_INDEX
    matches, count = top1_matches(logits, labels)
    assert int(matches) == int(count) == 5 + 3  # row 1: labels 3..5 remain
    assert topk_kl_sum(logits, logits, labels, top_k=3).abs() < 1e-5
    student = torch.randn(2, 6, 9)
    assert topk_kl_sum(student, logits, labels, top_k=3) > 0
    # with k = the whole vocabulary it is the exact forward KL over the loss-carrying positions
    mask = labels[:, 1:] != IGNORE_INDEX
    p, q = logits[:, :-1][mask].log_softmax(-1), student[:, :-1][mask].log_softmax(-1)
    torch.testing.assert_close(topk_kl_sum(student, logits, labels, top_k=9), (p.exp() * (p - q)).sum())


def test_warmup_then_cosine_to_the_floor():
    total = 100
    warmup = warmup_steps_for(total, 0.03)
    assert warmup == 3
    values = [lr_multiplier(s, total, warmup, "cosine", 0.1) for s in range(total)]
    assert values[0] == pytest.approx(1 / 3) and values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:], strict=False))
    assert lr_multiplier(50, total, 0, "linear", 0.0) == pytest.approx(1 - 50 / 99)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=2.0)
    scheduler = build_scheduler(optimizer, total, 0.03, "cosine", 0.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 / 3)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * 2 / 3)


def test_nonfinite_loss_names_the_step_and_the_kept_checkpoint():
    check_finite(1.5, 3, None)
    with pytest.raises(NonFiniteLoss, match=r"step 7.*kept at /x/step-5"):
        check_finite(math.nan, 7, "/x/step-5")


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def test_checkpoints_restore_model_optimizer_scheduler_rng_and_keep_the_last_k(tmp_path, accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, 10, 0.3, "cosine", 0.0)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step():
        model(torch.randn(2, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    root = tmp_path / "checkpoints"
    for n in range(1, 4):
        step()
        save_checkpoint(accelerator, root, n, {"position": n * 10}, keep=2, stateful={"scheduler": scheduler})
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000003"]
    (root / "step-00000004.partial").mkdir()  # a save killed half-way is never taken as complete
    assert list_checkpoints(root)[-1].name == "step-00000003"
    expected_weight = model.weight.detach().clone()
    step()
    after_one_more = model.weight.detach().clone()
    state = load_checkpoint(accelerator, list_checkpoints(root)[-1], stateful={"scheduler": scheduler})
    assert state == {"step": 3, "position": 30}
    assert torch.equal(model.weight, expected_weight)
    assert scheduler.last_epoch == 3
    step()  # same RNG draws, same optimizer moments, same lr: the same update as before
    assert torch.allclose(model.weight, after_one_more)


def test_resume_names_a_truncated_latest_checkpoint_and_falls_back_to_the_previous(
    tmp_path, accelerator, caplog
):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    root = tmp_path / "checkpoints"
    weights = []
    for n in (1, 2):
        model(torch.randn(2, 4)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append(model.weight.detach().clone())
        save_checkpoint(accelerator, root, n, {"position": n}, keep=2)
    latest = root / "step-00000002" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:-10])  # a disk that filled up while saving
    with caplog.at_level("WARNING", logger="polydraft.train.checkpoint"):
        checkpoint, state = resume_checkpoint(accelerator, root)
    assert checkpoint.name == "step-00000001" and state == {"step": 1, "position": 1}
    assert torch.equal(model.weight, weights[0])
    assert f"step-00000002 is damaged ({latest}: truncated" in caplog.text
    (root / "step-00000001" / STATE_FILE).write_text("{")
    with pytest.raises(ValueError, match=f"no checkpoint under {root} can be loaded"):
        resume_checkpoint(accelerator, root)
    assert resume_checkpoint(accelerator, tmp_path / "none") is None


def test_length_grouping_pads_less_and_keeps_every_row_once_per_epoch():
    from polydraft.train.data import MixBatches

    rng = random.Random(0)
    examples = [{"input_ids": [1] * n, "labels": [1] * n} for n in (rng.randint(5, 200) for _ in range(640))]
    plain = MixBatches(examples, 3, 4, 0, 1, 2, 0)
    grouped = MixBatches(examples, 3, 4, 0, 1, 2, 0, group_by_length=True)

    def padded(batches: MixBatches) -> tuple[int, list[int]]:
        cells, seen = 0, []
        for step in range(batches.steps_per_epoch):
            for micro in batches.micro_batches(step):
                cells += micro["input_ids"].numel()
                seen += [int(n) for n in micro["attention_mask"].sum(1)]
        return cells, sorted(seen)

    (plain_cells, plain_rows), (grouped_cells, grouped_rows) = padded(plain), padded(grouped)
    assert grouped_rows == plain_rows == sorted(len(e["input_ids"]) for e in examples)  # every row once
    real = sum(grouped_rows)
    assert grouped_cells < 1.05 * real < plain_cells / 1.4, (grouped_cells, real, plain_cells)
    again = MixBatches(examples, 3, 4, 0, 1, 2, 0, group_by_length=True)  # a resumed run replays it
    assert all(
        torch.equal(a["input_ids"], b["input_ids"])
        for step in (0, 17, 79)
        for a, b in zip(grouped.micro_batches(step), again.micro_batches(step), strict=True)
    )


def test_a_pretraining_checkpoint_of_another_process_count_or_an_older_version_is_refused():
    from types import SimpleNamespace

    from polydraft.train.data import PackedBatches
    from polydraft.train.drafter import rank_state

    two = [{"stream": None, "carry": []}, {"stream": None, "carry": [1]}]
    assert rank_state(two, SimpleNamespace(num_processes=2, process_index=1)) == two[1]
    with pytest.raises(ValueError, match="positions of 2 processes and this run has 3"):
        rank_state(two, SimpleNamespace(num_processes=3, process_index=0))
    batches = PackedBatches(lambda start: iter(()), 16, 0, 2, 1, 1)
    batches.restore({"stream": None, "carry": []})  # a checkpoint at the very start
    for older in ({"stream": {"epoch": 0, "row": 3}, "carry": []}, {"documents": 40, "carry": []}):
        with pytest.raises(ValueError, match="older version"):
            batches.restore(older)


def test_a_streaming_hf_source_is_shared_by_two_ranks_of_two_workers_and_resumes(tmp_path):
    """A streaming `datasets` source (a local folder of 8 JSONL files, read as the hub's are) over 2 ranks
    x 2 DataLoader workers: one epoch's 40 rows read once each (datasets would otherwise split each
    reader's share again by worker), and a rank resumed after an odd count of documents goes on with
    the same documents in the same order."""
    from polydraft.models.tiny import train_tokenizer

    data = tmp_path / "corpus" / "data"
    data.mkdir(parents=True)
    rows = [f"shard {s} row {r}" for s in range(8) for r in range(5)]
    for s in range(8):
        (data / f"train-{s:05d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in rows[s * 5 : (s + 1) * 5])
        )
    tokenizer = train_tokenizer(rows * 5, vocab_size=300)
    sources = [
        reader_args(SourceConfig(kind="hf", format="text", path=str(data.parent), streaming=True), 0, None)
    ]
    read = {
        rank: list(itertools.islice(stream_documents(tokenizer, sources, 5, None, 2, rank, 2), 20))
        for rank in (0, 1)
    }
    names = sorted(tokenizer.decode(ids) for rank in read for ids, _ in read[rank])
    assert names == sorted(rows)  # every row of the epoch once over the 4 readers
    resumed = list(itertools.islice(stream_documents(tokenizer, sources, 5, read[1][10][1], 2, 1, 2), 9))
    assert [ids for ids, _ in resumed] == [ids for ids, _ in read[1][11:]]
