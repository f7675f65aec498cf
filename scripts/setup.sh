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
# torchtitan for tests/integrations/test_torchtitan_real.py only: --no-deps on a path of its own
# (.venv/torchtitan-site, which that test's subprocess puts on sys.path), because its own
# requirements (datasets<4.8) cannot live next to the dev extra's transformers. Not fatal: without
# it that test skips, saying so.
tt=.venv/torchtitan-site
ttreq=scripts/torchtitan-test-requirements.txt
if [ ! -f "$tt/.installed" ] || [ "$ttreq" -nt "$tt/.installed" ]; then
    rm -rf "$tt"
    if .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$tt" \
        -r "$ttreq"; then
        touch "$tt/.installed"
    else
        rm -rf "$tt"
        echo "setup.sh: WARNING: torchtitan ($ttreq) could not be installed into $tt;" \
            "tests/integrations/test_torchtitan_real.py will skip" >&2
    fi
fi
export PATH="$root/.venv/bin:$PATH"
