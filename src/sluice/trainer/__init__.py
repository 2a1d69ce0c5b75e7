"""The trainer: step planning and micro-batching, the streaming train worker, advantage
estimators (``algos/``) and policy losses (``losses/``). Models run in ``sluice.engines``."""
