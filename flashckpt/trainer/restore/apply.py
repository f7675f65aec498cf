"""Apply: a restored state put into the model, optimizer, scheduler and the user's objects.

The state's tensors view shared memory (a slot the next snapshot overwrites) or one buffer a
storage or replica read filled: the model copies into its parameters, everything else that keeps
tensors gets copies of its own (into the optimizer's current state where it fits, else into one
pre-faulted buffer), so neither the slot nor that buffer stays pinned.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from flashckpt.state.jsonstate import decode_state, encode_state
from flashckpt.state.rng import restore_rng
from flashckpt.state.sharded import is_dtensor

if TYPE_CHECKING:
    from flashckpt.trainer.rankctx import RankContext
    from flashckpt.trainer.snapshot import CudaHostRegistrar, Snapshotter

__all__ = ["Applier", "clone_tensors"]

PIN_MIN_BYTES = 64 << 20
"""A restore's host buffer at least this big is page-locked while it is copied to the GPU."""


class Applier:
    """Checks a restored state against the objects it goes into, and loads it into them."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        scheduler: Any,
        stateful: Mapping[str, Any],
        per_rank: Mapping[str, Any],
        extras: dict[str, Any],
        ctx: RankContext,
        registrar: CudaHostRegistrar | None = None,
    ) -> None:
        self.registrar = registrar
        """Page-locks a storage or replica restore's host buffer while it is copied to a GPU
        (a memory restore reads the slots, registered at entry); None: never."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stateful = stateful
        self.per_rank = per_rank
        self.extras = extras
        self.ctx = ctx

    def check_model(self, state: dict[str, Any]) -> None:
        """Checks the saved model state against the model (keys and shapes); a state saved
        through a wrapper the model lacks (or the other way round) has its keys renamed in
        ``state`` when the wrapper's prefix is the only difference (see
        :func:`wrapper_prefix`).

        Raises:
            ValueError: the state does not fit the model, naming the keys (and a wrapper prefix
                that almost fits).
        """
        saved = state.get("model", {})
        current = self.model.state_dict()
        if isinstance(saved, dict) and set(saved) != set(current):
            mapped = _unwrapped(saved, current)
            if mapped is not None:
                state["model"] = saved = mapped
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        shapes = [
            f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(current[k].shape)}"
            for k in sorted(set(saved) & set(current))
            if isinstance(saved[k], torch.Tensor)
            and tuple(saved[k].shape) != tuple(current[k].shape)
        ]
        if missing or unexpected or shapes:
            lines = ["checkpoint does not fit the model:"]
            if missing:
                lines.append(f"  missing keys (in model, not in checkpoint): {missing}")
            if unexpected:
                lines.append(f"  unexpected keys (in checkpoint, not in model): {unexpected}")
            if shapes:
                lines.append("  shape mismatches: " + "; ".join(shapes))
            hint = _prefix_hint(set(saved), set(current))
            if hint:
                lines.append(f"  {hint}")
            lines.append("  restore into the same architecture, or start from scratch (see below)")
            raise ValueError("\n".join(lines))
        for name, key in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            if key is not None and name not in state:
                raise ValueError(f"checkpoint has no {name} state, but a {name} was given")

    def apply(self, state: dict[str, Any], private: dict[str, Any] | None, from_mem: bool) -> None:
        with self._registered_sources(state, from_mem):
            self._apply(state, private)

    def state_on_cuda(self) -> bool:
        """Whether the model this state goes into is (partly) on a GPU."""
        return any(t.is_cuda for t in self.model.state_dict().values() if torch.is_tensor(t))

    @contextlib.contextmanager
    def _registered_sources(self, state: dict[str, Any], from_mem: bool) -> Iterator[None]:
        """Page-locks the host buffers a storage or replica restore read the state into
        (each buffer at least PIN_MIN_BYTES, whole) while they are copied host->device, so
        those copies are DMA from registered memory, as a memory restore's are (its slots
        were registered at entry); unregistered after. Nothing on a CPU model."""
        if from_mem or self.registrar is None or not self.state_on_cuda():
            yield
            return
        bases: dict[int, int] = {}
        for t in _tensors(state):
            if t.device.type == "cpu":
                st = t.untyped_storage()
                if st.nbytes() >= PIN_MIN_BYTES:
                    bases[st.data_ptr()] = st.nbytes()
        done = [
            ptr
            for ptr, size in bases.items()
            if self.registrar.register_range(ptr, size, "a restore's read buffer")
        ]
        try:
            yield
        finally:
            for ptr in done:
                self.registrar.unregister_range(ptr, "a restore's read buffer")

    def _apply(self, state: dict[str, Any], private: dict[str, Any] | None) -> None:
        # The tensors of `state` view the slot (from_mem: the next snapshot overwrites it) or the
        # one buffer a storage or replica restore read the whole shard into (model bytes
        # included). The model copies into its parameters; whatever else keeps tensors gets
        # copies of its own, so neither the slot nor that buffer stays pinned.
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            opt, saved = self.optimizer, state["optimizer"]
            # Where to copy each saved tensor. Optimizer.load_state_dict (torch 2.x) keeps a value
            # whose dtype and device already are what it wants (Tensor.to returns it as is) and
            # casts the others into new memory: those need no copy from us. The others go into
            # the optimizer's current state when it has a tensor of the same shape (a restore
            # in a process that already trained: no new memory, no page faults), else into new
            # memory.
            targets: dict[Any, dict[str, torch.Tensor]] = {}
            saved_state = saved.get("state", {}) if isinstance(saved, dict) else {}
            saved_groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
            # In place only when the groups match, so a state that load_state_dict rejects
            # leaves the optimizer untouched.
            fits = len(saved_groups) == len(opt.param_groups) and all(
                len(sg.get("params", [])) == len(g["params"])
                for sg, g in zip(saved_groups, opt.param_groups, strict=True)
            )
            for sg, g in zip(saved_groups, opt.param_groups, strict=False) if fits else ():
                low_step = bool(sg.get("fused") or sg.get("capturable"))
                for pid, param in zip(sg.get("params", []), g["params"], strict=True):
                    src, cur = saved_state.get(pid), opt.state.get(param) or {}
                    if not isinstance(src, dict):
                        continue
                    dst = targets[pid] = {}
                    for key, t in src.items():
                        if not isinstance(t, torch.Tensor):
                            continue
                        if key == "step" and not low_step:
                            cast = False  # kept as is, on its device
                        else:
                            want = param.dtype if param.is_floating_point() else t.dtype
                            want = torch.float32 if key == "step" else want
                            cast = want != t.dtype or param.device != t.device
                        if cast:
                            dst[key] = t  # load_state_dict's cast is the one copy
                        elif isinstance(cur.get(key), torch.Tensor):
                            dst[key] = cur[key]
            opt.load_state_dict(clone_tensors(saved, into={"state": targets}))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(clone_tensors(state["scheduler"]))
        for name, obj in self.stateful.items():
            sub = state.get("stateful", {}).get(name)
            if sub is None:
                raise ValueError(f"checkpoint has no state for stateful[{name!r}]")
            obj.load_state_dict(clone_tensors(sub))
        if private is not None:
            self.extras.clear()
            self.extras.update(private.get("extras") or {})
        self.apply_per_rank(private)
        if private is not None:
            # After the per_rank objects: a data loader's restore may draw from the global RNG
            # (a StatefulDataLoader without generator= seeds its iterator from it), where the
            # uninterrupted run's state at the snapshot came after that draw.
            restore_rng(private["rng"])

    def per_rank_state(self) -> dict[str, Any]:
        """The ``per_rank`` objects' states, for this rank's own JSON part of a snapshot (take
        it before the RNG states: a loader's ``state_dict()`` may draw from them), with the
        state of each ``StatefulDataLoader``'s own ``generator=`` (see :func:`_prime_loader`)."""
        if not self.per_rank:
            return {}
        out: dict[str, Any] = {
            "per_rank": {
                k: encode_state(v.state_dict(), f"per_rank/{k}") for k, v in self.per_rank.items()
            }
        }
        gens = {  # after state_dict(): it may have drawn from the generator
            k: encode_state(v.generator.get_state(), f"per_rank/{k}.generator")
            for k, v in self.per_rank.items()
            if _stateful_loader(v) and isinstance(v.generator, torch.Generator)
        }
        if gens:
            out["per_rank_generators"] = gens
        return out

    def apply_per_rank(self, private: dict[str, Any] | None) -> None:
        if not self.per_rank:
            return
        if private is not None and private.get("other_world"):
            # Their states belong to the ranks of another world size: none is this rank's.
            warnings.warn(
                f"flashckpt: per_rank {sorted(self.per_rank)} not restored: the step was saved "
                f"by {private['other_world']} ranks, this world has {self.ctx.world}",
                stacklevel=4,
            )
            return
        saved = (private or {}).get("per_rank")
        for name, obj in self.per_rank.items():
            sub = saved.get(name) if isinstance(saved, dict) else None
            if sub is None:
                raise ValueError(
                    f"checkpoint has no state of rank {self.ctx.rank} for per_rank[{name!r}]"
                )
            obj.load_state_dict(decode_state(sub, f"per_rank/{name}"))
            if _stateful_loader(obj):
                gens = (private or {}).get("per_rank_generators")
                gen = gens.get(name) if isinstance(gens, dict) else None
                where = f"per_rank/{name}.generator"
                _prime_loader(obj, None if gen is None else decode_state(gen, where), where)

    def invalidate_after(self, snap: Snapshotter, step: int) -> None:
        """Drops in-memory snapshots newer than the resume point: they belong to a past timeline.
        So do those of the local ranks no trainer uses any more (mapped for the restore only)."""
        orphans, snap.orphans = snap.orphans, []
        for sm in [*snap.slots, *orphans]:
            if sm is None:
                continue
            info = sm.slot.header()
            if info is not None and info.step > step:
                sm.slot.invalidate()
                sm.step = None
            elif info is None or not info.complete:
                sm.step = None


