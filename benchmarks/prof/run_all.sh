set -x
V="standard,coupled_euler,coupled_euler:n_steps=7,coupled_leapfrog"
for w in old mid new; do
  VV=$V; [ $w != old ] && VV="$V,coupled_euler:dynamics_backward=autodiff"
  (cd /work/wt-prof-$w && PYTHONPATH=/work/wt-prof-$w JAX_PLATFORMS=cpu nice -n 10 /work/main/.venv/bin/python /work/wt-prof-new/benchmarks/prof_hlo.py --root /work/wt-prof-$w --label $w --out /work/prof_out --variants $VV)
done
