#!/usr/bin/env bash
# Run every end-to-end regression script; exits non-zero if any of them fails.
cd "$(dirname "$0")/.." || exit 2
status=0
for script in convergence checkpoint multislice plan_verify; do
  echo "=== end_to_end/$script.py"
  python "end_to_end/$script.py" || { echo "=== $script: FAIL"; status=1; }
done
exit $status
