"""flashckpt: flash checkpointing for PyTorch training.

Snapshots go into pre-allocated shared memory in a fraction of a second; a node agent persists them
to storage (safetensors + a JSON manifest, any fsspec URL) in the background; a restarted trainer
reloads from memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flashckpt.errors import (
    AgentDaemonError,
    AgentError,
    CheckpointDataError,
    CorruptCheckpointError,
    ElasticJobError,
    EtcdError,
    FlashckptError,
    LocalMachineError,
    PersistError,
    ShmSpaceError,
    StorageError,
    StorageRootRefused,
    StorageUnavailableError,
)

if TYPE_CHECKING:
    from flashckpt.offline.reading import LoadedCheckpoint, load
    from flashckpt.trainer.checkpointer import (
        CheckpointConfig,
        Checkpointer,
        SnapshotHandle,
        checkpointing,
    )

__all__ = [
    "AgentDaemonError",
    "AgentError",
    "CheckpointConfig",
    "CheckpointDataError",
    "Checkpointer",
    "CorruptCheckpointError",
    "ElasticJobError",
    "EtcdError",
    "FlashckptError",
    "LoadedCheckpoint",
    "LocalMachineError",
    "PersistError",
    "ShmSpaceError",
    "SnapshotHandle",
    "StorageError",
    "StorageRootRefused",
    "StorageUnavailableError",
    "checkpointing",
    "load",
]

__version__ = "0.1.0"

# The trainer-side API needs torch; it is imported on first use, so that the node agent
# (``python -m flashckpt agent``, which imports this package first) never imports torch.
_LAZY = {
    "CheckpointConfig": "flashckpt.trainer.checkpointer",
    "Checkpointer": "flashckpt.trainer.checkpointer",
    "SnapshotHandle": "flashckpt.trainer.checkpointer",
    "checkpointing": "flashckpt.trainer.checkpointer",
    "LoadedCheckpoint": "flashckpt.offline.reading",
    "load": "flashckpt.offline.reading",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flashckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
