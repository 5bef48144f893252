#!/usr/bin/env bash
# Issue 12, trees of other commits side by side in one device call (make them here first: scripts/ab_trees.sh):
#   run(command="TESTS_TREE=new TREES='new old new old' AB='...' bash scripts/device_ab.sh", carry=["build/ab"])
# Steps: the GPU tests of build/ab/$TESTS_TREE (TESTS, default tests/test_gluon_gemm.py tests/test_lora_banks.py,
# stopped after TESTS_S seconds; none without TESTS_TREE), then the command AB in build/ab/<tree>/scripts for each
# tree of TREES in turn (PYTHONPATH its tree; each run stopped after AB_S seconds), its lines tagged [tree] into
# $OUT/ab.txt. Alternate the trees (new old new old): the spread between a tree's runs shows beside the difference.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/ab_out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT=$PWD
. "$(dirname "$0")/device_env.sh"
if [ -n "${TESTS_TREE:-}" ]; then
  el "tests $TESTS_TREE ($(cat "build/ab/$TESTS_TREE/COMMIT"))"
  (cd "build/ab/$TESTS_TREE" && PYTHONPATH=$PWD gpu_tests "${TESTS_S:-240}" ${TESTS:-tests/test_gluon_gemm.py tests/test_lora_banks.py})
fi
for tree in ${TREES:-}; do
  el "$tree ($(cat "$ROOT/build/ab/$tree/COMMIT"))"
  (cd "$ROOT/build/ab/$tree/scripts" && PYTHONPATH="$ROOT/build/ab/$tree" timeout "${AB_S:-150}" bash -c "$AB" 2>&1 | grep -v -i warn \
    | sed "s/^/[$tree] /" | tee -a "$OUT/ab.txt")
done
el done
