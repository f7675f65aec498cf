"""The trainer side: the ``Checkpointer`` a training loop wraps, its configuration, the link to
the node agent, snapshots into shared memory, and the restore on entry (``trainer/restore/``)."""
