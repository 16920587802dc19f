#!/usr/bin/env bash
# MQAR at zoology's ICLR'24 Figure-2 protocol (configs/mqar.py:VARIANT,LEVEL,zoology) on a GPU: the full grid,
# 3 levels x widths 64, 128, 256, 512 x zoology's 4 lrs (np.logspace(-4, -2, 4)) x the five variants = 240 cells.
#
#   bash experiments/mqar_zoology.sh probe           # first: one epoch of each level at width 512 (standard, coupled
#                                                    # Euler), to replace the estimate below by a measurement
#   bash experiments/mqar_zoology.sh grid [LEVELS]   # the grid (LEVELS default easy,medium,hard), resumable
#   bash experiments/mqar_zoology.sh cell LEVEL VARIANT WIDTH LR [SEEDS]   # one cell (decisive cells: 3 seeds)
#
# Protocol (configs/mqar.py): V = 8192, 100,000 training / 3,000 validation (ours) / 3,000 test examples per level,
# batch 512 / 512 / 256, 2 layers attention-only, 1 head (2 for Differential), dropout 0.1, AdamW b2 0.999, weight
# decay 0.1, no clipping, no warm-up, cosine to 0 stepped once an epoch, at most 64 epochs, evaluation every epoch,
# stop once validation accuracy reaches 0.99. Each cell's lr-free numbers are test accuracy at its
# validation-selected checkpoint (experiments/select_test.py); the per-(level, variant, width) lr is chosen on
# validation (experiments.reports.select_lr, the "lr chosen on validation" table of each results.md).
#
# Expected cost (an estimate from FLOP counts, NOT measured: no GPU was available when this was written; run
# `probe` first). A step holds 32,768 tokens (easy), 65,536 (medium, hard); an epoch is 196 / 196 / 391 steps. The
# model is 0.56M parameters at width 64 and 6.3M at 512 (the 8192 x d embedding dominates); at width 512 a step is
# about 6 x 6.3M x 65,536 = 2.5 TFLOP plus attention, i.e. some 10-30 ms on an H100/H200 in float32, and width 64 is
# bound by per-step overhead (a few ms). So a 64-epoch cell costs roughly 1-5 minutes at easy, 2-10 at medium and
# 5-25 at hard, the coupled variants about 2-3x standard's (they did 1.6-1.9x on CPU), and zoology's stop at 0.99
# ends many cells early. The whole grid, one seed per cell: about 10-30 GPU-hours; the CPU of this project's
# workstation does one zoology epoch in the time given in results/RUNNING.md, which is why it runs here only
# on a GPU. Disk: every evaluated checkpoint is kept until the test split is scored, then pruned
# (--prune-checkpoints); a width-512 checkpoint is about 76 MB per seed.
set -euo pipefail
MODE=${1:?usage: mqar_zoology.sh probe|grid|cell ...}
PY=${PYTHON:-python}
ALL=standard,coupled_euler,coupled_leapfrog,mlp_only,differential
LRS=1e-4,4.6415888336127773e-4,2.154434690031882e-3,1e-2  # np.logspace(-4, -2, 4), zoology's grid
WIDTHS=64,128,256,512
OUTDIR=${OUTDIR:-runs/mqar_zoology}
# One GPU: no data-parallel split is needed (mesh.data=-1 takes every device anyway).
sweep() { "$PY" -m experiments.sweep --recipe g --protocol zoology --epochs 64 --prune-checkpoints "$@"; }
case "$MODE" in
  probe)  # one epoch per level at width 512: the measured per-epoch cost (tokens/s in each summary.json)
    for lvl in easy medium hard; do
      sweep --levels "$lvl" --variants standard,coupled_euler --seeds 1 --epochs 1 \
        --set model.d_model=512 --set train.early_stop.metric="" --out "$OUTDIR/probe_$lvl" \
        --runs-dir "$OUTDIR/probe_runs"
    done ;;
  grid)   # every level x width x lr x variant, one seed; one sweep call (and one table) per (level, width)
    for lvl in ${2:-easy,medium,hard}; do
      for lvl1 in ${lvl//,/ }; do
        for w in ${WIDTHS//,/ }; do
          sweep --levels "$lvl1" --variants "$ALL" --seeds 1 --grid "train.lr=$LRS" --set model.d_model="$w" \
            --out "$OUTDIR/tables/${lvl1}_w$w" --runs-dir "$OUTDIR/${lvl1}_w${w}_s1"
        done
      done
    done ;;
  cell)   # bash experiments/mqar_zoology.sh cell medium coupled_euler 64 2.154434690031882e-3 3
    lvl=${2:?level}; v=${3:?variant}; w=${4:?width}; lr=${5:?lr}; seeds=${6:-3}
    sweep --levels "$lvl" --variants "$v" --seeds "$seeds" --grid "train.lr=$lr" --set model.d_model="$w" \
      --out "$OUTDIR/tables/${lvl}_w${w}_${v}_lr${lr}_s$seeds" --runs-dir "$OUTDIR/${lvl}_w${w}_s$seeds" ;;
  *) echo "error: mode must be probe, grid or cell, got '$MODE'" >&2; exit 2 ;;
esac
