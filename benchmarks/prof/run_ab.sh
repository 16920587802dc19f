cd /work/wt-prof-ab
PY="nice -n 10 /work/main/.venv/bin/python /work/wt-prof-new/benchmarks/prof_hlo.py --root /work/wt-prof-ab --out /work/prof_out"
export PYTHONPATH=/work/wt-prof-ab JAX_PLATFORMS=cpu
V="standard,coupled_euler,coupled_euler:dynamics_backward=autodiff"
$PY --label ab_base --variants standard,coupled_euler,standard:attention_impl=explicit,coupled_euler:attention_impl=explicit
PROF_NOREMAT=1 $PY --label ab_noremat --variants $V
PROF_HM=1 $PY --label ab_hm --variants $V
PROF_NOREMAT=1 PROF_HM=1 $PY --label ab_noremat_hm --variants $V,coupled_euler:n_steps=7,coupled_leapfrog
echo done
