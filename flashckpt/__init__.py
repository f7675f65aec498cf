"""flashckpt: flash checkpointing for PyTorch training.

Snapshots go into pre-allocated shared memory in a fraction of a second; a node agent persists them
to storage (safetensors + a JSON manifest, any fsspec URL) in the background; a restarted trainer
reloads from memory.
"""

from flashckpt.checkpointer import CheckpointConfig, Checkpointer, SnapshotHandle, checkpointing
from flashckpt.reading import LoadedCheckpoint, load
from flashckpt.shm import ShmSpaceError
from flashckpt.storage import CorruptCheckpointError

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "ShmSpaceError",
    "SnapshotHandle",
    "checkpointing",
    "load",
]

__version__ = "0.1.0"
