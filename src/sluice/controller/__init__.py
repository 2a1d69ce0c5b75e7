"""The controller: the main loops (``sync_loop``, ``async_loop``), the staleness gate, the group
ledger, and worker placement (``pipelines``). Components never import it."""
