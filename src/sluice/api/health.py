"""The heartbeat contract of a supervised Ray actor.

Every actor a run supervises (the rollout worker, each trainer rank, the queue-task workers, the
queue's storage units and controllers, the weight registries, engine replica actors) has a
``heartbeat()`` that answers with its process's CPU seconds (``time.process_time()``: rising
while it works), served in the concurrency group ``HEALTH`` (a thread of its own), so it answers
while the actor works and falls silent only when the process is stopped or hung. It says nothing
about who pings or what silence means (``runtime/supervision.py``'s ``Watchdog`` does).
"""

from __future__ import annotations

HEALTH = "health"
"""The concurrency group of every supervised actor's ``heartbeat`` (one thread)."""
