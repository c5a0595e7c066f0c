#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
# Two workers (pytest-xdist), each taking whole test files: most tests build tiny engines whose
# time is Python on one core, so two files at once use both cores of a 2-core machine
# (measured: 44.5 min one at a time), each worker on one OpenMP thread (tests/conftest.py; with
# two threads each, 35 min against 20 on a 2-core Intel Xeon). TEST_WORKERS=0 runs them in this
# process, one at a time. Files go to the workers in collection order, longest first
# (tests/suite_order.py LONGEST_FIRST), not xdist's order by test count.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
