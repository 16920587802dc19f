#!/usr/bin/env bash
# "Nothing slower elsewhere": the same bench_attention.py command on two source trees, in
# alternating processes (old, new, old, new, ...), each with what its user gets by default (the new tree's
# entry-point allocator settings apply by themselves; the old tree had none). Run it on an idle machine.
#
#   bash benchmarks/old_vs_new.sh OLD_TREE NEW_TREE TAG [RUNS] -- BENCH_ARGS...
#
# OLD_TREE / NEW_TREE: checkouts (e.g. `git worktree add --detach ../old COMMIT`); both run with this
# interpreter ($PYTHON, default python) and PYTHONPATH set to the tree, so the packages are the same on both sides.
# Writes benchmarks/results/TAG_{old,new}_run{1..RUNS}.json (+ .md) into NEW_TREE, and the load before each process.
set -euo pipefail
OLD=$(cd "${1:?OLD_TREE}" && pwd); NEW=$(cd "${2:?NEW_TREE}" && pwd); TAG=${3:?TAG}; shift 3
RUNS=2
if [[ ${1:-} != "--" ]]; then RUNS=$1; shift; fi
[[ ${1:-} == "--" ]] || { echo "error: expected -- BENCH_ARGS after TAG [RUNS]" >&2; exit 2; }
shift
PY=${PYTHON:-python}
OUT="$NEW/benchmarks/results"
for run in $(seq 1 "$RUNS"); do
  for side in old new; do
    tree=$OLD; [[ $side == new ]] && tree=$NEW
    echo "$(date -u +%H:%M:%S) $side run $run, load $(cut -d' ' -f1-3 /proc/loadavg), tree $(git -C "$tree" rev-parse --short HEAD)"
    (cd "$tree" && PYTHONPATH="$tree" "$PY" benchmarks/bench_attention.py "$@" --out "$OUT/${TAG}_${side}_run$run.json")
  done
done
