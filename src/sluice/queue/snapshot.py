"""A queue snapshot cut down to some groups' rows: what a checkpoint keeps of the TransferQueue.

The queue's snapshot layout (``LocalQueue.snapshot``: storage metas and columns, each task's
controller state, partitions, the consumption ledger) is the queue's own; this is the one place
outside the backends that reads it. Deliberately not here: deciding which groups to keep (the
checkpoint's cut does) or writing files.
"""

from __future__ import annotations

from typing import Any


def groups_snapshot(snapshot: dict[str, Any], group_ids: set[int]) -> dict[str, Any]:
    """``snapshot`` reduced to the rows of ``group_ids``, with every task's readiness rebuilt from
    the columns those rows hold and nothing consumed: the rows are untrained, and a task that had
    already read one (the frozen reference) reads it again and writes the same values. Rows of
    other groups, and freed rows, are left out."""
    storage = snapshot["storage"]
    meta = [row for row in storage["meta"] if row[1] in group_ids]  # [index, group_id, ...]
    keep = {row[0] for row in meta}
    columns: dict[str, dict[str, list[Any]]] = {}
    for name, col in storage["columns"].items():
        pairs = [(i, v) for i, v in zip(col["indices"], col["values"], strict=True) if i in keep]
        columns[name] = {"indices": [i for i, _ in pairs], "values": [v for _, v in pairs]}
    present = {name: set(col["indices"]) for name, col in columns.items()}
    tasks = {}
    for task, ctl in snapshot["tasks"].items():
        inputs = list(ctl["input_columns"])
        ready, pending = [], []
        for row in meta:
            missing = sorted(c for c in inputs if row[0] not in present.get(c, ()))
            if missing:
                pending.append([row, missing])
            else:
                ready.append(row)
        tasks[task] = {"input_columns": inputs, "ready": ready, "pending": pending, "consumed": [], "partitions": []}
    return {"storage": {"meta": meta, "columns": columns, "freed": []}, "tasks": tasks, "partitions": [], "ledger": []}
