"""The TransferQueue benchmark's workload and measuring aids, shared by both sides of the comparison.

Imported by ``transfer_queue.py`` (sluice's venv) and by ``tq_reference.py`` (the reference
package's throwaway venv), so it needs only torch and the standard library: the token rows
(lengths uniform in ``[lo, hi]``, int64, token 0 of each row is its id so every returned row can
be checked), percentiles, and ``ForeignLoad``, which reads ``/proc`` to tell how much CPU other
programs used while a section ran (this process and its descendants, Ray's included, are "own").
"""

from __future__ import annotations

import os
import threading
import time

import torch

VOCAB = 152_064


def make_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def make_rows(lengths: list[int], seed: int, first_id: int = 0) -> list[torch.Tensor]:
    """Random int64 token rows ``[len]``; token 0 of row ``k`` is ``first_id + k``."""
    g = torch.Generator().manual_seed(seed + 1)
    flat = torch.randint(0, VOCAB, (sum(lengths),), generator=g, dtype=torch.int64)
    rows = [r.clone() for r in torch.split(flat, lengths)]
    for k, r in enumerate(rows):
        r[0] = first_id + k
    return rows


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 1])."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def stream_summary(
    label: str, split: bool, results: list[dict], put_start: dict[int, float], lengths: list[int], t0: float
) -> dict:
    """Check a streaming run (every row exactly once per split, to every consumer otherwise; lengths)
    and summarise it: wall time from ``t0`` to the last row received, rows/s, latency percentiles."""
    ids, want = [set(r["recv"]) for r in results], set(range(len(lengths)))
    lost = ids[0] & ids[1] or ids[0] | ids[1] != want if split else any(s != want for s in ids)
    if lost or any(n != lengths[i] for r in results for i, n in r["lens"].items()):
        raise RuntimeError(f"{label}: rows lost, duplicated or of the wrong length")
    wall = max(max(r["recv"].values()) for r in results) - t0
    lat = [t - put_start[i] for r in results for i, t in r["recv"].items()]
    return {
        "wall_s": wall,
        "rows_per_s": len(lengths) / wall,
        "latency_p50_s": pct(lat, 0.5),
        "latency_p99_s": pct(lat, 0.99),
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput among repeated stream runs, with every run's numbers kept."""
    middle = sorted(runs, key=lambda r: r["rows_per_s"])[len(runs) // 2]
    return {**middle, "runs_rows_per_s": [r["rows_per_s"] for r in runs]}


def _cpu_seconds() -> dict[int, tuple[float, int]]:
    """pid -> (user + system CPU seconds, parent pid) for every readable process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[1]))
    return out


class ForeignLoad:
    """CPU cores used by other programs (and by this process tree) while a ``with`` block runs."""

    def __init__(self, interval: float = 0.5) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.foreign_cpu = self.own_cpu = 0.0
        self._t0 = self._t1 = 0.0

    def _own(self, snap: dict[int, tuple[float, int]]) -> set[int]:
        own, children = {os.getpid()}, {}
        for pid, (_, ppid) in snap.items():
            children.setdefault(ppid, []).append(pid)
        stack = [os.getpid()]
        while stack:
            for c in children.get(stack.pop(), []):
                if c not in own:
                    own.add(c)
                    stack.append(c)
        return own

    def _accumulate(self) -> None:
        snap = _cpu_seconds()
        own = self._own(snap)
        for pid, (t, _) in snap.items():
            dt = t - self._last[pid][0] if pid in self._last else t
            if own.__contains__(pid):
                self.own_cpu += dt
            else:
                self.foreign_cpu += dt
        self._last = snap

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._accumulate()

    def __enter__(self) -> ForeignLoad:
        self._last = _cpu_seconds()
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._t1 = time.monotonic()
        self._accumulate()

    @property
    def foreign_cores(self) -> float:
        return self.foreign_cpu / max(1e-9, self._t1 - self._t0)

    @property
    def own_cores(self) -> float:
        return self.own_cpu / max(1e-9, self._t1 - self._t0)
