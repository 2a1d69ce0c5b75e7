"""The admission gate of the multi-controller runtime: credits by a small call, no sample bytes.

Generate workers ask ``acquire(n)`` for up to ``n`` group credits; a credit is the group's
sequence number ``g`` (it belongs to global batch ``g // B``) and the policy version it is
generated with. Credits follow ``StalenessGate`` (``accepted + in_flight < (v + η + 1) · B``),
so with η = 1 generation runs at most one step ahead of training. ``v`` advances when every
consuming worker reported the step done. One instance runs as a threaded Ray actor
(``ServedGate``: workers on its node call it over a Unix socket, ``peer.py``); the object itself
is plain and tested in-process.
"""

from __future__ import annotations

import threading
from typing import Any

from distflow.peer import endpoint_of
from sluice.schedule.staleness import StalenessGate


class AdmissionGate:
    def __init__(self, groups_per_step: int, max_staleness: int, steps: int, consumers: int) -> None:
        self.gate = StalenessGate(groups_per_step, max_staleness)
        self.total = groups_per_step * steps
        self.consumers = consumers
        self.version = 0
        self.granted = 0
        self.reports: dict[int, int] = {}
        self.max_lead = 0  # most steps a granted group ran ahead of the version it was granted at
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float | None = None) -> list[tuple[int, int]]:
        """Up to ``n`` credits ``(group sequence, version)``, waiting until at least one is free;
        empty once the run's groups are all granted (or on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self.granted >= self.total or self._free() > 0, timeout)
            count = min(n, self._free(), self.total - self.granted)
            grants = [(self.granted + k, self.version) for k in range(max(count, 0))]
            self.granted += len(grants)
            for g, v in grants:
                self.max_lead = max(self.max_lead, g // self.gate.groups_per_step - v)
            return grants

    def _free(self) -> int:
        return self.gate.capacity(self.version, self.granted, 0)

    def step_done(self, step: int) -> int:
        """A consuming worker finished ``step``; the version advances once all of them did."""
        with self._cond:
            self.reports[step] = self.reports.get(step, 0) + 1
            while self.reports.get(self.version, 0) >= self.consumers:
                self.version += 1
            self._cond.notify_all()
            return self.version

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"version": self.version, "granted": self.granted, "max_lead": self.max_lead}


class ServedGate(AdmissionGate):
    """The gate as the runtime's actor: also serves ``acquire`` / ``step_done`` / ``stats`` on a
    Unix socket for same-node workers (each connection has its own thread, so a waiting
    ``acquire`` blocks only its caller)."""

    DIRECT_METHODS = ("acquire", "step_done", "stats")

    def __init__(self, *args: Any) -> None:
        from sluice.queue.direct import DirectServer

        super().__init__(*args)
        self._server = DirectServer(self)

    def endpoint(self) -> tuple[str, str]:
        return endpoint_of(self._server)

    def close_transport(self) -> None:
        self._server.close()
