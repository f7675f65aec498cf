"""RNG states (torch, CUDA, numpy, python) as JSON, so they travel without pickle."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process, JSON-serialisable."""
    py = random.getstate()
    npst = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {
            "bit_generator": npst["bit_generator"],
            "key": npst["state"]["key"].tolist(),
            "pos": int(npst["state"]["pos"]),
            "has_gauss": int(npst["has_gauss"]),
            "gauss": float(npst["gauss"]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Sets the RNG states captured by :func:`capture_rng`."""
    torch.set_rng_state(_unb64(state["torch"]))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)
