"""RNG states (torch, CUDA, numpy, python) as JSON, so they travel without pickle.

A captured state comes back from storage or shared memory, so :func:`restore_rng` checks all of it
(types, sizes, value ranges) before it sets anything: a damaged state raises naming the part, and
no generator is left half set.
"""

from __future__ import annotations

import base64
import binascii
import math
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]

_MT_WORDS = 624
"""The words of a Mersenne Twister state (python's ``random`` and numpy's ``MT19937``)."""
_U32 = 1 << 32


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


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


def _bad(part: str, problem: str) -> ValueError:
    return ValueError(
        f"the checkpoint's RNG state is damaged: {part} {problem}; it was not restored (nothing "
        "was set). Restore another step (`flashckpt ls` lists them), or, to go on with fresh "
        "random states, start the job over"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _words(part: str, words: Any, n: int) -> list[int]:
    if not isinstance(words, list) or len(words) != n:
        size = len(words) if isinstance(words, list) else type(words).__name__
        raise _bad(part, f"has {size} words, not {n}")
    if not all(_is_int(w) and 0 <= w < _U32 for w in words):
        raise _bad(part, "holds a word that is not a 32-bit unsigned integer")
    return words


def _bytes(part: str, text: Any, size: int) -> torch.Tensor:
    if not isinstance(text, str) or len(text) > 4 * (size // 3 + 1):
        raise _bad(part, f"is not the base64 of {size} bytes")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(part, "is not base64") from None
    if len(raw) != size:
        raise _bad(part, f"holds {len(raw)} bytes, not {size}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _gauss(part: str, x: Any, *, none_ok: bool) -> float | None:
    if x is None and none_ok:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise _bad(part, f"is {x!r}, not a finite number")
    return float(x)


def restore_rng(state: Any) -> None:
    """Sets the RNG states captured by :func:`capture_rng`, after checking every part.

    Raises:
        ValueError: a part is missing, of the wrong type or size, or out of range (naming it);
            then no generator was changed.
    """
    if not isinstance(state, dict):
        raise _bad("the state", f"is a {type(state).__name__}, not a JSON object")
    torch_state = _bytes("torch", state.get("torch"), torch.get_rng_state().numel())

    py = state.get("python")
    if not isinstance(py, list) or len(py) != 3:
        raise _bad("python", "is not [version, words, gauss]")
    if py[0] != random.Random.VERSION or not _is_int(py[0]):
        raise _bad("python's version", f"is {py[0]!r}, not {random.Random.VERSION}")
    internal = _words("python's words", py[1], _MT_WORDS + 1)
    if internal[-1] > _MT_WORDS:
        raise _bad("python's words", f"end with position {internal[-1]} (at most {_MT_WORDS})")
    py_state = (py[0], tuple(internal), _gauss("python's gauss", py[2], none_ok=True))

    n = state.get("numpy")
    if not isinstance(n, dict) or n.get("bit_generator") != "MT19937":
        raise _bad("numpy", "is not an MT19937 state")
    key = _words("numpy's key", n.get("key"), _MT_WORDS)
    pos, has_gauss = n.get("pos"), n.get("has_gauss")
    if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos <= _MT_WORDS:
        raise _bad("numpy's position", f"is {pos!r}, not 0..{_MT_WORDS}")
    if has_gauss not in (0, 1) or isinstance(has_gauss, bool):
        raise _bad("numpy's has_gauss", f"is {has_gauss!r}, not 0 or 1")
    np_state = {
        "bit_generator": "MT19937",
        "state": {"key": np.asarray(key, dtype=np.uint32), "pos": pos},
        "has_gauss": has_gauss,
        "gauss": _gauss("numpy's gauss", n.get("gauss"), none_ok=False),
    }

    cuda: list[torch.Tensor] = []
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if not isinstance(saved, list):
            raise _bad("cuda", f"is a {type(saved).__name__}, not a list")
        for i, s in enumerate(saved[: torch.cuda.device_count()]):
            cuda.append(_bytes(f"cuda[{i}]", s, torch.cuda.get_rng_state(i).numel()))

    try:
        random.setstate(py_state)
    except (TypeError, ValueError) as e:  # python's own check of what this one did not know
        raise _bad("python", f"is refused by random.setstate ({e})") from None
    torch.set_rng_state(torch_state)
    np.random.set_state(np_state)
    for i, s in enumerate(cuda):
        torch.cuda.set_rng_state(s, i)
