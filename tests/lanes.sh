#!/usr/bin/env bash
# `make test`'s pytest: the suite as two processes side by side on this 2-core machine.
# The journeys lane (tests marked `journeys` by tests/conftest.py: clusters, images,
# `dpserve serve` journeys) runs in the background into a log printed at the end; the
# rest (the fast tier and the worker gangs) runs in the foreground. Each lane alone
# keeps its own order, fixtures and machine-wide resources; the run fails if either does.
#
#   tests/lanes.sh PYTHON [PYTEST_ARGS...]
set -uo pipefail
PY=$1
shift
LOG=$(mktemp --suffix=.journeys.log)
trap 'rm -f "$LOG"' EXIT

# A background job of a script starts with SIGINT ignored, and Python then never turns it
# into KeyboardInterrupt: the lane would run on after Ctrl-C. The wrapper hands SIGINT
# back to its default before exec, so pytest installs its handler and tears down.
"$PY" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])' \
    tests -m journeys "$@" >"$LOG" 2>&1 &
JOURNEYS=$!
# Ctrl-C or a CI kill stops the journeys lane too (its fixtures tear down on SIGINT).
trap 'kill -INT "$JOURNEYS" 2>/dev/null; wait "$JOURNEYS"; rm -f "$LOG"; exit 130' INT TERM

"$PY" -m pytest tests -m "not journeys" "$@"
REST=$?
echo "== the rest: exit $REST; waiting for the journeys lane"
wait "$JOURNEYS"
LANE=$?
echo "== the journeys lane (exit $LANE):"
cat "$LOG"
# 5: a lane that PYTEST_ARGS left without tests (e.g. a -k for one test) did not fail.
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
if ! ok "$REST" || ! ok "$LANE"; then
    exit 1
fi
