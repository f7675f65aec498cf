"""Snapshot: a rank's state captured into its two shared-memory slots.

The slots are files the node agent allocates (and persists from); this rank maps them, keeps the
one holding the newest complete snapshot untouched, and copies the next snapshot into the other
(the copy of parameters and optimizer state overlaps the next forward/backward in overlap mode).
Pages are pre-faulted in the background at entry so the first copies run at memory speed. A state
on a GPU has its slots page-locked for CUDA at entry (``cudaHostRegister``) and is copied
device->host by DMA on a side stream; they are unregistered before they are dropped.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from flashckpt.errors import CorruptSnapshotError as BadMemory  # the restore code's name
from flashckpt.errors import TornSnapshot
from flashckpt.format.layout import Layout, tensor_views
from flashckpt.format.shm import HEADER_SIZE, Prefaulter, Slot, file_problem, prefault
from flashckpt.protocol.channel import AgentError
from flashckpt.state.codec import FlatState, flatten_state
from flashckpt.state.sharded import is_dtensor, is_sharded_dtensor
from flashckpt.trainer.rankctx import replicated_error

if TYPE_CHECKING:
    from flashckpt.trainer.config import CheckpointConfig, Stats
    from flashckpt.trainer.link import AgentLink
    from flashckpt.trainer.rankctx import RankContext

__all__ = [
    "BadMemory",
    "CudaHostRegistrar",
    "SlotMap",
    "SnapshotHandle",
    "Snapshotter",
    "TornSnapshot",
]

log = logging.getLogger("flashckpt")

MIN_META_CAP = 1 << 20
_HASH_MASK = (1 << 62) - 1


class SnapshotHandle:
    """What ``save()`` returns: whether the snapshot was taken, and a way to wait for its copy."""

    def __init__(self, step: int, future: Future[None] | None, skipped: str | None = None) -> None:
        self.step = step
        self.skipped = skipped
        self._future = future

    @property
    def taken(self) -> bool:
        return self.skipped is None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Waits until the snapshot is complete in memory; re-raises a background failure."""
        if self._future is not None:
            self._future.result()

    def __repr__(self) -> str:
        state = (
            f"skipped: {self.skipped}" if self.skipped else ("done" if self.done() else "copying")
        )
        return f"SnapshotHandle(step={self.step}, {state})"


@dataclass(slots=True)
class SlotMap:
    slot: Slot
    data: torch.Tensor  # uint8 view of the whole mapped file
    step: int | None = None
    writing: bool = False
    views: dict[str, torch.Tensor] | None = None
    views_sig: str | None = None
    registered_cuda: bool = False
    """The mapping is page-locked for CUDA (``cudaHostRegister``): copies to and from a GPU
    are DMA at full bandwidth, and a side-stream copy really is asynchronous."""
    register_failed: bool = False
    """``cudaHostRegister`` refused this mapping (warned once; not tried again)."""
    cuda_ready: dict[torch.device, Any] | None = None
    """While a snapshot is copied into this slot: an event per CUDA device, recorded on the
    caller's current stream in ``save()``, that the device->host copies wait for."""
    ino: int = 0


