"""Flash checkpoints for a Lightning ``Trainer``: one callback.

Usage::

    from flashckpt.integrations.lightning import FlashCheckpoint

    trainer = lightning.pytorch.Trainer(max_steps=1000,
                                        callbacks=[FlashCheckpoint(storage="file:///ckpt/run1",
                                                                   every=50)])
    trainer.fit(model, train_loader)      # the same command again after a crash resumes

Every ``every`` optimizer steps (``trainer.global_step``) the callback snapshots into shared
memory the checkpoint Lightning itself would write at that point (``ModelCheckpoint`` saves at
the same hooks): the LightningModule's weights, the optimizers, the LR schedulers, the precision
plugin (gradient scaler), the loops' progress (epoch, global step, batch position, a resumable
data loader's state), every callback's state and the datamodule's, plus what Lightning's own
checkpoints lack: the RNG states of every rank (Python, NumPy, torch CPU and CUDA). A run started
again with the same command restores the newest snapshot any rank can get (memory first, then
storage) and hands it to Lightning's own restore path, as ``fit(ckpt_path=...)`` would.

An epoch's last step is snapshotted at the epoch's end (after its validation), the others when
the step's batch ends; a resume mid-epoch sets the RNGs back right before the next batch's
``training_step``, as the uninterrupted run drew them.

Refused, naming the fix: a resume mid-epoch with a training data loader that has no resumable
position (Lightning would start the epoch's data over, training batches again: use torchdata's
``StatefulDataLoader``), ``fit(ckpt_path=...)`` as well (two resume sources), the FSDP1
``FSDPStrategy`` and DeepSpeed (their state is not DTensors: use ``ModelParallelStrategy``), and
:meth:`FlashCheckpoint.save` in the middle of a gradient accumulation.

Sharded models: ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor parallelism applied
in ``LightningModule.configure_model()``) is supported; each rank snapshots its own DTensor
pieces of the weights and the optimizer state (nothing is gathered), and a resume at the same
mesh takes each rank's piece back (docs/integrations/lightning.md).
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from flashckpt.state.rng import capture_rng, restore_rng
from flashckpt.trainer.checkpointer import Checkpointer
from flashckpt.trainer.config import CheckpointConfig, unknown_options

__all__ = ["FlashCheckpoint"]

log = logging.getLogger("flashckpt")


class FlashCheckpoint(Callback):
    """Flash checkpointing of a Lightning ``Trainer.fit`` run, with resume on restart.

    Args:
        storage: the checkpoint root URL (any fsspec URL), as in :func:`flashckpt.checkpointing`;
            None keeps snapshots in memory only.
        every: snapshot every N optimizer steps (``trainer.global_step``), or ``"auto"``.
        **options: any other field of :class:`flashckpt.CheckpointConfig`.

    Attributes:
        ckpt: the :class:`flashckpt.Checkpointer` while ``fit()`` runs.
        restored_step, restored_from: the step resumed from and where it came from, None on a
            fresh start.
    """

    def __init__(self, storage: str | None = None, *, every: int | str = "auto", **options: Any):
        unknown = sorted(set(options) - set(CheckpointConfig.__dataclass_fields__))
        if unknown:
            msg = unknown_options(unknown)
            raise TypeError(msg.replace("checkpointing()", "FlashCheckpoint()"))
        options.update(storage=storage, every=every)
        self.config = CheckpointConfig(**options)
        self.ckpt: Checkpointer | None = None
        self.restored_step: int | None = None
        self.restored_from: str | None = None
        self._trainer: pl.Trainer | None = None
        self._open = False
        self._saved: dict[str, Any] | None = None  # the restored Lightning checkpoint
        self._rng: dict[str, Any] | None = None  # the restored RNGs, until set back
        self._last_step = 0  # trainer.global_step when ckpt.step() was last called
        self._pending = False  # an epoch's last step, counted at the epoch's end
        self._in_batch = False
        self._accumulating = False
        self._at_epoch_end = False  # a snapshot taken at an epoch's end
        self._direct_opt: Any = None  # the one optimizer the Checkpointer snapshots itself

    @property
    def state_key(self) -> str:
        return "FlashCheckpoint"

    # -- entry and restore --------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ckpt is not None:
            raise RuntimeError(
                "FlashCheckpoint serves one trainer.fit() call: make a new Trainer with a new "
                "FlashCheckpoint for another run"
            )
        connector = trainer._checkpoint_connector
        if connector._loaded_checkpoint:
            raise ValueError(
                f"trainer.fit(ckpt_path={connector._ckpt_path!r}) with FlashCheckpoint: the "
                "callback resumes from the newest flashckpt snapshot by itself, and two resume "
                "sources could disagree. Drop ckpt_path=, or remove FlashCheckpoint to resume "
                "from Lightning's own checkpoint"
            )
        _check_strategy(trainer.strategy)
        self._trainer = trainer
        # The optimizer goes to the Checkpointer itself when there is one (the usual case): its
        # state is copied tensor by tensor into the slot (overlapped with the next step where
        # the copy mode allows), sharded (DTensor) state as each rank's local pieces; Lightning's
        # own dump (``strategy.optimizer_state``) would gather or copy it synchronously through
        # the generic path (tests/integrations: the stall benchmark). Several optimizers travel
        # in Lightning's checkpoint, as Lightning dumps them.
        opts = list(trainer.optimizers)
        self._direct_opt = opts[0] if len(opts) == 1 else None
        if len(opts) > 1 and not trainer.strategy.lightning_restore_optimizer:
            # ModelParallelStrategy loads optimizer states in its own load_checkpoint only:
            # the states of several optimizers in Lightning's checkpoint would be dropped on
            # restore, silently.
            raise NotImplementedError(
                f"FlashCheckpoint with {type(trainer.strategy).__name__} supports one optimizer "
                f"(configure_optimizers() returned {len(opts)}): the strategy restores no "
                "optimizer state from a checkpoint it did not load itself. Use one optimizer "
                "(several parameter groups are fine), or Lightning's own checkpoints"
            )
        config = copy.copy(self.config)
        config.allow_unsaved_scheduler = True  # the schedulers are in Lightning's checkpoint
        self.ckpt = Checkpointer(
            pl_module,
            self._direct_opt,
            stateful={"lightning": _LightningState(self)},
            config=config,
        )
        self.ckpt.__enter__()
        self._open = True
        if self.ckpt.restored_from is None:
            return
        assert self._saved is not None
        self.restored_step, self.restored_from = self.ckpt.start_step, self.ckpt.restored_from
        self._rng = capture_rng()
        checkpoint = dict(self._saved)
        checkpoint["state_dict"] = pl_module.state_dict()  # restored in place already
        if self._direct_opt is not None and trainer.strategy.lightning_restore_optimizer:
            # Restored in place already; Lightning loads it again (a no-op on the values).
            checkpoint["optimizer_states"] = [self._direct_opt.state_dict()]
        # What fit(ckpt_path=...) does (the weights and the optimizer are in place already);
        # Lightning restores the precision plugin, the loops and the schedulers (the optimizers
        # of several) from it right after this hook, then drops it.
        connector._ckpt_path = f"flashckpt step {self.restored_step} ({self.restored_from})"
        connector._loaded_checkpoint = checkpoint
        if not trainer.strategy.restore_checkpoint_after_setup:
            # A strategy that restores after setup (ModelParallelStrategy) calls these itself
            # right after this hook (its load of the module's weights is a no-op).
            from lightning.pytorch.trainer import call

            call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
            connector.restore_datamodule()
            connector.restore_callbacks()
        _epoch_before_iter(trainer.fit_loop, int(self._saved["flashckpt_data_epoch"]))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        if self.restored_step is None:
            return
        loop = trainer.fit_loop
        batches = trainer.num_training_batches
        loader = loop._combined_loader
        if batches != float("inf") and loader is not None:
            per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
            resumable = all(hasattr(dl, "state_dict") for dl in loader.flattened)
            if trainer.global_step % per_epoch and not resumable:
                raise ValueError(
                    f"flashckpt: resumed at step {trainer.global_step}, in the middle of an epoch "
                    f"of {per_epoch} steps, but the training data loader has no resumable "
                    "position: Lightning would start the epoch's data over and train its first "
                    "batches again. Use torchdata's StatefulDataLoader (pip install "
                    "flashckpt[data]) with a generator= of its own, or snapshot at epoch ends "
                    f"only (every= a multiple of {per_epoch})"
                )

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The sanity check drew from the RNGs the restore set; the run continues from them.
        if self._rng is not None:
            restore_rng(self._rng)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:
            # Resumed at an epoch's end: the RNGs go back before the next epoch's iterator
            # draws its seed, as the uninterrupted run drew it after the snapshot.
            restore_rng(self._rng)
            self._rng = None
        if self.restored_step is not None and trainer.fit_loop._combined_loader is not None:
            # The samplers' epoch is the epoch's number, as in an uninterrupted run (lightning
            # 2.6 passes a count that is one behind in the epoch after a restart at an epoch's
            # end, so a DistributedSampler would repeat the previous epoch's order).
            from lightning.fabric.utilities.data import _set_sampler_epoch

            for dl in trainer.fit_loop._combined_loader.flattened:
                _set_sampler_epoch(dl, trainer.current_epoch)

    # -- snapshots ------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            # Resumed mid-epoch: the next batch is fetched (the data loader's iterator may
            # have drawn from the RNGs); its training_step draws from the snapshot's RNGs.
            restore_rng(self._rng)
            self._rng = None
        self._in_batch = True

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._in_batch = False
        self._accumulating = trainer.global_step <= self._last_step
        if self._accumulating:
            return  # gradients accumulate: no optimizer step yet
        self._last_step = trainer.global_step
        if batch_idx + 1 >= trainer.num_training_batches or trainer.should_stop:
            self._pending = True  # the epoch's last step: counted once the epoch ended
            return
        assert self.ckpt is not None
        self.ckpt.step()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending:
            self._pending = False
            assert self.ckpt is not None
            self._at_epoch_end = True
            try:
                self.ckpt.step()
            finally:
                self._at_epoch_end = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending:  # stopped mid-epoch at max_steps: no epoch end came
            self._pending = False
            assert self.ckpt is not None
            self.ckpt.step()
        self._close(None)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close((type(exception), exception, exception.__traceback__))

    # -- public ---------------------------------------------------------------------------------
    def save(self) -> None:
        """Snapshots now, outside the ``every`` cadence.

        Raises:
            RuntimeError: called in the middle of a batch or of a gradient accumulation: the
                accumulated gradients are in no snapshot.
        """
        t = self._trainer
        if self.ckpt is None or not self._open or t is None:
            raise RuntimeError("FlashCheckpoint.save() outside trainer.fit()")
        if self._in_batch or self._accumulating or self._pending:
            raise RuntimeError(
                "FlashCheckpoint.save() in the middle of a gradient accumulation (or of a "
                "batch): the accumulated gradients are in no snapshot, so a resume would "
                "silently lose them. Call it when an optimizer step is complete, or lower every="
            )
        self.ckpt.save()

    def _close(self, exc_info: Any) -> None:
        if not self._open or self.ckpt is None:
            return
        self._open = False
        if exc_info is None:
            self.ckpt.__exit__(None, None, None)
        else:
            self.ckpt.__exit__(*exc_info)


class _LightningState:
    """The checkpoint Lightning writes at this point (``dump_checkpoint``), less the module's
    weights and the one optimizer's state (the Checkpointer's model and optimizer) and the
    hyper-parameters (not needed to resume, and of any type)."""

    def __init__(self, cb: FlashCheckpoint) -> None:
        self.cb = cb

    def state_dict(self) -> dict[str, Any]:
        t = self.cb._trainer
        assert t is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "weights_only was not set" and the like
            ck = _dump_checkpoint(t, skip=self.cb._direct_opt)
        # The epoch the next batch belongs to: the next one when the snapshot is the epoch's end.
        ck["flashckpt_data_epoch"] = t.current_epoch + (1 if self.cb._at_epoch_end else 0)
        for obj in (t.lightning_module, getattr(t, "datamodule", None)):
            if obj is not None:
                for attr in (
                    "CHECKPOINT_HYPER_PARAMS_KEY",
                    "CHECKPOINT_HYPER_PARAMS_NAME",
                    "CHECKPOINT_HYPER_PARAMS_TYPE",
                ):
                    key = getattr(obj, attr, None)
                    if isinstance(key, str):
                        ck.pop(key, None)
        return ck

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cb._saved = dict(sd)


def _dump_checkpoint(trainer: pl.Trainer, skip: Any) -> dict[str, Any]:
    """``dump_checkpoint(weights_only=False)`` of lightning 2.6 without its two costly parts:
    the module's state dict (``strategy.lightning_module_state_dict()``: the Checkpointer holds
    the module) and the state of the optimizer ``skip`` (the Checkpointer's own). Under
    ``ModelParallelStrategy`` both are ``get_*_state_dict`` calls with a CPU offload, a copy of
    every shard per snapshot; the profile of the DDP run showed the optimizer's dump and its
    generic encoding as most of the time lost per snapshot (benchmarks/README.md). The rest is
    Lightning's own, in its order: loops, callbacks, other optimizers, schedulers, precision
    plugin, datamodule, then the callbacks' and the module's ``on_save_checkpoint`` hooks."""
    from lightning.pytorch.trainer import call

    connector = trainer._checkpoint_connector
    ck: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "loops": connector._get_loops_state_dict(),
        "callbacks": call._call_callbacks_state_dict(trainer),
    }
    if skip is None:
        ck["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
    ck["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
    prec = trainer.precision_plugin
    prec_state = prec.state_dict()
    if prec_state:
        ck[prec.__class__.__qualname__] = prec_state
    prec.on_save_checkpoint(ck)
    dm = getattr(trainer, "datamodule", None)
    if dm is not None:
        dm_state = call._call_lightning_datamodule_hook(trainer, "state_dict")
        if dm_state:
            ck[dm.__class__.__qualname__] = dm_state
    call._call_callbacks_on_save_checkpoint(trainer, ck)
    call._call_lightning_module_hook(trainer, "on_save_checkpoint", ck)
    return ck


def _check_strategy(strategy: Any) -> None:
    """Refuses a strategy whose state the snapshot could not hold as the run holds it.

    ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor parallelism in
    ``configure_model()``: DTensor parameters and optimizer state) is supported, each rank
    snapshotting its local pieces. ``FSDPStrategy`` (FSDP1: flat parameters, ``ShardedTensor``
    state dicts) and DeepSpeed (ZeRO's partitioned flat buffers inside its engine) are not: the
    fix names the supported way."""
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        raise NotImplementedError(
            f"FlashCheckpoint does not support the {name} strategy: DeepSpeed keeps the "
            "weights and the optimizer state in its engine's partitioned flat buffers, which "
            "no snapshot here holds. Shard with ModelParallelStrategy (fully_shard in "
            "LightningModule.configure_model(); docs/integrations/lightning.md), or use "
            "Lightning's own checkpoints (ModelCheckpoint, ckpt_path=) for this run"
        )
    if "FSDP" in name:
        raise NotImplementedError(
            f"FlashCheckpoint does not support the {name} strategy (FSDP1: flat parameters "
            "and ShardedTensor state dicts): use ModelParallelStrategy with FSDP2 "
            "(torch.distributed.fsdp.fully_shard in LightningModule.configure_model(); the "
            "recipe is in docs/integrations/lightning.md), whose DTensor state each rank "
            "snapshots as its own pieces, or Lightning's own checkpoints for this run"
        )


def _epoch_before_iter(loop: Any, epoch: int) -> None:
    """Has a resumed run's first data iterator drawn in the resumed epoch's order.

    Lightning builds the training loader's iterator (and prefetches from it) right after
    loading the loader's saved position, and only then calls the samplers' ``set_epoch`` for
    the epoch: a sampler whose order is a function of (seed, epoch), ``DistributedSampler``'s,
    would serve the resumed epoch in epoch 0's order. The samplers get ``epoch`` (the epoch the
    uninterrupted run's next batch belongs to, recorded in the snapshot) as soon as the loader's
    position is loaded, i.e. before that iterator (lightning 2.6; the same call Lightning makes
    at each epoch's start, so an uninterrupted run is unchanged)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    orig = loop._load_combined_loader_states

    def load_combined_loader_states() -> None:
        orig()
        if loop._combined_loader is not None:
            for dl in loop._combined_loader.flattened:
                _set_sampler_epoch(dl, epoch)
        loop._load_combined_loader_states = orig  # once: the resumed run's first iterator

    loop._load_combined_loader_states = load_combined_loader_states
