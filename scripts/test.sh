#!/usr/bin/env bash
# The test command: lint, type-check, then the whole test suite.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
ruff check flashckpt elastic tests benchmarks examples
ruff format --check flashckpt elastic tests benchmarks examples
mypy flashckpt elastic
python -m pytest "$@"
