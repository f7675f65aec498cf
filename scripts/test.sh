#!/usr/bin/env bash
# The test command: lint, type-check, then the whole test suite.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
ruff check flashckpt tests benchmarks examples scripts
ruff format --check flashckpt tests benchmarks examples scripts
mypy flashckpt
python -m pytest "$@"
