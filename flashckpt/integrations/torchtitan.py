"""Flash checkpoints for a torchtitan job: a drop-in for its ``CheckpointManager``.

Usage (in torchtitan's ``Trainer.__init__``, right after it builds its checkpointer)::

    from flashckpt.integrations.torchtitan import FlashCheckpointManager

    self.checkpointer = FlashCheckpointManager(self.checkpointer,
                                               storage="file:///ckpt/run1", every=50)

The trainer's loop is unchanged: it calls ``checkpointer.load(step=...)`` once before training,
``checkpointer.save(curr_step, last_step=...)`` after every step and ``checkpointer.close()`` at
the end. :class:`FlashCheckpointManager` takes the same ``states`` torchtitan's manager holds (the
model parts, the optimizers, the LR schedulers, the data loader, ``train_state`` and anything
else the trainer registered) and snapshots them into flashckpt's shared memory every ``every``
steps; its node agent persists them to ``storage``. ``load()`` restores the newest snapshot any
rank can get (memory first, then storage), RNGs included; when flashckpt holds none, torchtitan's
own ``load()`` runs (its folder, a seed checkpoint, ``initial_load_path``), which must then leave
the step at 0. At the last step torchtitan's own manager still writes its final export
(``last_save_model_only``, ``last_save_in_hf``) unless ``export_last_step=False``.

``checkpoint.exclude_from_loading`` leaves states other than the model and the optimizers out
of the restore (they are still saved): ``["dataloader"]`` is what a resume at another
data-parallel degree needs, since torchtitan's data loader cannot reshard its position (a
restore that would hand it one saved at another degree is refused, naming that key).

Each snapshot also keeps the model's parallel layout (``flashckpt_layout``); a restore at
another layout of a snapshot whose parameters' DTensor metadata does not describe the whole
split (tensor parallel in torchtitan's ``partial_dtensor`` backend) is refused (see ``_Layout``).

Refused, naming the fix: ``async_mode`` other than ``"disabled"`` (flashckpt's snapshot is
already off the training path), ``exclude_from_loading`` naming the model or the optimizers,
``load_only``, ``load(step=N)`` for a
given N (flashckpt resumes the newest step), and ``save()`` calls whose ``curr_step`` is not one
more than the steps already counted (a step skipped, or a ``train_state`` that disagrees with the
restored step).

No pickle on the load path: torchtitan's data loader keeps its position pickled
(``{"dp_rank_N": pickle.dumps(StatefulDataLoader state), "world_size": n}``) and its
``load_state_dict`` unpickles what it is handed. A snapshot carries that state as plain data
(dicts, lists, tuples, str/int/float/bool/None, tensors, through flashckpt's codec): the pickled
bytes are decoded at save time, where they are the bytes the loader has just made in this
process, and a loader state that is not plain data is refused there, naming the value. On
restore the plain data read from memory or storage is pickled again here and those bytes are
what the loader unpickles, so no byte read from a snapshot reaches ``pickle.loads``. Bytes in
any other state are handed back as they were saved, with a warning at the first snapshot (that
state's ``load_state_dict`` decides what it does with them).

torchtitan is never imported here: the adapter works on the manager object it is given, so this
module (and its tests) import without torchtitan installed.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flashckpt.state.rng import capture_rng, restore_rng
from flashckpt.trainer.checkpointer import Checkpointer
from flashckpt.trainer.config import CheckpointConfig, unknown_options

__all__ = ["FlashCheckpointManager"]

log = logging.getLogger("flashckpt")

MODEL = "model"  # torchtitan.components.checkpoint.MODEL
TRAIN_STATE = "train_state"  # torchtitan.components.checkpoint.TRAIN_STATE
DATALOADER = "dataloader"  # torchtitan.components.checkpoint.DATALOADER
OPTIMIZER = "optimizer"  # torchtitan.components.checkpoint.OPTIMIZER
_BYTES = "flashckpt_bytes"  # marks a bytes value carried as a uint8 tensor
_PLAIN = "flashckpt_unpickled"  # marks a loader's pickled state carried as plain data
_LOADER_RANK = "dp_rank_"  # ParallelAwareDataloader's key of its pickled state
_LAYOUT = "flashckpt_layout"  # the adapter's own state in a snapshot: see _Layout


class FlashCheckpointManager:
    """torchtitan's ``CheckpointManager`` interface, backed by flashckpt.

    Args:
        manager: torchtitan's ``CheckpointManager`` as the trainer built it (``checkpoint.enable``
            true, so that it holds ``states``); kept for its fallback load and final export.
        storage: the checkpoint root URL (any fsspec URL), as in :func:`flashckpt.checkpointing`;
            None keeps snapshots in memory only.
        every: snapshot every N steps, or ``"auto"``.
        export_last_step: at ``save(..., last_step=True)`` also run torchtitan's own save, for
            its final export (model-only / Hugging Face weights, as configured).
        **options: any other field of :class:`flashckpt.CheckpointConfig`.

    Attributes:
        ckpt: the :class:`flashckpt.Checkpointer` once ``load()`` or the first ``save()`` ran.
        restored_step, restored_from: the step resumed from and where it came from (``memory``,
            ``storage``, ...), None on a fresh start.
    """

    def __init__(
        self,
        manager: Any,
        storage: str | None = None,
        *,
        every: int | str = "auto",
        export_last_step: bool = True,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(CheckpointConfig.__dataclass_fields__))
        if unknown:
            msg = unknown_options(unknown)
            raise TypeError(msg.replace("checkpointing()", "FlashCheckpointManager()"))
        if not getattr(manager, "enable", False) or not isinstance(
            getattr(manager, "states", None), Mapping
        ):
            raise ValueError(
                "FlashCheckpointManager needs torchtitan's CheckpointManager built with "
                "checkpoint.enable=true (a disabled one holds no states): set "
                "--checkpoint.enable (or Config(checkpoint=...enable=True))"
            )
        mode = getattr(manager, "async_mode", "disabled")
        mode = str(getattr(mode, "value", mode))  # torchtitan's AsyncMode is a str enum
        if mode != "disabled":
            raise ValueError(
                f"checkpoint.async_mode={mode!r} with FlashCheckpointManager: flashckpt's "
                "snapshot is already copied off the training path and persisted by its node "
                "agent; set checkpoint.async_mode='disabled'"
            )
        excluded = list(getattr(manager, "exclude_from_loading", None) or [])
        kept = [k for k in excluded if k in (MODEL, OPTIMIZER)]
        if kept:
            raise NotImplementedError(
                f"checkpoint.exclude_from_loading={excluded!r}: FlashCheckpointManager restores "
                f"the model and the optimizers it saved together ({kept!r} cannot be left out). "
                "Drop them from exclude_from_loading, or use torchtitan's own CheckpointManager "
                "for this run"
            )
        if getattr(manager, "load_only", False):
            raise ValueError(
                "checkpoint.load_only=true with FlashCheckpointManager (which saves): use "
                "torchtitan's own CheckpointManager to load without saving"
            )
        states = manager.states
        unknown_keys = sorted(set(excluded) - set(states))
        if unknown_keys:
            raise ValueError(
                f"checkpoint.exclude_from_loading names {unknown_keys!r}, which the manager does "
                f"not hold (its states: {sorted(states)!r}): fix the key names"
            )
        wrapper = states.get(MODEL)
        parts = getattr(wrapper, "model", None)
        if isinstance(parts, torch.nn.Module):
            parts = [parts]
        if not parts or not all(isinstance(p, torch.nn.Module) for p in parts):
            raise TypeError(
                f"states[{MODEL!r}] is a {type(wrapper).__name__} without a list of model parts "
                "in .model (torchtitan's ModelWrapper has one)"
            )
        if TRAIN_STATE not in states:
            raise ValueError(
                f"states has no {TRAIN_STATE!r} (the trainer's step): FlashCheckpointManager "
                "checks the restored step against it; register the trainer in states"
            )
        options.update(storage=storage, every=every)
        self.config = CheckpointConfig(**options)
        self.manager = manager
        self.export_last_step = export_last_step
        self.enable = True
        self.save_future = None  # torchtitan's loop reads it; flashckpt has no save future
        self._model = _Parts(parts)
        self._stateful: dict[str, Any] = {}
        for key, obj in states.items():
            if key == MODEL or obj is None:
                continue
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"states[{key!r}] is a {type(obj).__name__}, not Stateful")
            # Optimizers go as they are: the Checkpointer counts their steps.
            if isinstance(obj, torch.optim.Optimizer):
                self._stateful[key] = obj
            elif key == DATALOADER:
                self._stateful[key] = _LoaderState(obj, key, key in excluded)
            else:
                self._stateful[key] = _BytesAsTensors(obj, key, key in excluded)
        if _LAYOUT in self._stateful:
            raise ValueError(f"states holds a key {_LAYOUT!r}, which FlashCheckpointManager uses")
        self._layout = _Layout(self._model)
        self._stateful[_LAYOUT] = self._layout
        self.ckpt: Checkpointer | None = None
        self.restored_step: int | None = None
        self.restored_from: str | None = None
        self._hook: Any = None
        self._rng_hooks: list[Any] = []
        self._closed = False

    # -- torchtitan's CheckpointManager interface ---------------------------------------------
    def load(self, step: int = -1) -> bool:
        """Restores the newest snapshot (memory first, then storage); True when one was.

        With none in flashckpt, torchtitan's own ``load(step)`` runs (its folder, a seed
        checkpoint, ``initial_load_path``): it must leave ``train_state`` at step 0.
        """
        if step != -1:
            raise NotImplementedError(
                f"load(step={step}): FlashCheckpointManager resumes the newest snapshot in "
                "memory or storage. Set checkpoint.load_step=-1, or use torchtitan's own "
                "CheckpointManager to load a given step"
            )
        if self.ckpt is not None:
            raise RuntimeError(
                "FlashCheckpointManager.load() after load() or save(): call it once, before "
                "the first training step"
            )
        ckpt = self._open()
        if ckpt.restored_from is not None:
            self.restored_step, self.restored_from = ckpt.start_step, ckpt.restored_from
            self._layout.check()
            got = self._train_step()
            if got != ckpt.start_step:
                raise RuntimeError(
                    f"restored flashckpt step {ckpt.start_step}, but train_state.step is {got} "
                    "after the restore: the trainer's step does not travel in states['"
                    f"{TRAIN_STATE}'] (its state_dict must hold 'step')"
                )
            # The RNGs as the snapshot had them go back again at the next forward: between
            # load() and it the trainer draws from them where the uninterrupted run did not
            # (its data loader's iterator, made after load(), draws a seed from torch's RNG).
            rng = capture_rng()
            self._rng_hooks = [
                part.register_forward_pre_hook(lambda mod, args: self._apply_rng(rng))
                for part in self._model
            ]
            log.info("flashckpt: torchtitan resumes at step %d from %s", got, self.restored_from)
            return True
        loaded = bool(self.manager.load(step))
        got = self._train_step()
        if got != 0:
            raise RuntimeError(
                f"torchtitan's own load() resumed step {got} from "
                f"{getattr(self.manager, 'folder', '?')!r} while "
                "flashckpt holds no snapshot of this job: two resume sources. Resume that run "
                "with torchtitan's CheckpointManager, or move its checkpoint folder away to "
                "start afresh with flashckpt"
            )
        return loaded

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """Counts step ``curr_step`` done (steps done, 1-based, as torchtitan passes it) and
        snapshots when due; at the last step it snapshots whatever the interval. Returns whether
        a snapshot was taken."""
        ckpt = self.ckpt if self.ckpt is not None else self._open()
        if curr_step != ckpt.steps_done + 1:
            raise ValueError(
                f"save(curr_step={curr_step}) after {ckpt.steps_done} steps counted: "
                "FlashCheckpointManager must see save() once per training step, after the "
                "step, with the steps done (torchtitan's train_state.step). Call it every step "
                "(not only at the checkpoint interval)"
            )
        handle = ckpt.step(curr_step)
        if last_step:
            if handle is None:
                handle = ckpt.save(mode="sync", when_busy="wait")
            if self.export_last_step:
                self.manager.save(curr_step, last_step=True)
        return handle is not None

    def maybe_wait_for_staging(self) -> None:
        """Waits for the copy of the last snapshot into memory."""
        if self.ckpt is not None:
            self.ckpt.wait()

    def maybe_wait_for_saving(self) -> None:
        """Waits until the newest snapshot is in storage (a no-op without storage)."""
        if self.ckpt is not None and self.config.storage:
            self.ckpt.flush()

    def close(self) -> None:
        """Leaves the flashckpt block (its final snapshot is persisted) and closes torchtitan's
        manager."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.ckpt is not None:
                if self._hook is not None:
                    self._hook.remove()
                for h in self._rng_hooks:
                    h.remove()
                self.ckpt.__exit__(None, None, None)
        finally:
            self.manager.close()

    def __enter__(self) -> FlashCheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _open(self) -> Checkpointer:
        if self._closed:
            raise RuntimeError("FlashCheckpointManager is closed: build a new one for a new run")
        ckpt = Checkpointer(self._model, None, stateful=self._stateful, config=self.config)
        ckpt.__enter__()
        self.ckpt = ckpt
        # A snapshot's copy may run in the background (overlap mode): any optimizer's next
        # step (torchtitan's OptimizersContainer or the optimizers in it) waits for it first.
        self._hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: ckpt.wait())
        return ckpt

    def _apply_rng(self, rng: dict[str, Any]) -> None:
        hooks, self._rng_hooks = self._rng_hooks, []
        for h in hooks:
            h.remove()
        if hooks:
            restore_rng(rng)

    def _train_step(self) -> int:
        sd = self.manager.states[TRAIN_STATE].state_dict()
        step = sd.get("step") if isinstance(sd, Mapping) else None
        if step is None:
            raise TypeError(
                f"states[{TRAIN_STATE!r}].state_dict() has no 'step': FlashCheckpointManager "
                "checks the restored step against it"
            )
        return int(step.item() if isinstance(step, torch.Tensor) else step)


