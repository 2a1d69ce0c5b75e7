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
    other groups, and freed rows, are left out; the kept rows' partitions keep their declared
    size and their rows' tokens (a step's shard split is cut again from them)."""
    storage = snapshot["storage"]
    meta = [row for row in storage["meta"] if row[1] in group_ids]  # [index, group_id, ...]
    keep = {row[0] for row in meta}
    columns: dict[str, dict[str, list[Any]]] = {}
    for name, col in storage["columns"].items():
        pairs = [(i, v) for i, v in zip(col["indices"], col["values"], strict=True) if i in keep]
        columns[name] = {"indices": [i for i, _ in pairs], "values": [v for _, v in pairs]}
    present = {name: set(col["indices"]) for name, col in columns.items()}
    kept, parts = _partitions_of(meta, snapshot.get("partitions", []))
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
        tasks[task] = {"input_columns": inputs, "ready": ready, "pending": pending, "consumed": [], "partitions": parts}
    storage = {"meta": meta, "columns": columns, "freed": []}
    return {"storage": storage, "tasks": tasks, "partitions": kept, "ledger": []}


def _partitions_of(meta: list[list[Any]], declared: list[list[int]]) -> tuple[list[list[int]], list[list[Any]]]:
    """The kept rows' partitions (a multi-controller run's steps): their declared row counts, and
    each task's view of them — every kept row's tokens, nothing consumed, no split cut yet."""
    expected = {pid: n for pid, n in declared}
    tokens: dict[int, list[list[int]]] = {}
    for row in meta:  # [index, group_id, version, num_tokens, group_size, partition]
        if row[5] >= 0:
            tokens.setdefault(row[5], []).append([row[0], row[3]])
    kept = [[pid, expected[pid]] for pid in sorted(tokens)]
    return kept, [[pid, expected[pid], tokens[pid], 0, []] for pid in sorted(tokens)]
