"""The runtime a run drives: the pipelines that place the workers in this process or as Ray
actors (``pipelines``, ``ray_pipeline``, ``placement``), their supervision (heartbeats, the
watchdog, worker loss), the run's own processes (tags, the reaper) and preemption by signal.
It decides no schedule (``schedule/``) and runs no training loop (``controller/``)."""
