#!/usr/bin/env bash
# The next H200 call for issue 12's scorecard (each step has its own timeout), on HEAD's tile table:
#   1. the bench at the points whose tiles changed since the runs the scorecard quotes (13-16 and 65-128 rows an
#      expert; Mixtral above 128 rows), graph replays to T = 1024, with torch grouped_mm beside it      <= 200 s
#   2. DeepSeek-V3's layer at T = 16384 (512 rows an expert, 88 MB experts) with group_m 1 and 8: the experts
#      between 50 and 352 MB that GROUP_M_MIN_EXPERT_BYTES was set without                                <= 120 s
#   3. Mixtral's LoRA at T = 16384, the point command #6 ran out of budget for                           <= 200 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_score3.sh", timeout_s=580).
# Files: env.txt, changed.{md,json,err}, deepseek_group.log, lora_mixtral16k.{md,json,err}.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_score3}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "changed tiles"
timeout -s INT 200 python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm \
  --shape "olmoe;gpt-oss-20b;mixtral;64,6,2048,1408" --tokens 128,1024,4096 --time-budget 170 \
  --out "$OUT/changed.json" > "$OUT/changed.md" 2> "$OUT/changed.err"
echo "rc=$?"; tail -2 "$OUT/changed.err"; grep -a -m4 -A8 "median µs" "$OUT/changed.md" | head -40

el "deepseek group_m"
cp moelab/kernels/moe_gemm_configs.json "$OUT/configs_before.json"  # tune_moe rewrites the table: put it back after
timeout -s INT 120 python3 scripts/tune_moe.py --shape deepseek-v3 --tokens 16384 --group-m 1,8 --max-configs 4 \
  --budget-s 90 > "$OUT/deepseek_group.log" 2>&1
echo "rc=$?"; grep -E "^ +T=|^T=" "$OUT/deepseek_group.log"
cp "$OUT/configs_before.json" moelab/kernels/moe_gemm_configs.json

el "mixtral lora 16384"
timeout -s INT 200 python3 -m moelab.bench --quick --lora --check-tokens 4 --peers none --shape mixtral \
  --tokens 16384 --lora-variants "1x all,8x mixed,32x mixed" --graph-max-t 16384 --time-budget 180 \
  --out "$OUT/lora_mixtral16k.json" > "$OUT/lora_mixtral16k.md" 2> "$OUT/lora_mixtral16k.err"
echo "rc=$?"; tail -2 "$OUT/lora_mixtral16k.err"; grep -a -m1 -A8 "time / moelab triton" "$OUT/lora_mixtral16k.md"
el done
