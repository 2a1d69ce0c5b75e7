"""The schedule: which groups a run admits and which a step consumes, under the staleness bound.

``StalenessGate`` (``staleness.py``) is the one owner of the rule ``accepted + in_flight <
(v + η + 1) · B`` and of its deadlines (a group of version ``g`` is trained by step ``g + η``);
``GroupLedger`` (``ledger.py``) books every group's fate by it; ``FailureBudget`` (``failures.py``)
judges failed groups; ``StepGate`` (``step_gate.py``) grants the same admissions as credits to
rollout workers that pull them. Nothing here touches engines, queues, Ray or clocks; the
controller asks and acts. Imports only ``api/`` and the standard library.
"""
