"""Helpers that only the benchmark scripts (and the unit tests of these helpers) use.

Role: code a ``sluice`` subcommand never reaches — writing results JSON (``report``), running real
engines on a long-tailed request mix (``engine_runs``), least-squares fits of profiled phase
times (``fit``), the simulated control loop of the product's replica rebalancer
(``rebalance_run``), and simulated agentic environments and their pipeline (``sim_env``,
``sim_agentic``). Benchmarks run as ``python benchmarks/<name>.py``, which puts this folder's
parent on ``sys.path``; ``tests/conftest.py`` does the same for the tests.

Deliberately not here: anything ``src/sluice`` imports (the product never imports benchmarks).
"""
