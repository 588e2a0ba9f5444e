#!/usr/bin/env bash
# Run every end-to-end regression script; exits non-zero if any of them fails.
cd "$(dirname "$0")/.." || exit 2
status=0
for script in convergence determinism sharding_matrix checkpoint multislice plan_verify hf_convert generate bench_pipeline pipeline_memory bench_moe post_training; do
  echo "=== end_to_end/$script.py"
  start=$SECONDS
  python "end_to_end/$script.py" || { echo "=== $script: FAIL"; status=1; }
  echo "=== $script: $((SECONDS - start)) s"
done
echo "=== python -m maxpar.tools.shardings_dump --check"
python -m maxpar.tools.shardings_dump --check || { echo "=== shardings_dump: FAIL"; status=1; }
exit $status
