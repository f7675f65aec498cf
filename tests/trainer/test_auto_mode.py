"""mode="auto" (the copy strategy follows the device) and the CUDA registration of the slots,
on CPU: the registration runs against a stand-in of the CUDA runtime, so what is checked is
when flashckpt registers (at entry, never in save()), what (each slot's whole mapping), that it
unregisters before a slot is dropped, and what a refused registration does. The real GPU path
is in tests/test_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step, train_steps

import flashckpt
import flashckpt.trainer.restore.apply
from flashckpt.trainer.config import CheckpointConfig, resolve_copy_mode
from flashckpt.trainer.snapshot import CudaHostRegistrar


class FakeCudart:
    """Records the calls flashckpt makes to the CUDA runtime; ``register_rc`` is the code
    cudaHostRegister returns (0: success)."""

    def __init__(self, register_rc: int = 0) -> None:
        self.register_rc = register_rc
        self.calls: list[tuple[Any, ...]] = []
        self.pinned: dict[int, int] = {}
        self.cleared = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        if self.register_rc == 0:
            assert ptr not in self.pinned, "registered twice"
            self.pinned[ptr] = size
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.pinned.pop(ptr, None) is not None else 713  # not registered

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


def _slot_ranges(ck: Any) -> dict[int, int]:
    return {sm.data.data_ptr(): sm.data.numel() for sm in ck._snap.slots if sm is not None}


def _as_cuda_state(ck: Any, rt: FakeCudart) -> None:
    """Makes entry see a state with CUDA tensors (this machine has none) and register through
    the stand-in; the tensors stay on the CPU, so no copy touches CUDA."""
    ck._snap.registrar = ck._applier.registrar = CudaHostRegistrar(rt)
    ck._snap.state_device_types = lambda: {"cpu", "cuda"}
    ck._applier.state_on_cuda = lambda: True


# -- mode="auto" ---------------------------------------------------------------------------------
def test_auto_resolves_from_the_devices_of_the_state() -> None:
    assert resolve_copy_mode("auto", {"cpu"})[0] == "sync"
    assert resolve_copy_mode("auto", set())[0] == "sync"  # nothing to copy in the background
    assert resolve_copy_mode("auto", {"cuda"})[0] == "overlap"
    mode, why = resolve_copy_mode("auto", {"cpu", "cuda"})  # mixed: overlap
    assert mode == "overlap" and "cuda" in why
    assert resolve_copy_mode("sync", {"cuda"})[0] == "sync"  # an explicit mode stays
    assert resolve_copy_mode("overlap", {"cpu"})[0] == "overlap"
    with pytest.raises(ValueError, match="mode='async': use 'auto', 'overlap' or 'sync'"):
        resolve_copy_mode("async", {"cpu"})


def test_auto_is_the_default_and_bad_modes_are_clear_errors() -> None:
    assert CheckpointConfig().mode == "auto"
    for mode in ("async", "Overlap", None):
        with pytest.raises(ValueError, match="use 'auto', 'overlap' or 'sync'"):
            CheckpointConfig(mode=mode)  # type: ignore[arg-type]
    model, opt, _ = make(0)
    with pytest.raises(ValueError, match="mode='background'"):
        flashckpt.checkpointing(model, opt, allow_unsaved_scheduler=True, mode="background")


def test_default_on_cpu_copies_synchronously_without_a_copy_thread(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=0, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        assert ck.stats.copy_mode is None  # resolved at the first save, not before
        train_step(model, opt, sched, 0)
        ck.step()
        h = ck.save()
        assert h.taken and h.done() and h._future is None  # copied before save() returned
        assert ck.stats.last_snapshot_step == 1
        assert ck.stats.copy_mode == "sync"
        assert ck.status()["copy_mode"] == {
            "configured": "auto",
            "resolved": "sync",
            "reason": "mode='auto': the whole state lives in host memory",
        }
        train_steps(ck, model, opt, sched, 1, 3)
        ck.save()
        assert ck.stats.wait_s == []  # optimizer.step() never waited for a copy
        assert not ck._snap.executor._threads  # no copy thread was ever started
        assert ck._snap.registrar._cudart is None  # a CPU state never touches CUDA
        # save(mode=...) overrides one snapshot; "auto" means the resolved mode
        assert ck.save(mode="auto")._future is None
        with pytest.raises(ValueError, match=r"save\(mode='fast'\): use 'auto', 'overlap'"):
            ck.save(mode="fast")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"save\(when_busy='drop'\): use 'wait' or 'skip'"):
            ck.save(when_busy="drop")  # type: ignore[arg-type]
    assert flashckpt.load(fc_env.storage).step == 3


def test_overlap_stays_selectable_on_cpu(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=0, **fc_env.ckpt_kwargs(agent="connect", mode="overlap")
    ) as ck:
        train_step(model, opt, sched, 0)
        ck.step()
        h = ck.save()
        assert h._future is not None  # the bulk went to the copy thread
        h.wait()
        assert ck._snap.executor._threads
        assert ck.stats.copy_mode == "overlap"
        assert ck.status()["copy_mode"]["reason"] == "mode='overlap' configured"


# -- CUDA registration of the slots (a stand-in runtime) ----------------------------------------
def test_cuda_state_registers_its_slots_at_entry_and_unregisters_at_close(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    rt = FakeCudart()
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, every=0, **fc_env.ckpt_kwargs(agent="connect")
    )
    _as_cuda_state(ck, rt)
    with ck:
        slots = _slot_ranges(ck)
        assert len(slots) == 2
        # Both slots, each whole mapping (header included), before any save().
        assert rt.pinned == slots and ck.stats.saves == 0
        assert {c[3] for c in rt.calls} == {1}  # cudaHostRegisterPortable: every device
        assert all(sm.registered_cuda for sm in ck._snap.slots)
        calls = len(rt.calls)
        train_steps(ck, model, opt, sched, 0, 2)
        ck.save()
        ck.save(mode="overlap")
        ck.wait()
        assert len(rt.calls) == calls  # save() registers nothing
    assert rt.pinned == {}  # unregistered at close
    assert sorted(c[1] for c in rt.calls if c[0] == "unregister") == sorted(slots)


def test_cpu_state_registers_nothing(fc_env: FcEnv, agent: RunningAgent) -> None:
    rt = FakeCudart()
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
    )
    ck._snap.registrar = CudaHostRegistrar(rt)
    with ck:
        train_steps(ck, model, opt, sched, 0, 4)
    assert rt.calls == []


def test_restore_from_memory_reads_registered_slots(fc_env: FcEnv, agent: RunningAgent) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 4)
    rt = FakeCudart()
    model2, opt2, sched2 = make(1)
    ck2 = flashckpt.checkpointing(
        model2, opt2, scheduler=sched2, **fc_env.ckpt_kwargs(agent="connect")
    )
    _as_cuda_state(ck2, rt)
    order: list[str] = []
    run = ck2._restorer.run

    def restore() -> None:
        order.append(f"restore with {len(rt.pinned)} registered")
        run()

    ck2._restorer.run = restore  # type: ignore[method-assign]
    with ck2:
        assert ck2.restored_from == "memory" and ck2.start_step == 4
        # the slots the agent's hello named were registered before the restore read them
        assert order == ["restore with 2 registered"]
        assert rt.pinned == _slot_ranges(ck2)
    assert rt.pinned == {}


def test_restore_from_storage_registers_its_read_buffer_while_it_is_applied(
    fc_env: FcEnv, agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
    ) as ck:
        train_steps(ck, model, opt, sched, 0, 4)
    agent.stop()  # a clean stop removes the slots: the next entry restores from storage
    again = RunningAgent(fc_env.agent_config())
    try:
        monkeypatch.setattr(
            flashckpt.trainer.restore.apply, "PIN_MIN_BYTES", 1
        )  # this state is tiny
        rt = FakeCudart()
        model2, opt2, sched2 = make(1)
        ck2 = flashckpt.checkpointing(
            model2, opt2, scheduler=sched2, **fc_env.ckpt_kwargs(agent="connect")
        )
        _as_cuda_state(ck2, rt)
        seen: list[dict[int, int]] = []
        apply = ck2._applier._apply

        def recording(state: Any, private: Any) -> None:
            seen.append(dict(rt.pinned))
            apply(state, private)

        ck2._applier._apply = recording  # type: ignore[method-assign]
        with ck2:
            assert ck2.restored_from == "storage" and ck2.start_step == 4
            slots = _slot_ranges(ck2)
            assert rt.pinned == slots  # the read buffer is unregistered once applied
        assert len(seen) == 1
        read_buffers = {p: n for p, n in seen[0].items() if p not in slots}
        assert read_buffers  # registered while the state was copied into the model
        unregistered = {c[1] for c in rt.calls if c[0] == "unregister"}
        assert set(read_buffers) <= unregistered
        assert rt.pinned == {}
        for k, v in model.state_dict().items():
            assert torch.equal(model2.state_dict()[k], v), k
    finally:
        again.stop()


def test_a_refused_registration_warns_once_and_training_goes_on(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    rt = FakeCudart(register_rc=2)  # cudaErrorMemoryAllocation
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, **fc_env.ckpt_kwargs(agent="connect")
    )
    _as_cuda_state(ck, rt)
    refused = r"cudaHostRegister of the snapshot slot .* failed with CUDA error 2"
    with pytest.warns(RuntimeWarning, match=refused):
        ck.__enter__()
    try:
        assert sum(c[0] == "register" for c in rt.calls) == 2  # each slot tried once
        assert rt.cleared == 2  # the runtime's last error reset after each
        assert not any(sm.registered_cuda for sm in ck._snap.slots)
        assert all(sm.register_failed for sm in ck._snap.slots)
        train_steps(ck, model, opt, sched, 0, 4)
        assert ck.stats.last_snapshot_step == 4
    finally:
        ck.__exit__(None, None, None)
    assert sum(c[0] == "register" for c in rt.calls) == 2  # never tried again
    assert not any(c[0] == "unregister" for c in rt.calls)  # nothing to unregister
    assert flashckpt.load(fc_env.storage).step == 4


class _Growing:
    """A stateful object whose state grows (a buffer appended to): the slots must grow too."""

    def __init__(self) -> None:
        self.t = torch.zeros(1024)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t = sd["t"].clone()


def test_a_slot_replaced_mid_run_is_unregistered_and_its_successor_registered(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    rt = FakeCudart()
    model, opt, sched = make(0)
    grow = _Growing()
    ck = flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        stateful={"grow": grow},
        every=0,
        **fc_env.ckpt_kwargs(agent="connect"),
    )
    _as_cuda_state(ck, rt)
    with ck:
        train_steps(ck, model, opt, sched, 0, 1)
        ck.save()
        before = _slot_ranges(ck)
        assert rt.pinned == before
        grow.t = torch.zeros(4 << 20)  # 16 MiB more than the slots hold
        train_steps(ck, model, opt, sched, 1, 2)
        ck.save()
        after = _slot_ranges(ck)
        gone = set(before) - set(after)
        assert len(gone) == 1  # the target was replaced; the one with step 1 kept
        assert rt.pinned == after  # the new slot registered, the dropped one not any more
        assert ("unregister", gone.pop()) in rt.calls
    assert rt.pinned == {}


# -- benchmarks/gpu_check.sh: what runs without a GPU ---------------------------------------------
_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def _gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(_SCRIPT), *args],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gpu_check_script_parses_and_refuses_bad_settings(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(_SCRIPT)], timeout=60).returncode == 0
    out = tmp_path / "out"
    r = _gpu_check("--dry-run", str(out), GPU_CHECK_SIZES="0.5 16", GPU_CHECK_BUDGET="300")
    assert r.returncode == 0, r.stderr
    assert "budget 300s, sizes (GiB): 0.5 16" in r.stdout
    assert "tests/test_gpu.py" in r.stdout
    assert f"--sizes 16 --only memcpy,fc,files,dcp --repeats 2 --out {out}" in r.stdout
    assert not out.exists()  # a dry run writes nothing
    assert "Usage" in _gpu_check("--help").stdout
    for args, env, says in [
        (("--fast",), {}, "unknown option --fast"),
        (("a", "b"), {}, "one OUT_DIR at most"),
        (("-n",), {"GPU_CHECK_BUDGET": "5m"}, "GPU_CHECK_BUDGET=5m: give whole seconds"),
        (("-n",), {"GPU_CHECK_BUDGET": "30"}, "60 or more"),
        (("-n",), {"GPU_CHECK_SIZES": "1 0"}, "'0' is no size in GiB"),
        (("-n",), {"GPU_CHECK_SIZES": "4GiB"}, "'4GiB' is no size in GiB"),
        (("-n",), {"GPU_CHECK_SIZES": " "}, "GPU_CHECK_SIZES is empty"),
    ]:
        r = _gpu_check(*args, **env)
        assert r.returncode == 64 and says in r.stderr, (args, env, r.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_check_script_without_cuda_measures_nothing_and_says_so(tmp_path: Path) -> None:
    r = _gpu_check(str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "no CUDA device" in r.stderr and "nothing was measured" in r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["ok"] is False and report["reason"] == "no CUDA device"
    assert [s["step"] for s in report["steps"]] == ["cuda"]
