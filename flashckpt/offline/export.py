"""Export a committed checkpoint to the formats other tools read, so nobody is locked in.

* ``safetensors``: one consolidated file of the full model state (sharded pieces gathered), the
  file model hubs expect.
* ``dcp``: a ``torch.distributed.checkpoint`` directory with the full model state under ``model``
  and the optimizer state keyed by parameter name under ``optimizer`` (the shape
  ``get_optimizer_state_dict`` gives; sharded and replicated checkpoints alike, from steps that
  record the parameter names). ``dcp.load`` reshards it into any world.

Both read the checkpoint without unpickling anything. (Writing the DCP format means writing its
pickled ``.metadata`` file: that is DCP's format, which its readers expect.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec
import torch

from flashckpt.format.layout import Layout, safetensors_header
from flashckpt.offline.reading import LoadedCheckpoint, load_full

__all__ = ["export_dcp", "export_safetensors", "full_model_state", "full_optimizer_state"]


def full_model_state(ck: LoadedCheckpoint, strip_prefix: str | None = None) -> dict[str, Any]:
    """The full model state of a checkpoint read by :func:`~flashckpt.offline.reading.load_full`.

    Raises:
        ValueError: the checkpoint has no model state, or a value is not a tensor.
    """
    model = ck.state.get("model")
    if not isinstance(model, dict) or not model:
        raise ValueError(f"step {ck.step} has no model state to export")
    out: dict[str, Any] = {}
    for k, v in model.items():
        key = k[len(strip_prefix) :] if strip_prefix and k.startswith(strip_prefix) else k
        if key in out:
            raise ValueError(f"two model keys become {key!r} with --strip-prefix {strip_prefix!r}")
        out[key] = v
    return out


def full_optimizer_state(
    ck: LoadedCheckpoint, strip_prefix: str | None = None
) -> dict[str, Any] | None:
    """The optimizer state keyed by parameter name (as ``get_optimizer_state_dict`` gives it).

    Args:
        ck: a checkpoint read by :func:`~flashckpt.offline.reading.load_full`.
        strip_prefix: a name prefix to drop (``module.`` of a DDP-wrapped model), as for the model.

    Returns:
        None when the checkpoint has no optimizer state or does not record the parameter names
        (steps saved by versions that recorded them for sharded checkpoints only), or a parameter
        is not one of the model's.
    """
    opt = ck.state.get("optimizer")
    names = ck.state.get("optimizer_param_names")
    if not isinstance(opt, dict) or not isinstance(names, list):
        return None
    if any(n is None for n in names):
        return None  # a parameter outside the model: no name to key it by
    if strip_prefix:
        names = [n[len(strip_prefix) :] if n.startswith(strip_prefix) else n for n in names]
    state = {names[int(i)]: dict(st) for i, st in opt.get("state", {}).items()}
    groups = []
    for g in opt.get("param_groups", []):
        g = dict(g)
        g["params"] = [names[int(i)] for i in g["params"]]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def export_safetensors(
    url: str, step: int | None, to: str, *, strip_prefix: str | None = None
) -> tuple[int, int]:
    """Writes the full model state of a committed step as one safetensors file.

    Args:
        url: the checkpoint root.
        step: the step; None exports the newest committed step.
        to: the output file (a local path or an fsspec URL).
        strip_prefix: a key prefix to drop (``module.`` of a DDP-wrapped model).

    Returns:
        The step exported and the number of tensors written.
    """
    ck = load_full(url, step)
    model = full_model_state(ck, strip_prefix)
    bad = sorted(k for k, v in model.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(
            f"model state values {bad[:5]} are not tensors: safetensors holds tensors only"
        )
    tensors = {k: v.contiguous() for k, v in model.items()}
    layout = Layout.build([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    header = safetensors_header(
        layout, {"format": "pt", "flashckpt_step": str(ck.step), "flashckpt_source": url}
    )
    _makedirs_for(to)
    with fsspec.open(to, "wb") as f:
        f.write(header)
        for e in layout.entries:
            t = tensors[e.name]
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return ck.step, len(tensors)


def export_dcp(
    url: str, step: int | None, to: str, *, strip_prefix: str | None = None
) -> tuple[int, list[str]]:
    """Writes a committed step as a ``torch.distributed.checkpoint`` directory.

    Load it with ``dcp.load({"model": model.state_dict()}, checkpoint_id=to)`` (any world size;
    DCP reshards), or the optimizer with ``get_optimizer_state_dict``/``set_optimizer_state_dict``.

    Returns:
        The step exported and the top-level keys written (``model``, maybe ``optimizer``).
    """
    import torch.distributed.checkpoint as dcp

    ck = load_full(url, step)
    state: dict[str, Any] = {"model": full_model_state(ck, strip_prefix)}
    opt = full_optimizer_state(ck, strip_prefix)
    if opt is not None:
        state["optimizer"] = opt
    if os.path.isdir(to) and os.listdir(to):
        raise FileExistsError(f"{to} is not empty: export DCP into a new directory")
    os.makedirs(to, exist_ok=True)
    dcp.save(state, checkpoint_id=to, no_dist=True)
    with open(os.path.join(to, "flashckpt.json"), "w") as f:
        json.dump({"source": url, "step": ck.step, "keys": sorted(state)}, f)
    return ck.step, sorted(state)


def _makedirs_for(to: str) -> None:
    if "://" not in to:
        parent = os.path.dirname(os.path.abspath(to))
        os.makedirs(parent, exist_ok=True)
