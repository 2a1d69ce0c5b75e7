"""What ``run.mode`` implies for the other sections, checked on the raw config before validation.

``run.mode: sync`` is the barrier schedule at η = 0 of the same workers as ``async``: it sets
``rollout.max_staleness`` to 0 and refuses a staleness bound or ``rollout.forced_lag`` (both
need overlap). Every other option means the same in both modes. ``check_controller``: what
``run.controller: multi`` cannot run yet. Deliberately not here: the sections themselves
(``config/models.py``).
"""

from __future__ import annotations

from typing import Any

FALSE = (None, False, "false", "False")


def sync_is_eta_zero(data: Any) -> Any:
    """``data`` (a config mapping, its sections mappings or models) with ``rollout.max_staleness: 0``
    when ``run.mode`` is ``sync``; a ``ValueError`` naming the field for an option that needs
    ``async``."""
    if not isinstance(data, dict):
        return data
    run, rollout = data.get("run") or {}, data.get("rollout") or {}
    mode = run.get("mode") if isinstance(run, dict) else getattr(run, "mode", None)
    if mode != "sync":
        return data
    given = rollout if isinstance(rollout, dict) else {k: getattr(rollout, k) for k in rollout.model_fields_set}
    if given.get("max_staleness", 0) not in (0, "0"):
        raise ValueError("rollout.max_staleness: run.mode=sync trains on-policy (η = 0); use run.mode=async")
    if given.get("forced_lag") not in FALSE:
        raise ValueError("rollout.forced_lag: holds an asynchronous trainer behind; needs run.mode=async")
    if isinstance(rollout, dict):
        return {**data, "rollout": {**rollout, "max_staleness": 0}}
    return {**data, "rollout": rollout.model_copy(update={"max_staleness": 0})}


def check_controller(config: Any) -> None:
    """``run.controller: multi`` (a ``SluiceConfig``) runs single-turn tasks on Ray, without
    redundant prompts; several rollout workers need it. One ``ValueError`` naming the field."""
    run, workers = config.run, config.resources.rollout.workers
    if run.controller == "single":
        if workers > 1:
            raise ValueError(f"resources.rollout.workers={workers} needs run.controller: multi")
        return
    refused = {
        "run.backend": run.backend != "ray",
        "rollout.redundant_groups": config.rollout.redundant_groups > 0,
        "agentic.env": config.agentic.env is not None or config.agentic.agent is not None,
        "rollout.forced_lag": config.rollout.forced_lag,
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name}: not available with run.controller=multi (docs/dag.md); use single")
