"""Flash checkpoints for the Hugging Face ``transformers.Trainer``: one callback.

Usage::

    from flashckpt.integrations.huggingface import FlashCheckpoint

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FlashCheckpoint(storage="file:///ckpt/run1", every=10)])
    trainer.train()          # the same command again after a crash resumes where it stopped

Every ``every`` optimizer steps (the Trainer's ``global_step``) the callback snapshots into shared
memory what the Trainer's own ``resume_from_checkpoint`` restores: the model, the optimizer, the
LR scheduler, the gradient scaler (fp16), the ``TrainerState`` (global step, epoch, log history,
total FLOs, best metric, the states of exportable callbacks such as early stopping), the RNGs of
every rank (Python, NumPy, torch CPU and CUDA) and the running loss the Trainer has not logged
yet. A run started again with the same command (a crash, a ``kill -9``, a preempted node) resumes
from the newest snapshot any rank can get, in memory first, then in storage, through the
Trainer's own resume path: its step and epoch counters, its callbacks' states, and its
``skip_first_batches`` machinery, so the batches already trained in the current epoch are
skipped, and the RNGs are set back at the point the Trainer sets its own.

Sharded: with accelerate's FSDP2 plugin (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version":
2}``, on GPUs) each rank snapshots its own pieces of the ``fully_shard``-ed model and of the
optimizer state (DTensor local shards, no gather), and a resume restores them after
accelerate's ``prepare`` has sharded the model (the callback runs the Trainer's
``_prepare_for_training`` ahead of restoring, once).

The snapshot of step ``n`` is taken once step ``n`` is complete: after the optimizer step, its
logging, evaluation and the Trainer's own checkpoint of that step (and, for an epoch's last step,
after the epoch's end), which is where an uninterrupted run's state is the one restored.

What the callback refuses, with the fix in the error (silent divergence is worse than a crash):
a shuffling sampler without a seed of its own (``accelerator_config={"use_seedable_sampler":
False}``: a resumed epoch would draw another order, so the skipped batches would not be the ones
trained), a resume with another batch geometry (batch size, gradient accumulation, world size:
the data position is counted in batches), ``train(resume_from_checkpoint=...)`` (two resume
sources), DeepSpeed, FSDP1 and ``auto_find_batch_size`` (the optimizer is built, or its state
kept, where the callback cannot snapshot it), FSDP asked for on CPU (accelerate then silently
trains unsharded: refused saying so) and
:meth:`FlashCheckpoint.save` in the middle of a gradient accumulation (the accumulated gradients
are in no snapshot). ``ignore_data_skip=True`` is honoured with a warning: the batches already
trained in the resumed epoch are trained again, as the Trainer documents.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState

from flashckpt.state.rng import capture_rng, restore_rng
from flashckpt.trainer.checkpointer import Checkpointer
from flashckpt.trainer.config import CheckpointConfig, unknown_options

__all__ = ["FlashCheckpoint"]

log = logging.getLogger("flashckpt")

_RESUMED = "<flashckpt snapshot>"
"""What the Trainer's epoch loop is handed as its ``resume_from_checkpoint`` once a snapshot was
restored: it then skips the batches already trained and sets the RNGs back (through the wrapped
``_load_rng_state``, which restores the snapshot's RNGs for this value)."""


class FlashCheckpoint(TrainerCallback):
    """Flash checkpointing of a ``transformers.Trainer`` run, with resume on restart.

    Pass it in ``Trainer(..., callbacks=[FlashCheckpoint(...)])`` (it takes hold of the Trainer
    at its construction, before ``train()`` builds the optimizer).

    Args:
        storage: the checkpoint root URL (any fsspec URL), as in :func:`flashckpt.checkpointing`;
            None keeps snapshots in memory only.
        every: snapshot every N optimizer steps (``global_step`` a multiple of N), or ``"auto"``.
        **options: any other field of :class:`flashckpt.CheckpointConfig` (``persist_every``,
            ``job``, ``mirror``, ``mode``, ...).

    Attributes:
        ckpt: the :class:`flashckpt.Checkpointer` while ``train()`` runs (``ckpt.status()``).
        restored_step, restored_from: the step resumed from and where it came from
            (``memory``, ``storage``, ...), None on a fresh start.
    """

    def __init__(self, storage: str | None = None, *, every: int | str = "auto", **options: Any):
        unknown = sorted(set(options) - set(CheckpointConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(
                unknown_options(unknown).replace("checkpointing()", "FlashCheckpoint()")
            )
        options.update(storage=storage, every=every)
        self.config = CheckpointConfig(**options)
        self.trainer: Trainer | None = None
        self.ckpt: Checkpointer | None = None
        self.restored_step: int | None = None
        self.restored_from: str | None = None
        self._open = False  # the Checkpointer is entered
        self._used = False  # train() was called (one call per callback)
        self._saved: dict[str, Any] | None = None  # the restored shared state (TrainerState...)
        self._loop: dict[str, Any] | None = None  # the restored per-rank loop values
        self._rng: dict[str, Any] | None = None  # the restored RNGs, until applied
        self._upe = 0  # optimizer steps per epoch
        self._pending = False  # a step completed and not yet counted (ckpt.step())
        self._epoch_end = False  # the epoch's end is being handled
        self._in_step = False  # between on_step_begin and on_step_end (accumulating)
        self._fsdp2 = False  # accelerate's FSDP2 plugin is on: restore after its prepare
        self._loader: Any = None  # the training data loader the Trainer made
        self._prepare: Callable[..., Any] | None = None  # the Trainer's _prepare_for_training
        self._prepared: Any = None  # its result, when run ahead (FSDP2) and not yet handed

    # -- taking hold of the Trainer ------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _owning_trainer(self)
        if trainer is None:
            raise RuntimeError(
                "FlashCheckpoint could not find the transformers.Trainer it was passed to: pass "
                "it in Trainer(..., callbacks=[FlashCheckpoint(...)])"
            )
        self._attach(trainer)

    def _attach(self, trainer: Trainer) -> None:
        args = trainer.args
        self._fsdp2 = _fsdp_version(trainer) == 2
        unsupported = [
            what
            for what, on in (
                ("DeepSpeed", getattr(trainer, "is_deepspeed_enabled", False)),
                ("FSDP1", getattr(trainer, "is_fsdp_enabled", False) and not self._fsdp2),
                ("FSDP on XLA", getattr(trainer, "is_fsdp_xla_enabled", False)),
                ("auto_find_batch_size", getattr(args, "auto_find_batch_size", False)),
            )
            if on
        ]
        if not unsupported:
            _check_fsdp_asked(trainer)
        if unsupported:
            why = ""
            if "FSDP1" in unsupported:
                why = (
                    " (FSDP1 keeps flat parameters and ShardedTensor state dicts, no DTensor "
                    "pieces a snapshot holds: ask accelerate for FSDP2 with fsdp_config="
                    '{"fsdp_version": 2}, which FlashCheckpoint resumes bitwise)'
                )
            elif "DeepSpeed" in unsupported:
                why = (
                    " (DeepSpeed builds the optimizer inside its engine, with ZeRO's partitioned "
                    "flat buffers, and restores it through its own load_checkpoint: no state "
                    "the callback snapshots)"
                )
            raise NotImplementedError(
                f"FlashCheckpoint does not support {', '.join(unsupported)} (the optimizer "
                "is built or the loop restarted where the callback cannot snapshot it)"
                f"{why}: use the Trainer's own checkpoints (save_strategy=, "
                "resume_from_checkpoint=) for this run"
            )
        self.trainer = trainer
        for name in (
            "train",
            "get_train_dataloader",
            "_init_training_state",
            "_prepare_for_training",
            "_run_epoch",
            "get_batch_samples",
            "_load_rng_state",
            "_maybe_log_save_evaluate",
            "_finalize_training",
        ):
            wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(
                self, "_wrap_" + name.lstrip("_")
            )
            setattr(trainer, name, wrap(getattr(trainer, name)))

    # -- the Trainer's methods, wrapped on this instance ------------------------------------------
    def _wrap_train(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            if resume_from_checkpoint not in (None, False):
                raise ValueError(
                    f"trainer.train(resume_from_checkpoint={resume_from_checkpoint!r}) with "
                    "FlashCheckpoint: the callback resumes from the newest flashckpt snapshot "
                    "by itself, and two resume sources could disagree. Drop "
                    "resume_from_checkpoint=, or remove FlashCheckpoint to resume from the "
                    "Trainer's own checkpoint"
                )
            if self._used:
                raise RuntimeError(
                    "FlashCheckpoint serves one trainer.train() call: make a new Trainer with a "
                    "new FlashCheckpoint for another run"
                )
            self._used = True
            try:
                return orig(None, *args, **kwargs)
            except BaseException:
                self._close(sys.exc_info())
                raise

        return train

    def _wrap_get_train_dataloader(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def get_train_dataloader(*args: Any, **kwargs: Any) -> Any:
            self._loader = orig(*args, **kwargs)  # what _prepare_for_training is handed
            return self._loader

        return get_train_dataloader

    def _wrap_init_training_state(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def init_training_state(
            max_steps: int, upe: int, num_train_epochs: int, resume: Any, trial: Any
        ) -> tuple[int, int]:
            epochs, steps = orig(max_steps, upe, num_train_epochs, resume, trial)
            self._upe = upe
            if self._fsdp2:
                # accelerate shards the model (fully_shard) and points the optimizer at the
                # sharded parameters in _prepare_for_training, which the Trainer calls right
                # after this method: a snapshot of DTensor pieces restores only into that
                # model and optimizer, and this method must return the resumed position. So
                # the preparation runs here, once (it reads nothing this method set up but
                # the loader), and the Trainer's own call gets its result.
                assert self._prepare is not None
                self._prepared = self._prepare(max_steps, self._loader, None)
            self._enter(max_steps)
            if self._saved is None:
                return epochs, steps
            return self._resume_state(max_steps, upe, num_train_epochs, trial)

        return init_training_state

    def _wrap_prepare_for_training(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        self._prepare = orig

        def prepare_for_training(max_steps: int, loader: Any, resume: Any) -> Any:
            done, self._prepared = self._prepared, None
            if done is None:
                return orig(max_steps, loader, resume)
            if loader is not self._loader:
                raise RuntimeError(
                    "flashckpt: the Trainer prepared another training data loader than the one "
                    "FlashCheckpoint prepared ahead for FSDP2 (a Trainer subclass changing "
                    "_inner_training_loop?): the resumed data position would not be the loop's"
                )
            return done

        return prepare_for_training

    def _wrap_run_epoch(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def run_epoch(*args: Any, **kwargs: Any) -> Any:
            if self._saved is not None:
                kwargs["resume_from_checkpoint"] = _RESUMED
            return orig(*args, **kwargs)

        return run_epoch

    def _wrap_get_batch_samples(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            # Resumed mid-epoch: the RNGs go back right after the first batch is drawn, where
            # the Trainer sets its own (that draw starts the epoch's iterator, which takes a
            # seed from the global RNG: the uninterrupted run took it at the epoch's start).
            out = orig(*args, **kwargs)
            self._apply_rng()
            return out

        return get_batch_samples

    def _wrap_load_rng_state(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def load_rng_state(checkpoint: Any) -> None:
            if checkpoint == _RESUMED:
                self._apply_rng()  # resumed at an epoch's start: before the epoch's iterator
                return
            orig(checkpoint)

        return load_rng_state

    def _wrap_maybe_log_save_evaluate(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if self._pending and (self._epoch_end or not self._epoch_ends_next()):
                self._pending = False
                assert self.ckpt is not None and self.trainer is not None
                self.ckpt.step(self.trainer.state.global_step)
            self._epoch_end = False
            return out

        return maybe_log_save_evaluate

    def _wrap_finalize_training(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def finalize_training(*args: Any, **kwargs: Any) -> Any:
            # The final snapshot (and its commit to storage) holds the trained state, before
            # load_best_model_at_end may replace the weights.
            self._close(None)
            return orig(*args, **kwargs)

        return finalize_training

    # -- callback events ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise RuntimeError(
                "FlashCheckpoint was added after the Trainer was built (trainer.add_callback): it "
                "must take hold of the Trainer before train() builds the optimizer. Pass it in "
                "Trainer(..., callbacks=[FlashCheckpoint(...)])"
            )
        _check_sampler(kwargs.get("train_dataloader"))
        t = self.trainer
        if self._loop is not None:
            # The loop's running values, set by the Trainer just before this event: the loss
            # and FLOs summed since the last log, so the first log after a resume is the one
            # the uninterrupted run writes. (The final train_loss stays the Trainer's: the
            # mean over the steps of this train() call.)
            t._tr_loss = torch.tensor(
                self._loop["tr_loss"], dtype=t._tr_loss.dtype, device=t._tr_loss.device
            )
            t._globalstep_last_logged = int(self._loop["last_logged"])
            t.current_flos = float(self._loop["flos"])  # type: ignore[assignment]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._in_step = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._in_step = False
        self._pending = True  # counted once the step's logging, evaluation and saving are done

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_end = True

    # -- public ---------------------------------------------------------------------------------
    def save(self) -> None:
        """Snapshots now (labelled with the steps done), outside the ``every`` cadence.

        Raises:
            RuntimeError: called in the middle of a gradient accumulation or of a step (from
                ``on_step_begin`` to the end of the step's logging and saving): the snapshot
                would hold a state no step boundary had, and gradients are not snapshotted.
        """
        if self.ckpt is None or not self._open:
            raise RuntimeError("FlashCheckpoint.save() outside trainer.train()")
        if self._in_step or self._pending:
            raise RuntimeError(
                "FlashCheckpoint.save() in the middle of a training step (gradient accumulation "
                "or the step's logging/saving still running): the accumulated gradients are in "
                "no snapshot, so a resume would silently lose them. Call it between steps, e.g. "
                "from on_epoch_begin, or lower every="
            )
        self.ckpt.save()

    # -- internals ------------------------------------------------------------------------------
    def _enter(self, max_steps: int) -> None:
        """Builds the optimizer and scheduler as the Trainer would (it uses them as they are)
        and enters the Checkpointer, which restores into them. With FSDP2 the Trainer's
        preparation has run: the model is accelerate's ``fully_shard``-ed one (DTensor
        parameters) and the optimizer holds those; the Checkpointer snapshots and restores
        each rank's local pieces of both (the sharded state path of ``checkpointing()``)."""
        t = self.trainer
        assert t is not None
        if t.optimizer is None:
            t.create_optimizer()
        if t.lr_scheduler is None:
            # (FSDP2: _prepare_for_training has built both, on the sharded parameters)
            t.create_scheduler(num_training_steps=max_steps)
            t._created_lr_scheduler = False  # kept by _prepare_for_training, as a user's
        opt = t.optimizer
        # accelerate's wrapper (after its prepare: FSDP2) holds the torch optimizer whose
        # state is snapshotted
        raw = opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt
        if not isinstance(raw, torch.optim.Optimizer):
            raw = getattr(raw, "optimizer", raw)
        stateful: dict[str, Any] = {"hf_trainer": _SharedState(self)}
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            stateful["grad_scaler"] = scaler
        if not isinstance(t.model, torch.nn.Module):
            raise TypeError("FlashCheckpoint: the Trainer has no model (model= or model_init=)")
        self.ckpt = Checkpointer(
            t.model,
            raw,
            scheduler=t.lr_scheduler,
            stateful=stateful,
            per_rank={"hf_loop": _LoopState(self)},
            config=self.config,
        )
        self.ckpt.__enter__()
        self._open = True
        if self.ckpt.restored_from is not None:
            self.restored_step, self.restored_from = self.ckpt.start_step, self.ckpt.restored_from
            self._rng = capture_rng()  # what the restore set; applied again where HF does

    def _resume_state(
        self, max_steps: int, upe: int, num_train_epochs: int, trial: Any
    ) -> tuple[int, int]:
        """Puts the restored TrainerState in place as the Trainer's own resume does; returns
        the epochs done and the batches of the current epoch to skip."""
        t, saved, ckpt = self.trainer, self._saved, self.ckpt
        assert t is not None and saved is not None and ckpt is not None
        mine, theirs = self._geometry(), saved["geometry"]
        changed = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if changed:
            then_now = ", ".join(f"{k}: {a} then, {b} now" for k, (a, b) in changed.items())
            raise ValueError(
                f"flashckpt: the snapshot of step {ckpt.start_step} was taken with another batch "
                f"geometry ({then_now})"
                ": the data position is counted in batches, so the resumed epoch would skip the "
                "wrong ones. Restart with the same per_device_train_batch_size, "
                "gradient_accumulation_steps and number of processes, or start afresh "
                "(FlashCheckpoint(..., restore=False, overwrite=True))"
            )
        t.state = TrainerState(**json.loads(saved["trainer_state"]))
        if t.state.global_step != ckpt.start_step:
            raise RuntimeError(
                f"flashckpt: the snapshot of step {ckpt.start_step} holds a TrainerState at "
                f"global_step {t.state.global_step}: the snapshot is inconsistent"
            )
        best = t.state.best_model_checkpoint
        if best is not None and not os.path.isdir(best):
            t.state.best_model_checkpoint = None
        from transformers.trainer_utils import compare_trainer_and_checkpoint_args

        compare_trainer_and_checkpoint_args(t.args, t.state)
        t._load_callback_state()
        t.state.init_training_references(t, max_steps, num_train_epochs, trial)
        step = t.state.global_step
        epochs, in_epoch = step // upe, step % upe
        if t.args.ignore_data_skip:
            if in_epoch:
                msg = (
                    f"flashckpt: resumed at step {step} with ignore_data_skip=True: the "
                    f"{in_epoch * t.args.gradient_accumulation_steps} batches already trained in "
                    f"epoch {epochs} are trained again. Drop ignore_data_skip to skip them"
                )
                log.warning("%s", msg)
                warnings.warn(msg, stacklevel=2)
            return epochs, 0
        return epochs, in_epoch * t.args.gradient_accumulation_steps

    def _geometry(self) -> dict[str, int]:
        t = self.trainer
        assert t is not None
        return {
            "per_device_train_batch_size": int(t._train_batch_size),
            "gradient_accumulation_steps": int(t.args.gradient_accumulation_steps),
            "world_size": int(t.args.world_size),
            "steps_per_epoch": int(self._upe),
        }

    def _epoch_ends_next(self) -> bool:
        """Whether the step just done is followed by the epoch's end (its last step, or the
        loop stops): its snapshot then waits for the epoch's end to be handled."""
        t = self.trainer
        assert t is not None
        c = t.control
        return (
            (self._upe > 0 and t.state.global_step % self._upe == 0)
            or c.should_epoch_stop
            or c.should_training_stop
        )

    def _apply_rng(self) -> None:
        if self._rng is not None:
            restore_rng(self._rng)
            self._rng = None

    def _close(self, exc_info: Any) -> None:
        if not self._open or self.ckpt is None:
            return
        self._open = False
        if exc_info is None:
            self.ckpt.__exit__(None, None, None)
        else:
            self.ckpt.__exit__(*exc_info)


class _SharedState:
    """The Trainer's state that every rank shares: the ``TrainerState`` (as the Trainer writes
    its ``trainer_state.json``, exportable callbacks' states updated) and the batch geometry the
    data position is counted in."""

    def __init__(self, cb: FlashCheckpoint) -> None:
        self.cb = cb

    def state_dict(self) -> dict[str, Any]:
        t = self.cb.trainer
        assert t is not None
        exported: dict[str, Any] = {}
        for obj in [*t.callback_handler.callbacks, t.control]:
            if isinstance(obj, ExportableState):
                name = type(obj).__name__
                if name in exported:
                    prev = exported[name]
                    exported[name] = [*(prev if isinstance(prev, list) else [prev]), obj.state()]
                else:
                    exported[name] = obj.state()
        t.state.stateful_callbacks = exported  # type: ignore[assignment]  # as HF stores it
        return {
            "trainer_state": json.dumps(dataclasses.asdict(t.state), sort_keys=True),
            "geometry": self.cb._geometry(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cb._saved = dict(sd)


class _LoopState:
    """This rank's running values of the Trainer's loop: the loss and FLOs summed since the
    last log (each rank sums its own; the log gathers them), and the logging counters."""

    def __init__(self, cb: FlashCheckpoint) -> None:
        self.cb = cb

    def state_dict(self) -> dict[str, Any]:
        t = self.cb.trainer
        assert t is not None
        return {
            "tr_loss": float(t._tr_loss.item()),
            "last_logged": int(t._globalstep_last_logged),
            "flos": float(t.current_flos),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cb._loop = dict(sd)


def _owning_trainer(cb: FlashCheckpoint) -> Trainer | None:
    """The Trainer whose construction is calling ``cb.on_init_end`` (up the call stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer) and any(
            c is cb for c in getattr(obj.callback_handler, "callbacks", [])
        ):
            return obj
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _fsdp_version(trainer: Trainer) -> int | None:
    """The FSDP version accelerate enabled for this Trainer (1 or 2), None without FSDP."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def _check_fsdp_asked(trainer: Trainer) -> None:
    """Refuses a run whose arguments ask for FSDP that accelerate did not enable.

    accelerate turns FSDP on only for a multi-accelerator distributed type (``MULTI_GPU``,
    ``MULTI_NPU``, ``MULTI_XPU``, ...: ``AcceleratorState.__init__`` in accelerate 1.15); on CPU
    (``use_cpu=True``, or a machine without a GPU) the type is ``MULTI_CPU`` (or none), the
    FSDP plugin is dropped and the Trainer trains the whole model on every rank
    (``is_fsdp_enabled`` is False), without a word. Checkpointing that run as the sharded run
    its user thinks it is would be a silent divergence of a kind: refused, naming what happened.
    """
    args = trainer.args
    asked = [
        what
        for what, on in (
            (f"fsdp={args.fsdp!r}", bool(getattr(args, "fsdp", None))),
            (
                "ACCELERATE_USE_FSDP=true",
                os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
            ),
        )
        if on
    ]
    if asked and not getattr(trainer, "is_fsdp_enabled", False):
        state = getattr(getattr(trainer, "accelerator", None), "state", None)
        kind = getattr(getattr(state, "distributed_type", None), "value", "unknown")
        raise ValueError(
            f"FlashCheckpoint: the Trainer was asked for FSDP ({', '.join(asked)}) but "
            f"accelerate did not enable it (distributed type {kind}): accelerate shards only "
            "on GPU-type devices, so on CPU (use_cpu=True, or no GPU) this run trains the whole "
            "model on every rank, unsharded. Drop fsdp= to train (and checkpoint) unsharded on "
            "purpose, or run on GPUs with accelerate's FSDP2 (fsdp_config="
            '{"fsdp_version": 2}), which FlashCheckpoint snapshots sharded; '
            "docs/integrations/huggingface.md)"
        )


def _check_sampler(loader: Any) -> None:
    """Refuses a shuffling sampler with no seed of its own (see the module's doc)."""
    if loader is None:
        return
    from torch.utils.data import RandomSampler

    seen = []
    for obj in (loader, getattr(loader, "base_dataloader", None)):
        if obj is None:
            continue
        seen.append(getattr(obj, "sampler", None))
        bs = getattr(obj, "batch_sampler", None)
        seen += [
            getattr(bs, "sampler", None),
            getattr(getattr(bs, "batch_sampler", None), "sampler", None),
        ]
    for s in seen:
        if isinstance(s, RandomSampler) and type(s).__name__ != "SeedableRandomSampler":
            raise ValueError(
                "flashckpt: the training data is shuffled by a torch RandomSampler without a "
                "seed of its own (accelerator_config use_seedable_sampler=False): a resumed "
                "epoch would draw another order, so the batches skipped on resume would not be "
                "the ones already trained. Keep TrainingArguments' default "
                'accelerator_config={"use_seedable_sampler": True} (with data_seed= or seed=)'
            )