def _stateful_loader(obj: Any) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (without importing torchdata)."""
    mod = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(mod, "StatefulDataLoader", None)
    return isinstance(cls, type) and isinstance(obj, cls)


def _prime_loader(loader: Any, generator_state: Any, where: str) -> None:
    """Makes a restored ``StatefulDataLoader`` continue as the uninterrupted run's would.

    ``load_state_dict`` only keeps the state: the next ``iter()`` builds the iterator from it,
    drawing its seeds from the loader's generator (or the global RNG) first and then setting
    the sampler's generator back to the epoch's start and replaying the epoch's shuffle. With
    ``num_workers=0`` that leaves the generator short of the seed draw the uninterrupted run
    made at the epoch's start, so every later epoch's order (and what follows from it)
    differed (issue 41). So the iterator is built now (``state_dict()`` builds the one the
    next ``iter()`` returns), before the global RNG states are restored, and the generator is
    set to its state at the snapshot."""
    if not hasattr(loader, "_initial_iter_for_state_dict"):
        # A torchdata whose state_dict() would take the restored state for an iterator that
        # iter() then drops: the position would be lost. Left to iter(), as before.
        warnings.warn(
            f"flashckpt: {where.removesuffix('.generator')} restored without its generator's "
            "state (this torchdata cannot build the restored iterator early): with "
            "num_workers=0 the epochs after this one may be shuffled differently from an "
            "uninterrupted run's. Fix: pip install -U torchdata",
            stacklevel=5,
        )
        return
    loader.state_dict()
    if generator_state is None or not isinstance(loader.generator, torch.Generator):
        return
    try:
        if not isinstance(generator_state, torch.Tensor) or generator_state.dtype != torch.uint8:
            raise TypeError(f"a {type(generator_state).__name__}, not a uint8 tensor")
        loader.generator.set_state(generator_state)
    except (TypeError, RuntimeError) as e:
        raise ValueError(
            f"{where}: the saved state does not fit the loader's generator ({e}); was the "
            "loader given another kind of generator= than the run that saved it?"
        ) from None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state tree (a DTensor's local piece)."""
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined]
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def clone_tensors(obj: Any, into: Any = None) -> Any:
    """Copies a state tree; every tensor in it gets memory of its own.

    New CPU tensors are carved out of one anonymous buffer whose pages are all mapped in one
    call (MADV_POPULATE_WRITE) instead of one page fault per 4 KiB during the copy. Copying into
    existing tensors (``into``) is cheaper still: no new memory at all.

    Args:
        obj: dicts, lists, tuples, tensors; other values are copied shallowly.
        into: an optional tree parallel to ``obj`` (branches may be missing) of destinations: a
            tensor of the same shape, dtype and device there receives the copy in place (no new
            memory); ``obj``'s own tensor there means "keep it" (the caller copies it anyway).
    """
    from flashckpt.format.shm import anonymous_buffer

    dests: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(src): (src, dst)
    # A DTensor (a stateful object's sharded state) is copied as its local piece and wrapped
    # again: id(DTensor) -> (DTensor, its local piece, kept alive so its id stays unique).
    dtensors: dict[int, tuple[Any, torch.Tensor]] = {}

    def scan(o: Any, dst: Any) -> None:
        if isinstance(o, torch.Tensor):
            if is_dtensor(o):
                if id(o) not in dtensors:
                    with torch.no_grad():
                        dtensors[id(o)] = (o, o.to_local())  # type: ignore[attr-defined]
                o, dst = dtensors[id(o)][1], None
            # Same class too: a DTensor (its state is wrapped after this copy) is no target.
            fits = isinstance(dst, torch.Tensor) and (
                dst is o
                or (
                    type(dst) is type(o)
                    and dst.shape == o.shape
                    and dst.dtype == o.dtype
                    and dst.device == o.device
                )
            )
            dests.setdefault(id(o), (o, dst if fits else None))
        elif isinstance(o, dict):
            for k, v in o.items():
                scan(v, dst.get(k) if isinstance(dst, dict) else None)
        elif isinstance(o, list | tuple):
            same = isinstance(dst, list | tuple) and len(dst) == len(o)
            for i, v in enumerate(o):
                scan(v, dst[i] if same else None)

    scan(obj, into)
    align = 64
    cpu = [t for t, d in dests.values() if d is None and t.device.type == "cpu"]
    total = sum(-(-t.nbytes // align) * align for t in cpu)
    if total >= 1 << 20:
        mm, skip = anonymous_buffer(total)
        # frombuffer keeps `mm` mapped for as long as any view of it lives.
        block = torch.frombuffer(mm, dtype=torch.uint8)[skip : skip + total]
    else:
        block = torch.empty(total, dtype=torch.uint8)
    off = 0
    for t in cpu:
        dests[id(t)] = (t, block[off : off + t.nbytes].view(t.dtype).view(t.shape))
        off += -(-t.nbytes // align) * align
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, (t, d) in dests.items():
            if d is None:
                out[key] = t.clone()
            elif d is t:
                out[key] = t
            else:
                out[key] = d.copy_(t)

    def build(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) in dtensors:
                from torch.distributed.tensor import DTensor

                local = out[id(dtensors[id(o)][1])]
                return DTensor.from_local(
                    local,
                    o.device_mesh,  # type: ignore[attr-defined]
                    o.placements,  # type: ignore[attr-defined]
                    run_check=False,
                    shape=o.shape,
                    stride=o.stride(),
                )
            return out[id(o)]
        if isinstance(o, dict):
            return {k: build(v) for k, v in o.items()}
        if isinstance(o, list):
            return [build(v) for v in o]
        if isinstance(o, tuple):
            return tuple(build(v) for v in o)
        return copy.copy(o)

    return build(obj)


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")
"""The key prefixes a wrapper adds to a model's state dict: ``DistributedDataParallel`` (and
``DataParallel``) ``module.``, ``torch.compile`` ``_orig_mod.``, and both nested."""


def wrapper_prefix(saved: set[str], current: set[str]) -> tuple[str, str] | None:
    """``(prefix, side)`` when the two key sets differ exactly by one wrapper prefix on every key:
    ``side`` is ``"checkpoint"`` when the checkpoint's keys carry it (saved through a wrapper the
    model lacks), ``"model"`` when the model's do. Whole sets only: never a partial mapping."""
    if not saved or not current or saved == current:
        return None
    for p in WRAPPER_PREFIXES:
        if {p + k for k in current} == saved:
            return p, "checkpoint"
        if {p + k for k in saved} == current:
            return p, "model"
    for p in WRAPPER_PREFIXES:  # one wrapper on each side: module.x against _orig_mod.x
        for q in WRAPPER_PREFIXES:
            if (
                p != q
                and all(k.startswith(p) for k in saved)
                and {q + k[len(p) :] for k in saved} == current
            ):
                return f"{p}->{q}", "both"
    return None


def _unwrapped(saved: dict[str, Any], current: Mapping[str, Any]) -> dict[str, Any] | None:
    """The saved model state with its keys renamed to the model's, when a wrapper prefix is the
    only difference (see :func:`wrapper_prefix`), else None."""
    found = wrapper_prefix(set(saved), set(current))
    if found is None:
        return None
    prefix, side = found
    if side == "checkpoint":
        return {k[len(prefix) :]: v for k, v in saved.items()}
    if side == "model":
        return {prefix + k: v for k, v in saved.items()}
    p, q = prefix.split("->")
    return {q + k[len(p) :]: v for k, v in saved.items()}


def _prefix_hint(saved: set[str], current: set[str]) -> str | None:
    """A line naming a wrapper prefix most saved keys carry that the model's lack (or the other
    way round), where the key sets still differ otherwise, with the fix."""
    for p in WRAPPER_PREFIXES:
        if (
            saved
            and all(k.startswith(p) for k in saved)
            and not any(k.startswith(p) for k in current)
        ):
            return (
                f"the checkpoint's keys all start with {p!r} (saved through a wrapper: "
                f"{'DistributedDataParallel' if p.startswith('module') else 'torch.compile'}), "
                "the model's do not, and the keys differ beyond that prefix: wrap the model the "
                "same way before entry, or restore into the model it was saved from"
            )
        if (
            current
            and all(k.startswith(p) for k in current)
            and not any(k.startswith(p) for k in saved)
        ):
            return (
                f"the model's keys all start with {p!r} (a wrapper), the checkpoint's do not, "
                "and the keys differ beyond that prefix: pass the unwrapped model, or restore "
                "into the model it was saved from"
            )
    return None