class CudaHostRegistrar:
    """Page-locks slot mappings for CUDA (``cudaHostRegister``) and unlocks them, with every
    return code checked.

    Args:
        cudart: the CUDA runtime bindings; default ``torch.cuda.cudart()``, looked up at the
            first registration (never on a machine whose state is on the CPU). A stand-in
            with ``cudaHostRegister(ptr, size, flags)`` and ``cudaHostUnregister(ptr)``
            returning an error code (0: success) may be given (tests on CPU do).
    """

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = cudart
        self.registered: dict[int, int] = {}
        """Base address -> bytes of each mapping registered now."""

    def _rt(self) -> Any:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def register(self, sm: SlotMap) -> bool:
        """Page-locks a slot's whole mapping; True when it is (now or already). A refusal is
        warned about once, naming the CUDA error, and the slot is used unregistered (copies
        then stage through pageable memory: correct, but slower and not overlapped)."""
        if sm.registered_cuda:
            return True
        if sm.register_failed:
            return False
        what = f"the snapshot slot {sm.slot.path}"
        if not self._register(sm.data.data_ptr(), sm.data.numel(), what, warn=True):
            sm.register_failed = True
            return False
        sm.registered_cuda = True
        return True

    def unregister(self, sm: SlotMap) -> None:
        """Unlocks a registered slot's mapping (before it is dropped); a failure is logged."""
        if sm.registered_cuda:
            sm.registered_cuda = False
            self.unregister_range(sm.data.data_ptr(), f"the snapshot slot {sm.slot.path}")

    def register_range(self, ptr: int, size: int, what: str) -> bool:
        """Page-locks any host range for a while (a restore's read buffer); a refusal is only
        logged: the copies from it stage through pageable memory."""
        return self._register(ptr, size, what, warn=False)

    def unregister_range(self, ptr: int, what: str) -> None:
        if self.registered.pop(ptr, None) is None:
            return
        rt = self._rt()
        rc = _error_code(rt.cudaHostUnregister(ptr))
        if rc != 0:
            _clear_cuda_error(rt)
            log.warning(
                "flashckpt: cudaHostUnregister of %s failed with %s", what, _error_text(rt, rc)
            )

    def _register(self, ptr: int, size: int, what: str, warn: bool) -> bool:
        rt = self._rt()
        rc = _error_code(rt.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE))
        if rc == 0:
            self.registered[ptr] = size
            return True
        cleared = _clear_cuda_error(rt)
        msg = (
            f"flashckpt: cudaHostRegister of {what} ({size} bytes) failed with "
            f"{_error_text(rt, rc)}: copies between it and the GPU go through pageable memory "
            "(slower, and an overlapped copy blocks its thread). Check the free host memory and "
            "that shared-memory mappings can be page-locked here"
            + ("" if cleared else " (the error could not be cleared: a later CUDA call may say it)")
        )
        if warn:
            log.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        else:
            log.info("%s", msg)
        return False


_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: the range counts as pinned for every CUDA context of the process,
not only the current device's (a state spread over several GPUs copies from each)."""


def _error_code(rc: Any) -> int:
    """A cudaError (a pybind enum from torch's bindings, or a plain int) as an int."""
    return int(getattr(rc, "value", rc))


def _error_text(rt: Any, rc: int) -> str:
    try:
        text = rt.cudaGetErrorString(rt.cudaError(rc))
    except Exception:  # a runtime without the lookup (or a stand-in): the code says it
        return f"CUDA error {rc}"
    return f"CUDA error {rc} ({text})"


def _clear_cuda_error(rt: Any) -> bool:
    """Resets the CUDA runtime's last error after a failed call whose code was handled here,
    so the next kernel launch check of torch does not report it as its own. torch's bindings
    do not offer cudaGetLastError: it is called in the libcudart torch loaded (ctypes). False
    when that library is not found."""
    import ctypes

    if hasattr(rt, "cudaGetLastError"):
        rt.cudaGetLastError()
        return True
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetLastError()
        return True
    return False


