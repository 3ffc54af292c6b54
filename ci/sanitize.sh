#!/usr/bin/env bash
# Builds the compiled core with AddressSanitizer and UndefinedBehaviorSanitizer
# (PYFLOWBUF_SANITIZE=1, see setup.py) in a copy of the tree, so the normal
# in-place build stays as it is, and runs the core, network and worker tests
# (the worker-kill and restart tests included) against it. Any sanitizer report fails the run.
#
#   bash ci/sanitize.sh                 # the default selection, a few minutes
#   bash ci/sanitize.sh tests/test_netio.py -k pump    # or any pytest arguments
#
# PYFLOWBUF_PYTHON: the interpreter (default .venv/bin/python);
# PYFLOWBUF_SANITIZE_DIR: where to build (default a new temporary directory,
# removed afterwards; a given one is kept and reused).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYFLOWBUF_PYTHON:-$ROOT/.venv/bin/python}
log() { printf '\033[1m[sanitize]\033[0m %s\n' "$*"; }

# The sanitizer runtimes ship with gcc; Debian-like systems package them apart.
runtime() { local f; f=$(gcc -print-file-name="$1"); [ -f "$f" ] && echo "$f"; }
if ! runtime libasan.so >/dev/null || ! runtime libubsan.so >/dev/null; then
  log "installing the gcc sanitizer runtimes"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  if command -v apt-get >/dev/null 2>&1; then
    # libgcc-N-dev holds gcc's libasan.so/libubsan.so links and pulls in the runtimes
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "libgcc-$(gcc -dumpversion | cut -d. -f1)-dev"
  elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y libasan libubsan
  fi
fi
LIBASAN=$(runtime libasan.so) || { echo "sanitize: no libasan.so for $(gcc --version | head -1)" >&2; exit 1; }
LIBUBSAN=$(runtime libubsan.so) || { echo "sanitize: no libubsan.so for $(gcc --version | head -1)" >&2; exit 1; }

if [ -n "${PYFLOWBUF_SANITIZE_DIR:-}" ]; then
  BUILD=$PYFLOWBUF_SANITIZE_DIR
  mkdir -p "$BUILD"
else
  BUILD=$(mktemp -d "${TMPDIR:-/tmp}/pyflowbuf-sanitize.XXXXXX")
  trap 'rm -rf "$BUILD"' EXIT
fi

# The sources and the tests, without the normal build's outputs.
log "building the core with ASan and UBSan in $BUILD"
tar -C "$ROOT" -cf - --exclude='*.so' --exclude='pyflowbuf/_core/*.c' --exclude='*.html' \
    --exclude='__pycache__' setup.py pyproject.toml csrc pyflowbuf tests | tar -C "$BUILD" -xf -
(cd "$BUILD" && PYFLOWBUF_SANITIZE=1 "$PY" setup.py -q build_ext --inplace -j "${PYFLOWBUF_BUILD_JOBS:-2}" \
    > build.log 2>&1) || { tail -40 "$BUILD/build.log" >&2; exit 1; }

if [ $# -eq 0 ]; then
  # core, network, and the worker tests, the ones that kill or fail workers
  # and restart them included. Those were left out while a restart forked its
  # workers from the driver as its threads ran: gcc 12's ASan runtime does
  # not lock its allocator around fork(), and with every Python allocation in
  # it (PYTHONMALLOC=malloc) a child forked while another thread held that
  # lock hung before it started. Every worker is forked by the job's zygote
  # now, a process with one thread (pyflowbuf/cluster/zygote.py).
  # PYFLOWBUF_WORKER_KILLS: the random kills each property test tries.
  set -- tests/test_memory.py tests/test_channel.py tests/test_serde.py tests/test_netio.py \
         tests/test_net_frames.py tests/test_net_credit.py tests/test_net_handshake.py tests/test_net_e2e.py \
         tests/test_net_tls.py \
         tests/test_checkpoints_workers.py tests/test_cluster.py tests/test_zygote.py \
         "tests/test_checkpoints.py::test_exactly_once_when_a_worker_process_is_killed_at_a_random_record" \
         "tests/test_unaligned.py::test_exactly_once_when_a_worker_is_killed_unaligned" \
         -k "not killed_by_a_signal"      # that one segfaults on purpose: ASan reports it instead
  export PYFLOWBUF_WORKER_KILLS=${PYFLOWBUF_WORKER_KILLS:-4}
fi

log "running the tests under the sanitizers"
# Python itself is not instrumented, so the ASan runtime must be loaded first.
# CPython keeps objects alive until exit: leak reports would be noise.
# Python's own allocator hides buffer overruns from ASan: use malloc.
cd "$BUILD"
export LD_PRELOAD="$LIBASAN $LIBUBSAN${LD_PRELOAD:+ $LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:print_summary=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:print_summary=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export PYTHONMALLOC=malloc
export PYTHONPATH="$BUILD"
export HYPOTHESIS_PROFILE=${PYFLOWBUF_SANITIZE_PROFILE:-dev}   # not the main run's: a few minutes
"$PY" -c 'import pyflowbuf._core.memory as m, sys; assert m.__file__.startswith(sys.argv[1]), m.__file__' "$BUILD"
"$PY" -m pytest -p no:cacheprovider -q "$@"
