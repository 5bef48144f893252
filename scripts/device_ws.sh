#!/usr/bin/env bash
# Warp specialisation over the TMA loads, and the LoRA cells at the TMA points, on one H200 (one call < 9 min):
#   1. scripts/tma_ab.py --ws ws-gemm2: GEMM2's K loop warp-specialised, against the rule and the pointer loads  <= WS_S
#   2. scripts/tma_ab.py --ws ws-both: both GEMMs', in its own process (a compiler abort ends the process)        <= WS_S
#   3. the LoRA bench at the points where the rule takes TMA (Mixtral, GPT-OSS-20B, DeepSeek-V3)                  <= LORA_S
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_ws.sh", timeout_s=590).
# Files: env.txt, ws_gemm2.{md,json,err}, ws_both.{md,json,err}, lora.{md,json,err}. SHAPES, TOKENS narrow 1-2.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_ws}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

for ws in ws-gemm2 ws-both; do
  el "$ws a/b"
  f="$OUT/${ws/-/_}"
  timeout -s INT "${WS_S:-140}" python3 scripts/tma_ab.py --ws "$ws" --shape "${SHAPES:-mixtral;deepseek-v3;gpt-oss-20b}" \
    --tokens "${TOKENS:-4096,16384}" --json "$f.json" > "$f.md" 2> "$f.err"
  echo "rc=$?"; tail -3 "$f.err"; cat "$f.md"
done
el "lora bench"
timeout -s INT "${LORA_S:-230}" python3 -m moelab.bench --quick --lora --check-tokens 4 --peers none \
  --shape "${LORA_SHAPES:-mixtral;gpt-oss-20b;deepseek-v3}" --tokens "${LORA_TOKENS:-1024,4096}" \
  --lora-variants "1x all,8x mixed,32x mixed" --graph-max-t 4096 --time-budget "$(( ${LORA_S:-230} - 15 ))" \
  --out "$OUT/lora.json" > "$OUT/lora.md" 2> "$OUT/lora.err"
echo "rc=$?"; tail -3 "$OUT/lora.err"; grep -a -A40 "median µs" "$OUT/lora.md" | head -80
el done
