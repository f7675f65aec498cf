"""The node agent: the per-machine daemon that owns the snapshot slots in shared memory, persists
them to storage and serves its trainers over a local socket (``flashckpt agent``).

Never imports torch (a machine starts its agent in ~0.1 s) nor anything from ``trainer/``."""
