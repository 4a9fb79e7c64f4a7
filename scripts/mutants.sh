#!/usr/bin/env bash
# Mutation testing of the modules a change touches; see scripts/mutants.py.
#   scripts/mutants.sh [--budget SECONDS] MODULE...     scripts/mutants.sh --changed [REF]
exec "${PYTHON:-python3}" "$(dirname "$0")/mutants.py" "$@"
