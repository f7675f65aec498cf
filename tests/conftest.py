"""Fixtures for the flashckpt tests (defined in ``tests/support/fchelpers.py``).

The tests mirror the package tree (``tests/agent/`` for ``flashckpt/agent/``, ...), with
``tests/e2e/`` for whole runs, ``tests/architecture/`` for the rules over the code and
``tests/benchmarks/`` for the benchmarks' own checks. Helpers shared by several folders live in
``tests/support/`` and are imported by module name (``from fchelpers import FcEnv``): this file
puts that folder on ``sys.path`` first, and scripts there that tests run as processes put their
own folder on it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from fchelpers import agent, fc_env, fc_env_private
from s3fixtures import s3_env, s3_prefix, s3_server

__all__ = ["agent", "fc_env", "fc_env_private", "s3_env", "s3_prefix", "s3_server"]
