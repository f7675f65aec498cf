"""The rank processes of a multi-process test run (one command line per rank), each with its
stderr in a file (a pipe nobody reads could fill and block a rank); every one still running is
SIGKILLed and reaped at the end, even when the test failed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from waiting import wait_until


class RankProcs:
    """Rank processes started with :meth:`start`, rank i the i-th; a context manager."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.tmp, self.tag = tmp, tag
        self.procs: list[subprocess.Popen[bytes]] = []
        self.errs: list[Path] = []

    def start(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Starts the next rank: ``cmd``, its stderr in ``<tmp>/<tag>-r<rank>-<ns>.stderr``."""
        err = self.tmp / f"{self.tag}-r{len(self.procs)}-{time.monotonic_ns()}.stderr"
        with open(err, "wb") as f:
            self.procs.append(
                subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=f, env=env)
            )
        self.errs.append(err)

    def wait(self, timeout: float = 300.0, *, stop_on_signal: bool = False) -> list[int]:
        """Waits until every rank exits; the exit codes. ``stop_on_signal``: once one dies by
        a signal, the survivors (stuck in a collective) get a second, then are SIGKILLed, as
        torchrun's agent would do. Fails naming the ranks still running after ``timeout``."""

        def ended() -> list[int | None] | None:
            codes = [p.poll() for p in self.procs]
            signalled = stop_on_signal and any(c is not None and c < 0 for c in codes)
            return codes if signalled or None not in codes else None

        try:
            codes = wait_until(
                ended,
                f"the {self.tag} ranks to exit",
                timeout,
                0.05,
                state=lambda: f"exit codes {[p.poll() for p in self.procs]}; {self.tails(800)}",
            )
            if None in codes:
                time.sleep(1.0)  # let survivors finish a snapshot in flight
        finally:
            self.close()
        return [int(p.returncode) for p in self.procs]

    def expect(self, codes: Sequence[int], timeout: float = 300.0) -> None:
        """Waits for every rank and checks its exit code; shows their stderr if one differs."""
        assert self.wait(timeout) == list(codes), self.tails()

    def stderr(self, rank: int) -> str:
        return self.errs[rank].read_text(errors="replace")

    def tails(self, chars: int = 3000) -> list[str]:
        return [self.stderr(r)[-chars:] for r in range(len(self.procs))]

    def close(self) -> None:
        """SIGKILLs every rank still running and reaps them all."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> RankProcs:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def run_worker(
    script: Path,
    tmp: Path,
    tag: str,
    args: Callable[[int], Sequence[str]],
    world: int = 2,
    timeout: float = 300.0,
) -> None:
    """Runs ``world`` ranks of the worker ``script`` (``python <script> *args(rank)``) to the
    end; each must exit 0 (their stderr shown otherwise)."""
    with RankProcs(tmp, tag) as ranks:
        for rank in range(world):
            ranks.start([sys.executable, str(script), *args(rank)])
        ranks.expect([0] * world, timeout)
