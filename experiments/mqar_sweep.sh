#!/usr/bin/env bash
# MQAR to the end of learning, the CPU protocol (configs/mqar.py), resumable; zoology's own
# Figure-2 protocol is experiments/mqar_zoology.sh.
#
#   bash experiments/mqar_sweep.sh lane LEVEL VARIANT[,VARIANT...]  # lr sweep: 1 seed per (variant, lr), 64 epochs
#   bash experiments/mqar_sweep.sh cell LEVEL VARIANT LR [FLAGS]    # one cell of a lane
#   bash experiments/mqar_sweep.sh table LEVEL LR [VARIANTS]        # every variant (or those) at one lr: results/mqar/
#   bash experiments/mqar_sweep.sh seeds LEVEL LR [VARIANTS]        # 3 seeds of every variant (or those) at that lr
#
# FLAGS (cell only) go to experiments/sweep.py as they are, e.g. `--mqar-num-train 20000`; such a cell
# belongs in its own directories, so name them: `OUT=... RUNS=... bash experiments/mqar_sweep.sh cell ...`.
# `seeds` with VARIANTS runs only those (a variant whose best lr differs from the others' gets its own call) and
# writes their table to its own folder, results/mqar/LEVEL_lrLR_s3_VARIANT+VARIANT.
#
# Every cell is an ordinary sweep cell (experiments/sweep.py): rerunning the same command skips finished cells and
# resumes a stopped one from its last checkpoint (one per epoch). `lane` gives every (variant, lr) cell its own sweep
# call, so each finished cell has its table at once (runs/mqar/tables/); lanes with disjoint variants may run in
# parallel (each run directory has a lock: one trainer per cell). The lrs run in the order 3e-3 (the default, where
# standard attention learns the easy level), 1e-2, 1e-3. `table` trains whatever is missing at that lr and writes the
# all-variant table; `seeds` does the same with 3 seeds (its own runs directory). While cells run,
# `python -m experiments.progress runs/mqar/LEVEL_s1` shows every evaluation so far.
set -euo pipefail
MODE=${1:?usage: mqar_sweep.sh lane|table|seeds LEVEL ...}
LEVEL=${2:?level: easy, medium or hard}
PY=${PYTHON:-python}
ALL=standard,coupled_euler,coupled_leapfrog,mlp_only,differential
# The end of learning: 64 epochs at most (zoology's), stopping earlier at a plateau, i.e. 8 evaluations (16 epochs)
# in a row without a gain of more than 0.002 in validation accuracy, or at perfect validation accuracy
# (train.early_stop). Every cell then scores its test split once, at each seed's validation-selected checkpoint
# (experiments/select_test.py); the tables report that test accuracy and choose lrs on validation.
STOP=(--set train.early_stop.metric=valid/accuracy --set train.early_stop.patience=8
      --set train.early_stop.min_delta=0.002 --set train.early_stop.threshold=1.0)
# WIDTH=32 bash experiments/mqar_sweep.sh ...: a narrower model (d_model 32, 2 heads of 16; the coupling hidden width
# follows, 12) in its own directories (TAG = LEVEL_w32); the default is the level's width, 64.
# ROOT=runs/mqar_v bash experiments/mqar_sweep.sh ...: run directories under ROOT (default runs/mqar). Runs made
# before the validation split are refused by the new code, so the split's reruns need a fresh ROOT.
ROOT=${ROOT:-runs/mqar}
DOCS=${DOCS:-results/mqar}  # where table and seeds write; a rerun must not overwrite the old tables
WIDTH=${WIDTH:-64}
TAG=$LEVEL
if [ "$WIDTH" != 64 ]; then
  STOP+=(--set model.d_model="$WIDTH")
  TAG=${LEVEL}_w$WIDTH
fi
sweep() { nice -n 19 "$PY" -m experiments.sweep --recipe g --levels "$LEVEL" --epochs 64 "${STOP[@]}" "$@"; }
case "$MODE" in
  lane)
    for lr in 3e-3 1e-2 1e-3; do
      for v in ${3//,/ }; do
        sweep --variants "$v" --seeds 1 --grid train.lr=$lr --out "$ROOT/tables/${TAG}_${v}_lr$lr" \
          --runs-dir "$ROOT/${TAG}_s1"
      done
    done ;;
  cell)  # one (variant, lr) cell of the lane: bash experiments/mqar_sweep.sh cell LEVEL VARIANT LR [FLAGS]
    v=${3:?variant}; lr=${4:?lr}
    sweep --variants "$v" --seeds 1 --grid train.lr=$lr --out "${OUT:-$ROOT/tables/${TAG}_${v}_lr$lr}" \
      --runs-dir "${RUNS:-$ROOT/${TAG}_s1}" "${@:5}" ;;
  table)
    sweep --variants "${4:-$ALL}" --seeds 1 --grid "train.lr=${3:?lr}" --out "$DOCS/${TAG}_lr$3" \
      --runs-dir "$ROOT/${TAG}_s1" ;;
  seeds)
    sweep --variants "${4:-$ALL}" --seeds 3 --grid "train.lr=${3:?lr}" --out "$DOCS/${TAG}_lr${3}_s3${4:+_${4//,/+}}" \
      --runs-dir "$ROOT/${TAG}_s3" ;;
  *) echo "error: mode must be lane, cell, table or seeds, got '$MODE'" >&2; exit 2 ;;
esac
