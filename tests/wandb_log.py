"""Reading wandb's offline run log (`run-*.wandb`) back in tests."""

from __future__ import annotations

import struct
import time

BLOCK = 32 * 1024
HEADER = 7  # ":W&B" + magic (2 bytes) + version


def read_wandb_records(path):
    """Decode a `.wandb` transaction log (a LevelDB-style log of protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", HEADER
    while offset + 7 <= len(data):
        if BLOCK - offset % BLOCK < 7:  # a block tail too short for a header is padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wait_for_record(log, kind: str, timeout: float = 30.0) -> list:
    """The records of `log` once one of `kind` is there: wandb's service process writes the log, and on a
    loaded machine the last records can land just after finish() returns (bounded wait)."""
    deadline = time.monotonic() + timeout
    records = read_wandb_records(log)
    while not any(r.WhichOneof("record_type") == kind for r in records) and time.monotonic() < deadline:
        time.sleep(0.5)
        records = read_wandb_records(log)
    return records
