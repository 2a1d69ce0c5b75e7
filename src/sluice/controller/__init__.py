"""The controller: the training loop (``loop``, with the ``sync`` barrier schedule and the
``async`` streaming one), the staleness gate, the group ledger, checkpoints, the typed run
object, and worker placement (``pipelines``, ``ray_pipeline``). Components never import it."""
