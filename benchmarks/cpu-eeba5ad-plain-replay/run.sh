# /tmp/old: `git archive bbe7447 moelab scripts`; /tmp/new: `git archive eeba5ad moelab scripts` (its scripts/ times both trees)
cd /tmp/new
for i in 1 2 3; do
 for tree in old new; do
  P=/tmp/$tree
  PYTHONPATH=$P /work/main/.venv/bin/python scripts/host_cost.py --shape qwen3-30b-a3b,olmoe --tokens 1,32 --stub-replays --rounds 9 --calls 300 2>&1 | grep "T=" | sed "s/^/$tree base /"
  PYTHONPATH=$P /work/main/.venv/bin/python scripts/host_cost.py --shape qwen3-30b-a3b,olmoe --tokens 1,8 --lora 16 --stub-replays --rounds 9 --calls 300 2>&1 | grep "T=" | sed "s/^/$tree lora /"
 done
done
