"""The controller: the main loops of sluice (synchronous now; asynchronous with the staleness gate next)."""