class _Parts(torch.nn.ModuleList):
    """The model parts, whose state is their parameters and persistent buffers as they are.

    torchtitan's models convert their state dict on the way out (``FusedQKVLinear`` splits
    ``wqkv`` into ``wq``/``wk``/``wv``, redistributing the DTensor to ``Replicate``: an all-gather
    on every rank at every snapshot, and full tensors in place of this rank's shard). A snapshot
    needs neither: it keeps each parameter's local piece under its own name and copies it back
    into the same parameter, so the hooks are bypassed both ways."""

    def _tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for mod_name, mod in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for name, p in mod._parameters.items():
                if p is not None:
                    out[prefix + name] = p
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:
                    out[prefix + name] = b
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k: t.detach() for k, t in self._tensors().items()}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        targets = self._tensors()
        missing = sorted(set(targets) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(targets))
        if missing or unexpected:
            raise KeyError(
                f"the snapshot's model state does not fit these model parts (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}): resume with the model it was "
                "saved with"
            )
        with torch.no_grad():
            for k, t in targets.items():
                t.copy_(state_dict[k])
        return torch.nn.modules.module._IncompatibleKeys([], [])


class _Layout:
    """The parallel layout of the model's parameters (the world size, and each DTensor
    parameter's mesh, mesh dim names and placements), kept in each snapshot under
    ``flashckpt_layout`` and checked at a restore.

    A resume at another layout rebuilds each piece from the saved pieces by their DTensor
    metadata. That is exact where the metadata describes the whole split (FSDP2 on the whole
    world: 4 ranks -> 2). torchtitan 0.3.0's ``partial_dtensor`` backend with tensor parallel
    keeps each parameter a DTensor on the ``fsdp`` mesh only, the tensor-parallel split outside
    its metadata: the pieces of the other tensor-parallel ranks claim the same boxes with other
    data, and a resume at another layout would load a model that is not the saved one. That is
    refused (raised after the restore, before any step), naming the fix."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved: Any = None
        self._now: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        params: dict[str, Any] = {}
        for name, p in self.model.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            params[name] = [
                list(mesh.mesh.shape),
                list(mesh.mesh_dim_names or []),
                [str(x) for x in p.placements],  # type: ignore[attr-defined]
            ]
        return {"world": world, "params": params}

    def state_dict(self) -> dict[str, Any]:
        if self._now is None:  # the layout does not change during a run
            self._now = self.describe()
        return self._now

    def load_state_dict(self, sd: Any) -> None:
        self.saved = sd

    def check(self) -> None:
        saved, now = self.saved, self.describe()
        if not isinstance(saved, dict) or saved == now:
            return  # the same layout (or a snapshot from before this check)
        world = saved.get("world")
        params = saved.get("params") or {}
        partial = sorted(
            name
            for name, (shape, _, _) in params.items()
            if isinstance(world, int) and _numel(shape) < world
        )
        if partial:
            raise ValueError(
                f"the snapshot restored was saved by {world} ranks whose parameters are DTensors "
                f"on a mesh of fewer ranks ({partial[0]!r}: mesh {params[partial[0]][0]} "
                f"{params[partial[0]][1]}, {params[partial[0]][2]}), and this run's layout "
                f"differs ({now['world']} ranks, {partial[0]!r}: "
                f"{now['params'].get(partial[0])}): the parallelism outside the DTensors (tensor "
                "parallel in torchtitan's partial_dtensor backend) cannot be resharded from "
                "their metadata. Resume with the saved parallelism "
                "(parallelism.tensor_parallel_degree and data_parallel_shard_degree as saved); "
                'a run saved with parallelism.spmd_backend = "full_dtensor" (the whole split '
                "in the DTensors) reshards to another layout"
            )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _BytesAsTensors:
    """A Stateful whose ``bytes`` values travel as uint8 tensors (flashckpt's codec holds tensors
    and JSON values only) and come back as the same bytes. What they mean is the object's
    business: the first snapshot that holds some warns, naming them, since an object that
    unpickles them would unpickle bytes read from a snapshot."""

    def __init__(self, obj: Any, key: str, excluded: bool = False) -> None:
        self.obj = obj
        self.key = key
        self.excluded = excluded  # in checkpoint.exclude_from_loading: saved, never restored
        self._warned = False

    def state_dict(self) -> Any:
        found: list[str] = []
        out = _to_tensors(self.obj.state_dict(), f"states[{self.key!r}]", found)
        if found and not self._warned:
            self._warned = True
            log.warning(
                "flashckpt: %s holds bytes (%s): a snapshot keeps them as they are and "
                "load_state_dict gets them back as read from memory or storage; if %s "
                "unpickles them, return plain data (dicts, lists, numbers, str, tensors) "
                "from its state_dict instead",
                f"states[{self.key!r}]",
                ", ".join(found[:3]),
                type(self.obj).__name__,
            )
        return out

    def load_state_dict(self, sd: Any) -> None:
        if not self.excluded:
            self.obj.load_state_dict(_to_bytes(sd))


class _LoaderState:
    """torchtitan's data loader, whose ``state_dict`` pickles its StatefulDataLoader state
    under ``dp_rank_N``: that value travels as the plain data it pickles (decoded from the bytes
    the loader has just made, in this process) and is pickled again here on restore, so the
    loader's ``pickle.loads`` only ever sees bytes made from plain values, never bytes read from
    a snapshot."""

    def __init__(self, obj: Any, key: str, excluded: bool = False) -> None:
        self.obj = obj
        self.inner = _BytesAsTensors(obj, key, excluded)
        self.key = key
        self.excluded = excluded

    def state_dict(self) -> Any:
        sd = self.obj.state_dict()
        if not isinstance(sd, dict):
            return self.inner.state_dict()
        out: dict[Any, Any] = {}
        rest: dict[Any, Any] = {}
        for k, v in sd.items():
            if isinstance(k, str) and k.startswith(_LOADER_RANK) and isinstance(v, bytes):
                where = f"states[{self.key!r}][{k!r}]"
                # The bytes this loader's state_dict() returned a moment ago, in this process:
                # not bytes read from anywhere.
                state = pickle.loads(v)
                _check_plain(state, f"{where} (unpickled)")
                out[k] = {_PLAIN: state}
            else:
                rest[k] = v
        out.update(_to_tensors(rest, f"states[{self.key!r}]", []) if rest else {})
        return out

    def load_state_dict(self, sd: Any) -> None:
        if self.excluded:
            return
        if not isinstance(sd, dict):
            self.obj.load_state_dict(_to_bytes(sd))
            return
        saved, now = sd.get("world_size"), getattr(self.obj, "dp_world_size", None)
        if isinstance(saved, int) and isinstance(now, int) and saved != now:
            # torchtitan's loader cannot reshard its position (its own load asserts, and a rank
            # whose dp_rank_N is missing only warns and starts its data afresh).
            raise ValueError(
                f"states[{self.key!r}] was saved at a data-parallel degree of {saved} and this "
                f"run has {now}: torchtitan's data loader cannot be resharded. Resume at the "
                "same data-parallel degree, or set checkpoint.exclude_from_loading="
                "['dataloader'] to restart the data from the beginning of each rank's part"
            )
        back: dict[Any, Any] = {}
        for k, v in sd.items():
            where = f"states[{self.key!r}][{k!r}]"
            if isinstance(v, dict) and set(v) == {_PLAIN}:
                _check_plain(v[_PLAIN], where)  # what the codec rebuilt: plain data only
                back[k] = pickle.dumps(v[_PLAIN])
            elif (
                isinstance(k, str)
                and k.startswith(_LOADER_RANK)
                and (isinstance(v, dict) and set(v) == {_BYTES})
            ):
                raise ValueError(
                    f"the snapshot holds {where} as pickled bytes (written by a flashckpt "
                    "before the loader's state was kept as plain data): flashckpt does not "
                    "hand bytes read from a snapshot to pickle.loads. Start this job afresh "
                    "(a new job name or storage root), or resume it with torchtitan's own "
                    "checkpoint"
                )
            else:
                back[k] = _to_bytes(v)
        self.obj.load_state_dict(back)


_PLAIN_SCALARS = (bool, int, float, str, type(None))


def _check_plain(o: Any, where: str) -> None:
    """Raises unless ``o`` is dicts (str/int keys), lists, tuples, JSON scalars and tensors."""
    if type(o) in _PLAIN_SCALARS or type(o) is torch.Tensor:
        return
    if type(o) in (list, tuple):
        for i, v in enumerate(o):
            _check_plain(v, f"{where}[{i}]")
        return
    if type(o) is dict:
        for k, v in o.items():
            if type(k) not in (str, int):
                raise TypeError(
                    f"{where} has a key of type {type(k).__name__} ({k!r}): flashckpt keeps "
                    "the data loader's state as plain data (str or int keys); make the "
                    "dataset's state_dict use str keys"
                )
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} is a {type(o).__module__}.{type(o).__qualname__}: flashckpt keeps torchtitan's "
        "data loader state as plain data (dicts, lists, tuples, str, int, float, bool, None, "
        "tensors), so that nothing read from a snapshot is unpickled. Make the dataset's (or "
        "sampler's) state_dict return plain data, or use torchtitan's own CheckpointManager"
    )


def _to_tensors(o: Any, where: str, found: list[str]) -> Any:
    if isinstance(o, (bytes, bytearray)):
        found.append(where)
        return {
            _BYTES: torch.frombuffer(bytearray(o), dtype=torch.uint8)
            if o
            else torch.empty(0, dtype=torch.uint8)
        }
    if isinstance(o, dict):
        return {k: _to_tensors(v, f"{where}[{k!r}]", found) for k, v in o.items()}
    if isinstance(o, list):
        return [_to_tensors(v, f"{where}[{i}]", found) for i, v in enumerate(o)]
    return o


def _to_bytes(o: Any) -> Any:
    if isinstance(o, dict):
        if len(o) == 1 and _BYTES in o:
            return o[_BYTES].numpy().tobytes()
        return {k: _to_bytes(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_to_bytes(v) for v in o]
    return o
