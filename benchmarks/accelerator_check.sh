#!/usr/bin/env bash
# One-command accelerator check for a GPU machine (see benchmarks/accelerator_check.py for what each part measures).
#
#     bash benchmarks/accelerator_check.sh [WHEELS_DIR]        # from the repository root; about 9 minutes at most
#
# The image is expected to have jax (with CUDA), flax, optax, orbax and chex. grain, ml-collections and tensorboardX
# come from WHEELS_DIR (default ./wheels), filled beforehand on a machine with network access:
#     pip download --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
#         -d wheels grain ml-collections tensorboardX        # (and --python-version 3.12; drop the numpy wheels)
# Writes benchmarks/results/gpu_<date>.md (and .json). Each part runs in its own process (so that the peak-memory
# figure is that part's), with its own time limit; a part that fails is reported as failed and the rest still run.
set -u
cd "$(dirname "$0")/.."
WHEELS="${1:-wheels}"
PY="${PYTHON:-python}"
STAMP="$(date -u +%Y%m%d_%H%M)"
OUT="benchmarks/results/gpu_${STAMP}"
PARTS="$(mktemp -d)"
START=$(date +%s)

if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" grain ml-collections tensorboardX \
    || echo "warning: installing the carried wheels from $WHEELS failed" >&2
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"

run() {  # run NAME SECONDS ARGS...: one part in its own process, its JSON into $PARTS/NAME.json
  local name=$1 limit=$2; shift 2
  local left=$(( 530 - ($(date +%s) - START) ))  # keep the whole check under 9 minutes
  if [ "$left" -lt 20 ]; then echo "{\"part\": \"$name\", \"status\": \"skipped: out of time\"}" > "$PARTS/$name.json"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$PY" benchmarks/accelerator_check.py "$@" --json "$PARTS/$name.json" \
    || [ -s "$PARTS/$name.json" ] || echo "{\"part\": \"$name\", \"status\": \"failed or timed out (${limit}s)\"}" > "$PARTS/$name.json"
}

run grads 75 grads
run attention 45 attention
run pallas 60 pallas
for scale in 60m 150m; do
  for variant in standard coupled_euler coupled_leapfrog; do
    run "step_${scale}_${variant}" 55 step --scale "$scale" --variant "$variant"
  done
done
"$PY" benchmarks/accelerator_check.py report --parts "$PARTS" --out "$OUT"
echo "wrote $OUT.md"
