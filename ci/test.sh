#!/usr/bin/env bash
# Sets everything up (ci/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-$([ "${CI:-}" = true ] && echo ci || echo dev)}
exec .venv/bin/python -m pytest tests "$@"
