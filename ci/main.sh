#!/usr/bin/env bash
# Sets everything up (ci/setup.sh) and runs the main job: the end-to-end demonstration.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python -m pyflowbuf demo "$@"
