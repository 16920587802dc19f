# The A/B reverts: ROOT is a scratch checkout with the PROF_NOREMAT / PROF_HM switches patched in (that scratch
# patch was deleted from the tree; git history has it as benchmarks/prof/ab_scratch.patch), PY a python with the
# project's requirements, OUT where the JSON goes. Usage: ROOT=... PY=... OUT=... bash benchmarks/prof/run_ab.sh
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
RUN="nice -n 10 $PY $HERE/prof_hlo.py --root $ROOT --out $OUT"
cd "$ROOT"
export PYTHONPATH=$ROOT JAX_PLATFORMS=cpu
V="standard,coupled_euler,coupled_euler:dynamics_backward=autodiff"
$RUN --label ab_base --variants standard,coupled_euler,standard:attention_impl=explicit,coupled_euler:attention_impl=explicit
PROF_NOREMAT=1 $RUN --label ab_noremat --variants $V
PROF_HM=1 $RUN --label ab_hm --variants $V
PROF_NOREMAT=1 PROF_HM=1 $RUN --label ab_noremat_hm --variants $V,coupled_euler:n_steps=7,coupled_leapfrog
