#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
P=python
B="benchmarks/bench_attention.py --scales tiny-peer --rounds 8 --variants standard,coupled_euler"
R=benchmarks/results/cpu_window2
echo "w3 $(date +%T)"
MALLOC_ARENA_MAX=1 $P $B --out $R/jax_arena1env.json >> $R/log3 2>&1
$P benchmarks/results/cpu_window2/mallopt_run.py arena,mmap,trim $B --out $R/jax_mallopt_all.json >> $R/log3 2>&1
$P benchmarks/results/cpu_window2/mallopt_run.py arena $B --out $R/jax_mallopt_arena.json >> $R/log3 2>&1
$P $B --out $R/jax_default_3.json >> $R/log3 2>&1
echo "done $(date +%T)"
