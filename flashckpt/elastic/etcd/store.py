"""A ``torch.distributed.Store`` on etcd v3, for the rendezvous handler and process groups.

torch ships an etcd *v2* store only (``torch.distributed.elastic.rendezvous.etcd_store``); v2 is
off by default since etcd 3.4 and removed in 3.6. This is the v3 equivalent, built on
:class:`flashckpt.elastic.etcd.client.EtcdClient`. It behaves like torch's own stores (checked by
the same contract test as ``HashStore``): ``get``/``wait`` block until the keys exist or the store's
timeout passes, then raise ``DistStoreError``; ``compare_set`` and ``add`` are atomic.

Waiting uses an etcd watch, so a waiter wakes as soon as the key is written, without polling.

Keep a Python reference to the store for as long as torch uses it (torch's ``PrefixStore`` holds
only the C++ half; once the Python object is collected, calls fail with "Not implemented").

Finished rounds' keys are removed (issue 31: a job's keys are bounded however often it
restarts). The rendezvous hands each round a ``PrefixStore`` named ``<name>.<round>`` on this
store (torch's ``torch.rendezvous.<run_id>.<round>``), where the agents write the round's
``MASTER_ADDR``/``MASTER_PORT``, each machine's role and assigned ranks (``2 + 2N`` keys a
round), the exit barrier and the health check's keys. Exactly one process writes a round's
``MASTER_ADDR`` (the agent of group rank 0, :class:`RendezvousStoreInfo`); when it does, every
round of the same name before the previous one is over (their machines are in this round, or
gone), and that process deletes their keys: at most the current and the previous round stay.
Finding them costs one keys-only read of one key per round present, not a read of the store.
The keys of the last rounds go with the job
(:func:`flashckpt.elastic.membership.jobkeys.remove_finished_job_keys`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd._wire import prefix_range_end
from flashckpt.elastic.etcd.client import EtcdClient, KeyValue
from flashckpt.elastic.etcd.errors import EtcdError, EtcdOutcomeUnknown

__all__ = ["EtcdV3Store", "round_of"]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = timedelta(seconds=300)  # c10d's default store timeout
_ROUND_KEY = re.compile(rb"^(?P<name>[^/]*)\.(?P<round>[0-9]+)/(?P<rest>.*)$", re.DOTALL)
_MAX_ROUNDS_LISTED = 1000
"""Rounds of one name looked at per clean-up, at most (two or three are normal)."""


def round_of(key: bytes) -> tuple[bytes, int, bytes] | None:
    """``(name, round, rest)`` of a store key written through a round's ``PrefixStore``
    (``<name>.<round>/<rest>``), or None for any other key."""
    found = _ROUND_KEY.match(key)
    if found is None:
        return None
    return found["name"], int(found["round"]), found["rest"]


def _as_bytes(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store values must be str or bytes, got {type(value).__name__}")


class EtcdV3Store(dist.Store):
    """A c10d ``Store`` whose keys live in etcd under ``prefix``.

    Args:
        client: The etcd client; its timeout bounds each etcd round trip.
        prefix: Key prefix that isolates this store, e.g. ``"/flashckpt/<run_id>/store/"``.
        timeout: How long ``get`` and ``wait`` block for missing keys (c10d's default: 300 s).
            Changed later with ``set_timeout``.

    Raises:
        ValueError: If ``prefix`` is empty.
    """

    def __init__(
        self, client: EtcdClient, prefix: str, *, timeout: timedelta = _DEFAULT_TIMEOUT
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix:
            raise ValueError(
                "EtcdV3Store needs a non-empty key prefix, e.g. '/flashckpt/job/store/'"
            )
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.set_timeout(timeout)

    @property
    def client(self) -> EtcdClient:
        """The etcd client."""
        return self._client

    @property
    def prefix(self) -> str:
        """The key prefix, ending in ``/``."""
        return self._prefix

    def __repr__(self) -> str:
        return f"EtcdV3Store({self._client!r}, prefix={self._prefix!r})"

    # ---------------------------------------------------------------------- c10d Store API
    # Method names and argument orders are those torch's trampoline calls.

    def set(self, key: str, value: str | bytes) -> None:
        """Writes ``key``; the first key of a new round (its ``MASTER_ADDR``) also removes the
        keys of the rounds before the previous one (see the module docstring)."""
        etcd_key = self._key(key)
        with self._etcd_errors():
            self._client.put(etcd_key, _as_bytes(value))
        parsed = round_of(_as_bytes(key))
        if parsed is not None and parsed[2] == RendezvousStoreInfo.MASTER_ADDR_KEY.encode():
            self.remove_finished_rounds(parsed[0], parsed[1])

    def remove_finished_rounds(self, name: bytes, current: int) -> list[int]:
        """Deletes the keys of the rounds ``<name>.<r>/`` before ``current``, but for the
        newest of them (the previous round). Never raises: a failed clean-up leaves keys
        behind, which the next round's removes.

        Returns:
            The rounds whose keys were deleted.
        """
        base = self._prefix.encode() + name + b"."
        end = prefix_range_end(base)
        start = base
        earlier: list[int] = []
        removed: list[int] = []
        try:
            for _ in range(_MAX_ROUNDS_LISTED):
                found = self._client.get_range(start, end, limit=1, keys_only=True)
                if not found:
                    break
                segment, slash, _ = found[0].key[len(base) :].partition(b"/")
                # Skip to the key after this segment's keys: one read per round present.
                start = prefix_range_end(base + segment + b"/") if slash else found[0].key + b"\x00"
                if slash and segment.isdigit() and int(segment) < current:
                    earlier.append(int(segment))
            for number in sorted(earlier)[:-1]:
                self._client.delete_prefix(base + str(number).encode() + b"/")
                removed.append(number)
        except EtcdError as exc:
            logger.warning(
                "could not remove the store keys of finished rounds of %r (the next round "
                "tries again): %s",
                name.decode(errors="replace"),
                exc,
            )
        if removed:
            logger.debug("removed the store keys of rounds %s of %r", removed, name)
        return removed

    def get(self, key: str) -> bytes:
        """Reads ``key``, blocking until it exists or the store's timeout passes.

        Raises:
            DistStoreError: If the key does not appear within the store's timeout.
            DistNetworkError: If etcd cannot be reached.
        """
        entries = self._wait_for([key], self._current_timeout())
        entry = entries[0]
        assert entry is not None
        return entry.value

    def add(self, key: str, amount: int) -> int:
        """Atomically adds ``amount`` to the decimal integer at ``key`` (absent counts as 0).

        Returns:
            The new value.

        Raises:
            ValueError: If the stored value is not a decimal integer.
            DistNetworkError: If etcd cannot be reached, or the answer to the increment was lost
                (it may or may not have been applied; repeating it could count twice).
        """
        etcd_key = self._key(key)
        while True:
            with self._etcd_errors():
                current = self._client.get_kv(etcd_key)
            if current is None:
                base, revision = 0, 0
            else:
                try:
                    base, revision = int(current.value), current.mod_revision
                except ValueError:
                    raise ValueError(
                        f"store key {key!r} holds {current.value[:50]!r}, not an integer; add() "
                        "only works on keys written by add() or set() with a decimal number"
                    ) from None
            new_value = base + amount
            with self._etcd_errors():
                succeeded, _ = self._client.compare_and_set(
                    etcd_key, str(new_value).encode(), mod_revision=revision
                )
            if succeeded:
                return new_value

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Sets ``key`` to ``desired_value`` if it holds ``expected_value``, atomically.

        Follows c10d's semantics: an absent key matches an empty ``expected_value``.

        Returns:
            The value now stored: ``desired_value`` on success, else the current value (or
            ``expected_value`` when the key is absent and ``expected_value`` is not empty).
        """
        etcd_key = self._key(key)
        expected = _as_bytes(expected_value)
        desired = _as_bytes(desired_value)
        while True:
            with self._etcd_errors():
                current = self._client.get_kv(etcd_key)
            if current is None:
                if expected:
                    return expected
                revision = 0
            elif current.value == expected:
                revision = current.mod_revision
            else:
                return current.value
            try:
                with self._etcd_errors(outcome_unknown_ok=True):
                    succeeded, now = self._client.compare_and_set(
                        etcd_key, desired, mod_revision=revision
                    )
            except EtcdOutcomeUnknown:
                # A lost answer is safe to resolve by re-reading: whichever value is stored now
                # is what compare_set must report.
                continue
            if succeeded:
                return desired
            if now is not None and now.value != expected:
                return now.value
            # The key changed revision but not value (or was deleted): read again.

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Blocks until every key in ``keys`` exists.

        Args:
            keys: The keys.
            timeout: Overrides the store's timeout for this call.

        Raises:
            DistStoreError: If a key is still missing when the timeout passes.
        """
        self._wait_for(list(keys), self._current_timeout() if timeout is None else timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists now (no waiting)."""
        with self._etcd_errors():
            entries, _ = self._client.get_many([self._key(k) for k in keys])
        return all(entry is not None for entry in entries)

    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; returns whether it existed."""
        with self._etcd_errors():
            return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        """Number of keys in this store (under its prefix)."""
        with self._etcd_errors():
            return self._client.count_prefix(self._prefix)

    # torch's trampoline dispatches these two under their C++ names.
    def deleteKey(self, key: str) -> bool:
        """Alias of :meth:`delete_key` called by torch's C++ side."""
        return self.delete_key(key)

    def getNumKeys(self) -> int:
        """Alias of :meth:`num_keys` called by torch's C++ side."""
        return self.num_keys()

    # ---------------------------------------------------------------------- helpers

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix.encode() + _as_bytes(key)

    def _current_timeout(self) -> timedelta:
        # The C++ half owns the timeout, so set_timeout() through a PrefixStore reaches it.
        return self.timeout  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _etcd_errors(self, *, outcome_unknown_ok: bool = False) -> Iterator[None]:
        """Maps etcd failures to torch's network error, as torch's own stores raise."""
        try:
            yield
        except EtcdError as exc:
            if outcome_unknown_ok and isinstance(exc, EtcdOutcomeUnknown):
                raise
            raise dist.DistNetworkError(
                f"etcd store {self._prefix!r} at {','.join(self._client.endpoints)}: {exc}"
            ) from exc

    def _wait_for(self, keys: list[str], timeout: timedelta) -> list[KeyValue | None]:
        etcd_keys = [self._key(k) for k in keys]
        deadline = Deadline.after(timeout)
        while True:
            with self._etcd_errors():
                entries, revision = self._client.get_many(etcd_keys)
            if all(entry is not None for entry in entries):
                return entries
            remaining = deadline.remaining()
            if remaining <= 0:
                missing = [k for k, entry in zip(keys, entries, strict=True) if entry is None]
                raise dist.DistStoreError(
                    f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {missing} "
                    f"(etcd store {self._prefix!r}); the process that should set them has not "
                    "done so: check that it is alive, or raise the store timeout"
                )
            # Any write under the prefix wakes us; then re-check the keys we need.
            with self._etcd_errors():
                self._client.wait_for_change(
                    self._prefix,
                    prefix=True,
                    after_revision=revision,
                    timeout=timedelta(seconds=remaining),
                )
