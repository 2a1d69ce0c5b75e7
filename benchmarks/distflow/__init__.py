"""The DistFlow benchmark runtime: a multi-controller and a single-controller driver of a DAG plan's
model-free nodes on Ray (``runtime.py``), their workers (``worker.py``), admission gate
(``gate.py``), cheap control calls (``peer.py``) and the driver's byte count (``transport.py``).

Only ``benchmarks/dag.py`` and its tests run it; no ``sluice`` command does. A training run's
multi-controller is ``run.controller: multi`` (``sluice.controller.multi``). Importable with
``benchmarks/`` on ``sys.path`` (the benchmark's own directory; ``tests/conftest.py`` adds it).
"""

import sys

from ray import cloudpickle

# Ray workers do not have ``benchmarks/`` on their path: actors of this package travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
