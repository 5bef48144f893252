#!/usr/bin/env bash
# Issue 12, run 1: base bench of every BENCH.md shape (main's tree), LoRA banks, tile/group sweep (perf branch).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/r1; mkdir -p $R
pack() { tar czf $OUT/run1.tgz -C /tmp r1; }
T0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
  python3 -c "import torch,triton,transformers,peft;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__,'peft',peft.__version__)"
  echo "commit $MOELAB_COMMIT"; } 2>&1 | tee $R/env.txt
B="python3 -m moelab.bench --quick --tokens 1,32,128,1024,4096,16384 --peers grouped_mm,hf-grouped_mm"
el baseA; PYTHONPATH=$PWD timeout 90 $B --shape qwen3-30b-a3b,olmoe --time-budget 75 --out $R/base_qwen_olmoe.json > $R/base_qwen_olmoe.log 2>&1; pack
el baseB; PYTHONPATH=$PWD timeout 100 $B --shape mixtral,gpt-oss-20b,deepseek-v3 --check-tokens 4 --time-budget 85 --out $R/base_big.json > $R/base_big.log 2>&1; pack
el lora; PYTHONPATH=$PWD timeout 65 python3 -m moelab.bench --quick --lora --shape qwen3-30b-a3b --tokens 1,32,1024,16384 --peers none --lora-variants "1x all,8x mixed,32x mixed" --time-budget 52 --out $R/lora.json > $R/lora.log 2>&1; pack
el tune; PYTHONPATH=$PWD/.dev_perf timeout 55 python3 .dev_perf/scripts/tune_moe.py --shape mixtral --tokens 1024,4096 --group-m 1,8,16 --budget-s 20 > $R/tune_mixtral.log 2>&1; pack
el probe; PYTHONPATH=$PWD/.dev_perf timeout 50 python3 .dev_perf/scripts/tune_moe.py --shape qwen3-30b-a3b --shape olmoe --tokens 4096,16384 --group-m 1,8,16 --max-configs 3 > $R/probe_group.log 2>&1; pack
el done
grep -h "T=.*best\|failed\|Error" $R/tune_mixtral.log $R/probe_group.log | head -20
tail -3 $R/base_qwen_olmoe.log $R/base_big.log $R/lora.log
