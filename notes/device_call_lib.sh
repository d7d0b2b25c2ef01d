# Shared helpers of the course's device-call scripts (sourced; from the eleventh session on).
#   stamp MSG                 time since the call began
#   pack                      everything under /tmp/n into $OUT/call.tgz (what comes back)
#   record NAME LIMIT         re-measure one GPU record (python -m course_utils.measure.benchmarks NAME)
#   notebook CHAPTER LIMIT    execute one chapter in place on the GPU
#   ab SCRIPT OUT PARTS LIMIT run one A/B script's parts
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/n; pack() { tar czf $OUT/call.tgz -C /tmp/n .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/n/gpu.txt
record() {
  stamp "$1 (limit $2 s)"
  timeout $2 python -m course_utils.measure.benchmarks $1 > /tmp/n/$1.log 2>&1; echo "exit $?" >> /tmp/n/$1.log
  grep -v Warning /tmp/n/$1.log | grep -v "^\s*return\|^\s*$" | tail -n ${TAIL:-6}
  cp figures/$1.json /tmp/n/ 2>/dev/null; pack
}
notebook() {
  stamp "chapter $1 in place (limit $2 s)"
  timeout $2 python -m course_utils.tooling.run_notebooks $1 --in-place --jobs 1 > /tmp/n/nb_$1.log 2>&1; echo "exit $?" >> /tmp/n/nb_$1.log
  tail -n 5 /tmp/n/nb_$1.log; cp notebooks/$1_*.ipynb /tmp/n/ 2>/dev/null; cp figures/ch$1_*.png figures/ch$1_*.svg /tmp/n/ 2>/dev/null; pack
}
ab() {
  stamp "A/B $1 parts $3 (limit $4 s)"
  timeout $4 python $1 /tmp/n/$2.json $3 2>&1 | grep -v Warning | tee /tmp/n/$2.log | tail -n ${TAIL:-20}; pack
}
