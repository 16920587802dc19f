#!/usr/bin/env bash
# Time the L1+L2 levers (heads-major coupling, no block checkpoint at remat=none without fsdp) against the
# previous main in alternating processes (old, new, old, new), each side with its own checkout and python, and the
# PyTorch peer between them. Idle machine only; every JSON records its load.
#
#   OLD=checkout-of-previous-main OLD_PY=its-python NEW=this-checkout NEW_PY=its-python TORCH_PY=python-with-torch \
#   TAG=label OUT=benchmarks/results bash benchmarks/prof/run_levers.sh
set -euo pipefail
: "${OLD:?}" "${OLD_PY:?}" "${NEW:?}" "${NEW_PY:?}" "${TAG:?}"
OUT=${OUT:-benchmarks/results}  # relative to each checkout: the JSON records its command, so no machine path in it
VARIANTS=standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7,mlp_only
for run in 1 2; do
  for side in old new; do
    if [ $side = old ]; then root=$OLD py=$OLD_PY; else root=$NEW py=$NEW_PY; fi
    name=cpu_levers_${TAG}_${side}_run$run
    (cd "$root" && "$py" benchmarks/bench_attention.py --scales tiny-peer,small-peer --rounds 6 --variants $VARIANTS \
      --out "$OUT/$name.json")
    if [ "$root" != "$NEW" ]; then mv "$root/$OUT/$name".json "$root/$OUT/$name".md "$NEW/$OUT/"; fi
  done
  if [ -n "${TORCH_PY:-}" ]; then
    (cd "$NEW" && "$TORCH_PY" benchmarks/bench_torch_peer.py --shapes tiny-peer,small-peer --rounds 6 \
      --variants standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7 \
      --out "$OUT/cpu_levers_${TAG}_torch_run$run.json")
  fi
done
