#!/usr/bin/env bash
# Issue 12, run 2: Mixtral before (main) / after (perf branch: group_m=8 for experts larger than the L2), same command;
# group_m 1 vs 8 on DeepSeek-V3 and GPT-OSS-20B (experts under the L2: the rule leaves them at 1).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/r2; mkdir -p $R
pack() { tar czf $OUT/run2.tgz -C /tmp r2; }
T0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee $R/env.txt
B="python3 -m moelab.bench --quick --shape mixtral --tokens 1024,4096,16384 --peers none --impls moelab --no-graphs --check-tokens 1"
el before; MOELAB_COMMIT=$MAIN PYTHONPATH=$PWD timeout 35 $B --out $R/before.json > $R/before.log 2>&1; pack
el after; MOELAB_COMMIT=perf-branch PYTHONPATH=$PWD/.dev_perf timeout 35 $B --out $R/after.json > $R/after.log 2>&1; pack
el probe; PYTHONPATH=$PWD/.dev_perf timeout 30 python3 .dev_perf/scripts/tune_moe.py --shape deepseek-v3 --shape gpt-oss-20b --tokens 4096 --group-m 1,8 --max-configs 2 > $R/probe.log 2>&1; pack
el done
grep -h "moelab triton " $R/before.log $R/after.log
grep -h "us$\|best" $R/probe.log