class Snapshotter:
    """A rank's slots, and the capture and copy of its state into them."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        scheduler: Any,
        stateful: Mapping[str, Any],
        config: CheckpointConfig,
        ctx: RankContext,
        link: AgentLink,
        stats: Stats,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stateful = stateful
        self.config = config
        self.ctx = ctx
        self.link = link
        self.stats = stats
        self.slots: list[SlotMap | None] = [None, None]
        self.orphans: list[SlotMap] = []  # other local ranks' slots, during a restore
        self.slot_lock = threading.Lock()
        self.shm_dir: str | None = None
        """The agent's directory of the slots (of every rank of this machine)."""
        self.meta_static: dict[str, Any] = {}
        """The part of every snapshot description that is fixed at entry (job, ranks, shard)."""
        self.layout: Layout | None = None
        self._layout_specs: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
        self.pending: Future[None] | None = None
        self.executor: ThreadPoolExecutor | None = None
        self._cuda_streams: dict[torch.device, Any] = {}  # a side stream per device
        self.registrar = CudaHostRegistrar()
        self.pin_cuda = False
        """Whether the slots are page-locked for CUDA: the state had CUDA tensors at entry
        (:meth:`pin_for_cuda`); every slot mapped since is registered as it is mapped."""
        self._opt_names: tuple[tuple[int, ...], list[str | None]] | None = None
        self._alloc_thread: threading.Thread | None = None
        """The background allocation of :meth:`preallocate` (a resume), until waited for."""

    def map(self, path: str) -> SlotMap:
        problem = file_problem(path)
        if problem is not None:
            # Another user's file (or one others may read or write) holds no state of ours.
            raise ValueError(f"slot file {path} is not trusted: {problem}")
        size = os.path.getsize(path)
        data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        slot = Slot(path, buf=data.numpy())
        info = slot.header()
        sm = SlotMap(slot, data, ino=os.stat(path).st_ino)
        if info is not None and info.complete:
            sm.step = info.step
        return sm

    def state_device_types(self) -> set[str]:
        """The device types (``cpu``, ``cuda``, ...) of the model's and optimizer's tensors now."""
        types = {t.device.type for t in self.model.state_dict().values() if torch.is_tensor(t)}
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                types.update(v.device.type for v in st.values() if torch.is_tensor(v))
        return types

    def pin_for_cuda(self) -> None:
        """At entry, once the agent's hello mapped this rank's slots: when the state has CUDA
        tensors, page-locks the slots (``cudaHostRegister``), so that a restore from memory
        copies host->device from registered memory and no ``save()`` pays the registration
        (it pins every page: seconds for many GiB). Slots mapped later (the pre-allocation
        just after, or new ones when the state outgrows them) are registered as they are
        mapped; all are unregistered before they are dropped. A CPU state registers nothing
        and never touches the CUDA runtime."""
        self.pin_cuda = "cuda" in self.state_device_types()
        if not self.pin_cuda:
            return
        with self.slot_lock:
            slots = [s for s in self.slots if s is not None]
        for sm in slots:
            self.registrar.register(sm)

    def collect(self) -> tuple[FlatState, set[int], dict[str, Any]]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.config.replicated:  # sharded since entry (checked there): refused, not half-saved
            key = next((k for k, v in state["model"].items() if is_sharded_dtensor(v)), None)
            if key is not None:
                raise replicated_error(f"model state key {key!r}")
        async_ptrs = {_local_ptr(p) for p in self.model.parameters()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        async_ptrs.add(_local_ptr(v))
            # What export needs to key optimizer state by parameter name (as DCP does).
            state["optimizer_param_names"] = self._optimizer_param_names()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.stateful:
            state["stateful"] = {k: v.state_dict() for k, v in self.stateful.items()}
        flat = flatten_state(state)
        specs = flat.specs()
        if specs != self._layout_specs:
            self.layout = Layout.build(specs)
            self._layout_specs = specs
        async_ptrs.discard(0)
        return flat, async_ptrs, state["model"]

    def _optimizer_param_names(self) -> list[str | None]:
        """The model's name of each optimizer parameter, in ``optimizer.state_dict()`` id order;
        kept while the optimizer holds the same parameters (it is recorded at every save)."""
        assert self.optimizer is not None
        ids = tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])
        if self._opt_names is None or self._opt_names[0] != ids:
            names = {id(p): n for n, p in self.model.named_parameters()}
            params = (p for g in self.optimizer.param_groups for p in g["params"])
            self._opt_names = (ids, [names.get(id(p)) for p in params])
        return self._opt_names[1]

    def buffers_hash(self, model_sd: Mapping[str, Any]) -> int:
        """A hash of the model's buffers (the state that is not parameters, e.g. BatchNorm
        statistics): the part of a data-parallel replica's state that may differ by rank.
        Two ranks' snapshots of one step with equal hashes are interchangeable."""
        params = {_local_ptr(p) for p in self.model.parameters()}
        h = xxhash.xxh3_64()
        for name, t in model_sd.items():  # the state dict this snapshot copies (not a 2nd one)
            if not isinstance(t, torch.Tensor) or is_dtensor(t) or _local_ptr(t) in params:
                continue
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            h.update(name.encode())
            if t.numel():
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.intdigest() & _HASH_MASK

    def meta_bytes(self, flat: FlatState, layout: Layout, extra: dict[str, Any]) -> bytes:
        meta = {
            **self.meta_static,
            **extra,
            "layout_sig": layout.signature,
            "entries": layout.to_json(),
            "skeleton": flat.skeleton,
        }
        try:
            return json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()
        except TypeError as e:
            raise TypeError(f"snapshot description is not JSON-serialisable: {e}") from None

    def estimate_bytes(self) -> int:
        tensors = [t for t in self.model.state_dict().values() if isinstance(t, torch.Tensor)]
        # Optimizers handed in stateful= (a framework's container of them: torchtitan's
        # OptimizersContainer) hold state too: without it the first snapshot outgrows the slots
        # and reallocates them inside the training step.
        model_bytes = sum(_local_nbytes(t) for t in tensors) + sum(
            _stateful_optimizer_bytes(o)
            for o in (self.stateful or {}).values()
            if isinstance(o, torch.optim.Optimizer) and o is not self.optimizer
        )
        opt = self.optimizer
        if opt is None:
            return model_bytes
        if opt.state:
            return model_bytes + sum(
                _local_nbytes(v)
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            )
        dry = _dry_run_state_bytes(opt)
        if dry is not None:
            return model_bytes + dry
        # The optimizer cannot step on stand-in parameters (a closure, sharded or fused ones):
        # a guess by name, counting AMSGrad's third buffer.
        param_bytes = sum(_local_nbytes(p) for p in self.model.parameters())
        name = type(opt).__name__.lower()
        factor = 2 if "adam" in name or "lamb" in name else 1
        if any(g.get("amsgrad") for g in opt.param_groups):
            factor += 1
        return model_bytes + factor * param_bytes + 64 * len(opt.state_dict()["state"] or [1])

    def preallocate(self, background: bool = False) -> None:
        """Reserves both slots at entry, sized from the state (or an estimate before the first
        optimizer step), so a too-small /dev/shm fails here, before training, not mid-run.

        ``background`` (a resume: the first step comes first): the agent checks at once that
        the slots fit (the same check its allocation makes) and a thread allocates them and
        maps their pages beside the first steps; the first snapshot waits for it
        (:meth:`wait_alloc`). A standby that took its snapshot from a peer has one slot to
        allocate: 0.3 s of its entry at 0.25 GiB (``benchmarks/README.md``, failover).
        """
        need = self.estimate_bytes()
        if not background:
            self.ensure_slots(MIN_META_CAP, need, fault=False)
            return
        req = self._alloc_request(MIN_META_CAP, need)
        if req is None:
            return
        meta_cap, data_cap, keep = req
        self.link.alloc(meta_cap=meta_cap, data_cap=data_cap, keep=keep, check_only=True)
        t = threading.Thread(
            target=self._background_alloc, args=(need,), name="flashckpt-alloc", daemon=True
        )
        self._alloc_thread = t
        t.start()

    def _background_alloc(self, need: int) -> None:
        try:
            self.ensure_slots(MIN_META_CAP, need, fault=True)
        except Exception as e:  # the first snapshot allocates again (and raises there)
            log.warning("flashckpt: reserving the slots in the background failed: %s", e)

    def wait_alloc(self) -> None:
        """Waits for the background allocation of :meth:`preallocate`, if one runs."""
        t = self._alloc_thread
        if t is not None:
            t.join()
            self._alloc_thread = None

    def prefault_all(self) -> Prefaulter | None:
        """Maps every slot page in a background thread (returns it at once; None when there are
        no slots; ``join`` it to wait for the pages): a copy into fresh
        slot pages costs 2.5x one into mapped pages (tmpfs zeroes each page on first touch).

        The slot the first snapshot goes to comes first, mapped from its end: a save never waits
        for it; if it comes before the slot is done, its copy faults the start of the slot while
        the thread maps the rest. The other slot follows, paused while a copy runs.
        """
        with self.slot_lock:
            slots = [s for s in self.slots if s is not None]
        if not slots:
            return None
        target = self.target_slot()
        slots.sort(key=lambda s: s is not target)
        ranges = [(s.data.data_ptr() + HEADER_SIZE, s.data.numel() - HEADER_SIZE, s) for s in slots]

        def alive(i: int) -> bool:  # the slot is still mapped here (not torn down, not replaced)
            return any(s is slots[i] for s in self.slots)

        def busy(i: int) -> bool:  # a copy runs into the other slot
            return any(s is not None and s is not slots[i] and s.writing for s in self.slots)

        return Prefaulter(ranges, alive=alive, busy=busy).start()  # stops once its slots go

    def ensure_slots(self, meta_need: int, data_need: int, fault: bool = True) -> None:
        """Makes the slots hold at least the given sizes; existing slots that do are kept
        (after a restart they hold the snapshots just restored from). New ones get headroom.

        The slot holding the newest complete snapshot is never replaced, even when too small
        (the state's layout changed: another world size, a resharded state): replacing it would
        lose the one step to resume from until the next snapshot completes. It is replaced once
        the other slot holds a newer one and it becomes the target.
        """
        req = self._alloc_request(meta_need, data_need)
        if req is None:
            return
        meta_cap, data_cap, keep = req
        with self.slot_lock:
            paths = self.link.alloc(meta_cap=meta_cap, data_cap=data_cap, keep=keep)
            new: list[SlotMap | None] = []
            for i, p in enumerate(paths):
                old = self.slots[i]
                if old is not None and old.slot.path == p and old.ino == os.stat(p).st_ino:
                    new.append(old)
                    continue
                sm = self.map(p)
                if fault:
                    prefault(sm.data.data_ptr() + HEADER_SIZE, sm.data.numel() - HEADER_SIZE)
                if self.pin_cuda:
                    self.registrar.register(sm)
                new.append(sm)
            for old in self.slots:
                if old is not None and not any(old is sm for sm in new):
                    self.registrar.unregister(old)  # replaced: no copy runs into it (waited)
            self.slots = new

    def _alloc_request(self, meta_need: int, data_need: int) -> tuple[int, int, list[int]] | None:
        """(meta_cap, data_cap, keep) of the alloc that makes the slots hold these sizes, or
        None when they do (see :meth:`ensure_slots`)."""
        target = self.target_slot() if any(self.slots) else None
        with self.slot_lock:
            keep = [
                i
                for i, s in enumerate(self.slots)
                if s is not None and s is not target and s.step is not None
            ]
            ok = all(
                i in keep
                or (s is not None and s.slot.meta_cap >= meta_need and s.slot.data_cap >= data_need)
                for i, s in enumerate(self.slots)
            )
        if ok:
            return None
        return max(4 * MIN_META_CAP, 2 * meta_need), data_need + data_need // 16 + (1 << 20), keep

    def acquire_slot(self, flat: FlatState, when_busy: str) -> SlotMap | None:
        assert self.layout is not None
        self.wait_alloc()
        need_meta = max(MIN_META_CAP, 2 * len(json.dumps(flat.skeleton)) + 256 * len(flat.names))
        need_data = self.layout.nbytes
        target = self.target_slot() if all(self.slots) else None
        if target is None or target.slot.meta_cap < need_meta or target.slot.data_cap < need_data:
            # First save without pre-allocation, or the state outgrew the slot: reallocate it
            # (the other one, holding the newest snapshot, stays as it is).
            self.wait()
            self.ensure_slots(need_meta, need_data)
        deadline = time.monotonic() + self.config.agent_timeout
        while True:
            target = self.target_slot()
            # A pin is the agent's (it reads the slot): one left by an agent that died means
            # nothing (its successor clears it on adoption), so it is not waited for.
            if not target.writing and (not target.slot.pinned() or not self.link.alive()):
                break
            if when_busy == "skip":
                return None
            if target.writing:  # the previous overlapped copy is still running
                self.wait()
                continue
            # The agent persists this (older) snapshot: ask it to yield, and wait.
            target.slot.want(True)
            if time.monotonic() > deadline and self.link.alive():
                target.slot.want(False)
                raise TimeoutError(
                    f"no snapshot slot became free within {self.config.agent_timeout:.0f} s"
                )
            time.sleep(0.001)
        target.slot.want(False)
        target.writing = True
        return target

    def target_slot(self) -> SlotMap:
        """The slot the next snapshot goes to: the older one. The newest complete snapshot is
        never overwritten, so a crash during a copy always leaves it to resume from."""
        with self.slot_lock:
            slots = [s for s in self.slots if s is not None]
        return min(slots, key=lambda s: -1 if s.step is None else s.step)

    def views(self, sm: SlotMap, layout: Layout) -> dict[str, torch.Tensor]:
        if sm.views is None or sm.views_sig != layout.signature:
            off = sm.slot.data_off
            sm.views = tensor_views(layout, sm.data[off : off + layout.nbytes])
            sm.views_sig = layout.signature
        return sm.views

    def copy(self, sm: SlotMap, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda_pairs = [(d, s) for d, s in pairs if s.is_cuda]
        for d, s in pairs:
            if not s.is_cuda:
                d.copy_(s)
        if cuda_pairs:
            self.copy_cuda(sm, cuda_pairs)

    @staticmethod
    def cuda_ready(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[torch.device, Any]:
        """An event per CUDA device the pairs read from, recorded now on the caller's current
        stream there: a copy run later by the copy thread (whose own current stream is the
        default one) starts after the work the caller queued before ``save()``, whichever
        stream it trains on."""
        ready: dict[torch.device, Any] = {}
        for _, s in pairs:
            if s.is_cuda and s.device not in ready:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(s.device))
                ready[s.device] = ev
        return ready

    def copy_cuda(self, sm: SlotMap, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device -> registered shared memory (DMA) on a side stream of each source device,
        after the work queued before the save (``sm.cuda_ready``, else the current streams);
        returns once the bytes are in memory."""
        ready = sm.cuda_ready
        if not sm.registered_cuda and not sm.register_failed:
            # The state reached the GPU after entry (entry registers the slots of a CUDA
            # state): registered once, here, for this and every later copy into this slot.
            log.info("flashckpt: registering slot %s with CUDA at its first copy", sm.slot.path)
            self.registrar.register(sm)
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for d, s in pairs:
            by_device.setdefault(s.device, []).append((d, s))
        streams = []
        for dev, group in by_device.items():
            stream = self._cuda_streams.get(dev)
            if stream is None:
                stream = self._cuda_streams[dev] = torch.cuda.Stream(device=dev)
            if ready is not None and dev in ready:
                stream.wait_event(ready[dev])
            else:
                stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                for d, s in group:
                    d.copy_(s, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()

    def verify(self, sm: SlotMap, info: Any, step: int) -> None:
        """Checks a snapshot in shared memory against the data hash the agent recorded when it
        was complete.

        Raises:
            BadMemory: the data changed since (scribbled), or no hash can be had.
        """
        ok = sm.slot.verify_data(info)
        if ok is None and self.link.alive():
            # The agent hashes in the background; have it hash this position's slots now.
            self.link.hash_now()
            ok = sm.slot.verify_data(info)
        if ok is not True:
            why = (
                "fails its data hash: the shared memory was overwritten since the snapshot"
                if ok is False
                else "has no data hash to check it against"
            )
            raise BadMemory(
                f"rank {self.ctx.rank}: the snapshot of step {step} in memory ({sm.slot.path}) "
                f"{why}; not restored from it",
                why=(
                    "its data does not match its hash: the shared memory was overwritten since "
                    "the snapshot"
                    if ok is False
                    else "it has no data hash to check it against"
                ),
            )

    # -- a snapshot ----------------------------------------------------------------------------
    def write(
        self,
        step: int,
        flat: FlatState,
        async_ptrs: set[int],
        meta_extra: dict[str, Any],
        mode: str,
        when_busy: str,
    ) -> SnapshotHandle:
        """Copies a collected state into the target slot (the bulk in the background in overlap
        mode); a handle with ``skipped`` set when no slot could be had."""
        skipped = "both slots busy"
        try:
            slot = self.acquire_slot(flat, when_busy)
        except AgentError as err:
            if self.link.alive():
                raise
            # New slots (the state outgrew them) need an agent: this snapshot is lost, training
            # goes on, and the next one is taken once an agent is back.
            slot, skipped = None, f"no node agent to allocate slots ({err})"
        if slot is None:
            return SnapshotHandle(step, None, skipped=skipped)
        assert self.layout is not None
        layout = self.layout
        meta = self.meta_bytes(flat, layout, meta_extra)
        views = self.views(slot, layout)
        by_name = dict(zip(flat.names, flat.tensors, strict=True))
        now, later = [], []
        for e in layout.entries:
            src = by_name[e.name]
            pair = (views[e.name], src)
            if mode == "overlap" and src.data_ptr() in async_ptrs and src.numel():
                later.append(pair)
            else:
                now.append(pair)
        seq = slot.slot.begin_write()
        slot.slot.write_meta(meta)
        slot.step = None

        # Recorded now, in the caller's thread: the background copy orders itself after them.
        cuda = [p for p in later if p[1].is_cuda]
        slot.cuda_ready = self.cuda_ready(cuda) if cuda else None

        def finish() -> None:
            try:
                self.copy(slot, later)
                slot.slot.end_write(seq, step, meta, layout.nbytes)
                slot.step = step
                self.stats.last_snapshot_step = step
                self.link.snapped(step)
            finally:
                slot.cuda_ready = None
                slot.writing = False

        try:
            self.copy(slot, now)
        except BaseException:
            slot.cuda_ready = None
            slot.writing = False
            raise
        if later:
            self.pending = self.executor.submit(finish) if self.executor else None
            return SnapshotHandle(step, self.pending)
        finish()
        return SnapshotHandle(step, None)

    def wait(self) -> None:
        """Waits for the background copy of the last snapshot (and re-raises its failure)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            t0 = time.perf_counter()
            pending.result()
            self.stats.wait_s.append(time.perf_counter() - t0)

    def map_hello_slots(self, paths: list[str | None]) -> None:
        """Maps the slots the agent's hello reply names (a file that cannot be is ignored)."""
        for i, p in enumerate(paths):
            if p is not None:
                try:
                    self.slots[i] = self.map(p)
                except (OSError, ValueError) as e:
                    log.warning("flashckpt: ignoring slot %s: %s", p, e)

    def adopt_hello_slots(self, paths: list[str | None]) -> None:
        """Keeps the mapped slots the new agent serves (same files); drops the others."""
        with self.slot_lock:
            same = all(
                (sm is None and p is None)
                or (sm is not None and p == sm.slot.path and _same_file(p, sm.ino))
                for sm, p in zip(self.slots, [*paths, None, None][:2], strict=True)
            )
        if same:
            return
        self.wait()  # no copy runs into a slot that is dropped here
        with self.slot_lock:
            for i, p in enumerate([*paths, None, None][:2]):
                sm = self.slots[i]
                if sm is not None and not (p == sm.slot.path and _same_file(p, sm.ino)):
                    self.registrar.unregister(sm)
                    self.slots[i] = None  # the agent discarded it: the next save allocates

    def stop(self) -> None:
        """Stops the copy thread (after the copy it runs) and waits for a background alloc."""
        self.wait_alloc()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None

    def unmap(self) -> None:
        """Forgets the slots (the files stay: they are the agent's), unregistering from CUDA
        those registered (after :meth:`stop`: no copy runs into them)."""
        with self.slot_lock:
            slots, self.slots = self.slots, [None, None]
        for sm in slots:
            if sm is not None:
                self.registrar.unregister(sm)


def _same_file(path: str | None, ino: int) -> bool:
    try:
        return path is not None and os.stat(path).st_ino == ino
    except OSError:
        return False


def _dry_run_state_bytes(opt: torch.optim.Optimizer) -> int | None:
    """Bytes of the state ``opt`` will hold after its first step, found by stepping a copy of it
    on meta-device stand-ins of its parameters (no memory, no effect on the real one): any
    optimizer, any number of state tensors per parameter. None where that copy cannot step."""
    try:
        groups = []
        for g in opt.param_groups:
            params = []
            for p in g["params"]:
                if is_dtensor(p) or not isinstance(p, torch.Tensor):
                    return None
                m = torch.empty_like(p, device="meta").requires_grad_(True)
                m.grad = torch.empty_like(m)
                params.append(m)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        # A shallow copy through the optimizer's own __getstate__/__setstate__: no hooks (the
        # monitor's and ours stay on the real one), then fresh groups and state of its own.
        clone = copy.copy(opt)
        clone.param_groups = groups
        clone.state = collections.defaultdict(dict)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clone.step()
        return sum(
            v.numel() * v.element_size()
            for st in clone.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
    except Exception as e:  # the estimate falls back to a guess by optimizer name
        log.debug("flashckpt: cannot dry-run %s on meta tensors: %s", type(opt).__name__, e)
        return None


def _stateful_optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the state an optimizer passed as a ``stateful=`` object holds (or will hold
    after its first step). A container of optimizers (an ``optimizers`` list, as torchtitan's
    ``OptimizersContainer`` has) counts those; it is never dry-run itself, since its ``step()``
    steps the real optimizers inside it."""
    if opt.state:
        return sum(
            _local_nbytes(v)
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
    inner = getattr(opt, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        return sum(
            _stateful_optimizer_bytes(o)
            for o in inner
            if isinstance(o, torch.optim.Optimizer) and o is not opt
        )
    dry = _dry_run_state_bytes(opt)
    if dry is not None:
        return dry
    params = [p for g in opt.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
    name = type(opt).__name__.lower()
    factor = 2 if "adam" in name or "lamb" in name else 1
    if any(g.get("amsgrad") for g in opt.param_groups):
        factor += 1
    return factor * sum(_local_nbytes(p) for p in params) + 64 * len(params)


def _local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's piece: a DTensor (FSDP2, tensor parallel) holds only its shard."""
    if is_dtensor(t):
        t = t.to_local()  # type: ignore[attr-defined]
    return t.numel() * t.element_size()


def _local_ptr(t: torch.Tensor) -> int:
    return t.to_local().data_ptr() if is_dtensor(t) else t.data_ptr()  # type: ignore[attr-defined]
