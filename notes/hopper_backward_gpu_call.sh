# Chapter 08's device call: each part in its own process, each capped by what is left of the deadline.
# Run from .gpu/hbwd with PYTHONPATH set; logs and records go to $OUT.
S=$(date +%s); DEADLINE=$(( S + ${BUDGET_S:-515} )); C=notes/hopper_backward_gpu_call.py; L=$OUT/call.log
step() {  # step CAP command...: run with timeout min(CAP, time left - 25 s kept for packing)
  local cap=$1; shift; local left=$(( DEADLINE - 25 - $(date +%s) ))
  if [ $left -lt 15 ]; then echo "SKIPPED (no time): $*" | tee -a $L; return; fi
  echo "== [$(( $(date +%s) - S )) s] $*" | tee -a $L
  timeout $(( cap < left ? cap : left )) "$@" 2>&1 | grep -v "^\s*$" | tee -a $L
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee $L
step 220 python3 $C ablation
step 150 python3 $C precompile
step 60 python3 $C features
step 150 python3 $C final
step 60 python3 $C deterministic
step 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k hopper
step 150 python3 -m course_utils.tooling.run_notebooks --no-sync 08
tar czf $OUT/results.tgz figures notebooks/08_hopper_backward.ipynb course_utils/api/attention.py 2>&1 | tail -2
echo "== [$(( $(date +%s) - S )) s] packed" | tee -a $L
