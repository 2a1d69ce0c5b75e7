"""The run: the training loop (``loop``, with the ``sync`` barrier schedule and the ``async``
streaming one), a whole training run around it (``training``), checkpoints and resume, the typed
run object, and the multi-controller's driver (``multi``). The workers it drives, where they are
placed and how they are watched are ``runtime/``; the staleness rule is ``schedule/``. Components
never import it."""
