"""Moved to :mod:`flashckpt.elastic.procutil` (issue 45: ``elastic/etcd/`` uses it, and may not
import ``launch/``); the launcher's modules still import it from here."""

from __future__ import annotations

from flashckpt.elastic.procutil import die_with_parent, set_parent_death_signal

__all__ = ["die_with_parent", "set_parent_death_signal"]
