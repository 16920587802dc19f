# The three commits' programs: OLD, MID and NEW are checkouts of 1254204, 4544e54 and HEAD, PY one python (one
# jax for all three), OUT where the JSON goes. Usage: OLD=... MID=... NEW=... PY=... OUT=... bash benchmarks/prof/run_all.sh
set -eux
HERE=$(cd "$(dirname "$0")" && pwd)
V="standard,coupled_euler,coupled_euler:n_steps=7,coupled_leapfrog"
for w in old mid new; do
  root=$(eval echo "\$${w^^}")
  VV=$V; [ $w != old ] && VV="$V,coupled_euler:dynamics_backward=autodiff"
  (cd "$root" && PYTHONPATH=$root JAX_PLATFORMS=cpu nice -n 10 $PY "$HERE/prof_hlo.py" --root "$root" --label $w \
     --out "$OUT" --variants $VV)
done
