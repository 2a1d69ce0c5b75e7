"""Reads back a wandb run file (``run-<id>.wandb``) for tests: wandb's own protobuf records.

wandb 0.31 ships no Python reader of its transaction log, so this walks the framing it uses
(LevelDB's log format: a 7-byte file header ``:W&B`` + magic + version, then 32 KiB blocks of
chunks, each ``crc32 (4) | length (2, LE) | type (1) | data``; FULL = 1, FIRST = 2, MIDDLE = 3,
LAST = 4) and parses each record with ``wandb.proto.wandb_internal_pb2.Record``.
"""

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history_rows(records: list[Any]) -> list[dict[str, Any]]:
    """Each ``history`` record as ``{key: value}`` (values JSON-decoded)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def config_of(records: list[Any]) -> dict[str, Any]:
    """The run's config as logged (``run`` and ``config`` records, later keys win)."""
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
