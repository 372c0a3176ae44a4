#!/usr/bin/env bash
# Runs a Python 3 (standard library only) test file given relative to the workspace root.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
exec /usr/bin/python3 "$1"
