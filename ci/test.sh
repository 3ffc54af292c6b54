#!/usr/bin/env bash
# Sets everything up (ci/setup.sh) and runs the whole test suite; in CI (CI=true)
# or when asked (PYFLOWBUF_SANITIZE_TESTS=1), then also the core, network and
# worker tests against a build with ASan and UBSan (ci/sanitize.sh).
# Fails if either run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-$([ "${CI:-}" = true ] && echo ci || echo dev)}
sanitize=${PYFLOWBUF_SANITIZE_TESTS:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}
if [ "$sanitize" != 1 ]; then
  exec .venv/bin/python -m pytest tests "$@"
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
set +e
.venv/bin/python -m pytest tests "$@" 2>&1 | tee "$out"
main=${PIPESTATUS[0]}
bash ci/sanitize.sh
san=$?
set -e
# the main run's closing line last again, as pytest printed it, where a
# reader (or a CI log view) looks
echo "sanitizer run (ci/sanitize.sh): $([ $san = 0 ] && echo passed || echo "FAILED (exit $san)"); main run (exit $main):"
grep -E '(passed|failed|errors?|skipped|xfailed|no tests ran).* in [0-9.]+s' "$out" | tail -1 || true
[ "$main" = 0 ] && [ "$san" = 0 ]
