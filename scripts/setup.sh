#!/usr/bin/env bash
# Creates .venv (once) and installs flashckpt with its dev tools. Sourced by demo.sh and test.sh.
# torch is pinned to the CPU wheel first so pip never pulls a multi-GB CUDA build; the package
# itself accepts a range of torch versions.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.flashckpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
    touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
