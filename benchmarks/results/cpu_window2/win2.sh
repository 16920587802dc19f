#!/bin/bash
# second idle window: allocators (JAX and PyTorch), tiny batch 8
cd "$(git rev-parse --show-toplevel)"
P=python; T=python-with-torch
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4
B="benchmarks/bench_attention.py --scales tiny-peer --rounds 8 --variants standard,coupled_euler"
R=benchmarks/results/cpu_window2; mkdir -p $R
echo "start $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
$P $B --out $R/jax_default_1.json > $R/log 2>&1
LD_PRELOAD=$TC $P $B --out $R/jax_tcmalloc_1.json >> $R/log 2>&1
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 $P $B --out $R/jax_glibcnommap_1.json >> $R/log 2>&1
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_ARENA_MAX=1 $P $B --out $R/jax_glibcnommap1arena_1.json >> $R/log 2>&1
$P $B --out $R/jax_default_2.json >> $R/log 2>&1
echo "torch $(date +%T)"
TV="--shapes tiny-peer,small-peer --variants standard,coupled_euler --rounds 8"
$T benchmarks/bench_torch_peer.py $TV --out $R/torch_default.json >> $R/log 2>&1
LD_PRELOAD=$TC $T benchmarks/bench_torch_peer.py $TV --out $R/torch_tcmalloc.json >> $R/log 2>&1
echo "small-peer $(date +%T)"
S="benchmarks/bench_attention.py --scales small-peer --rounds 6 --variants standard,coupled_euler"
LD_PRELOAD=$TC $P $S --out $R/jax_small_tcmalloc.json >> $R/log 2>&1
$P $S --out $R/jax_small_default.json >> $R/log 2>&1
echo "batch8 $(date +%T)"
$P benchmarks/bench_attention.py --scales tiny --batch 8 --rounds 8 --variants standard,coupled_euler --out $R/jax_tiny_b8.json >> $R/log 2>&1
echo "scan $(date +%T)"
$P benchmarks/bench_attention.py --scales tiny --rounds 8 --variants standard,coupled_euler,standard:scan_layers=True,coupled_euler:scan_layers=True --out $R/jax_tiny_scan.json >> $R/log 2>&1
$P benchmarks/bench_attention.py --scales 60m --batch 1 --rounds 2 --variants standard,standard:scan_layers=False,coupled_euler --out $R/jax_60m_scan.json >> $R/log 2>&1
echo "done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
