#!/usr/bin/env bash
# Sets up everything pyflowbuf needs in a virtual environment inside the checkout:
# Python packages, the compiled extension, and a JDK 17+ for PySpark (installed
# from the system package manager when missing). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PYFLOWBUF_VENV:-.venv}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

java_major() {
  command -v java >/dev/null 2>&1 || { echo 0; return; }
  java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print (v[1] == "1" ? v[2] : v[1]); exit}'
}

if [ "${PYFLOWBUF_SKIP_JDK:-0}" != 1 ]; then
  if [ "$(java_major)" -lt 17 ]; then
    log "no JDK 17+ found; installing one with the system package manager"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    if command -v apt-get >/dev/null 2>&1; then
      $SUDO apt-get update -qq
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless \
        || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless
    elif command -v dnf >/dev/null 2>&1; then
      $SUDO dnf install -y java-17-openjdk-headless
    elif command -v brew >/dev/null 2>&1; then
      brew install openjdk@17
    else
      echo "setup: PySpark needs Java 17 or newer; install a JDK and run again" >&2; exit 1
    fi
  fi
  log "java $(java_major) found"
fi

# headless Chromium for the web view's browser tests (tests/test_ui_browser.py)
if [ "${PYFLOWBUF_SKIP_CHROMIUM:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  log "no chromium found; installing it from the system packages (the web view's browser tests)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  # optional: a failed index update must not fail the setup (the browser tests then skip)
  $SUDO apt-get update -qq || log "apt-get update failed; trying the install with the index there is"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
    || log "chromium could not be installed: the browser tests will be skipped"
fi

# OpenSSL's headers, so the compiled core encrypts in its own loops (libssl);
# without them TLS runs in a slower relay thread (pyflowbuf/net/tls.py)
if [ "${PYFLOWBUF_SKIP_LIBSSL:-0}" != 1 ] && [ ! -f /usr/include/openssl/ssl.h ] \
    && command -v apt-get >/dev/null 2>&1; then
  log "no OpenSSL headers found; installing libssl-dev (TLS inside the compiled core)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq || log "apt-get update failed; trying the install with the index there is"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libssl-dev \
    || log "libssl-dev could not be installed: TLS will run in the slower relay thread"
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
log "installing pyflowbuf with its test, Spark and benchmark extras (compiles the extension)"
"$VENV/bin/python" -m pip install -q -e ".[all]"
if [ "${PYFLOWBUF_SKIP_KAFKA:-0}" != 1 ]; then
  log "fetching the local Kafka broker's jars from Maven Central (once, into a cache)"
  "$VENV/bin/python" -m pyflowbuf.connectors.kafka_broker install
  "$VENV/bin/python" -m pyflowbuf.spark.kafka_jars install || log "Spark's Kafka connector not fetched: its tests and benchmark peer skip"
fi
log "ready: $("$VENV/bin/python" -c 'import pyflowbuf; print("pyflowbuf", pyflowbuf.__version__)')"
