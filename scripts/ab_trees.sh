#!/usr/bin/env bash
# Here (not on the device), before an A/B call: `bash scripts/ab_trees.sh NAME=COMMIT ...` puts each commit's tree
# (moelab/, scripts/, tests/, README.md and pyproject.toml: what the GPU tests and the profilers read) under
# build/ab/NAME, which git ignores; carry build/ab in the call (scripts/device_ab.sh runs them there).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for spec in "$@"; do
  name=${spec%%=*}; commit=${spec#*=}
  rm -rf "build/ab/$name"; mkdir -p "build/ab/$name"
  git archive "$commit" moelab scripts tests README.md pyproject.toml | tar -x -C "build/ab/$name"
  echo "build/ab/$name: $(git rev-parse --short "$commit")" | tee "build/ab/$name/COMMIT"
done
du -sh build/ab
