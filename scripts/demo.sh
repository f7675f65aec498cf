#!/usr/bin/env bash
# The main job: a 2-rank GPT training run with flash checkpointing, a SIGKILL of one rank, a
# resume from shared memory, and a bitwise check against an uninterrupted run.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
python examples/demo.py "$@"
