"""A/B table at HEAD (a scratch tree with env-switched reverts, run_ab.sh) + a two-term cost model prediction.
Usage: python benchmarks/prof/ab_table.py [DIR]  (DIR: the prof_hlo.py JSON, default benchmarks/results/prof).
Model: t = FLOPs / P + bytes / W, P = 170 GFLOP/s (bench_attention's measured 2048^3 matmul roofline on this
machine, 153-181), W fitted so that HEAD standard = 281 ms (the tiny-peer tcmalloc/tuned-malloc measurement)."""
import json
import os
import sys

RESULTS = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "prof")
P = 170e9
def load(lab):
    return {r["variant"]: r for r in json.load(open(os.path.join(RESULTS, f"{lab}.json")))}
new, old = load("new"), load("old")
std = new["standard"]
W = std["bytes_accessed"] / (0.281 - std["flops"] / P)
def t(r): return r["flops"] / P + r["bytes_accessed"] / W
rows = [("1254204 (old)", "old", "coupled_euler"),
        ("HEAD", "new", "coupled_euler"),
        ("HEAD bwd=autodiff", "new", "coupled_euler:dynamics_backward=autodiff"),
        ("HEAD no block remat (L2)", "ab_noremat", "coupled_euler"),
        ("HEAD no block remat, autodiff", "ab_noremat", "coupled_euler:dynamics_backward=autodiff"),
        ("HEAD heads-major f (L1)", "ab_hm", "coupled_euler"),
        ("HEAD heads-major f, autodiff", "ab_hm", "coupled_euler:dynamics_backward=autodiff"),
        ("HEAD L1+L2", "ab_noremat_hm", "coupled_euler"),
        ("HEAD L1+L2+autodiff (L3)", "ab_noremat_hm", "coupled_euler:dynamics_backward=autodiff"),
        ("HEAD attention_impl=explicit", "ab_base", "coupled_euler:attention_impl=explicit")]
std_of = {"old": "standard", "new": "standard", "ab_noremat": "standard", "ab_hm": "standard",
          "ab_noremat_hm": "standard", "ab_base": "standard:attention_impl=explicit"}
print(f"W fitted = {W / 1e9:.1f} GB/s\n")
print("| configuration | GFLOP | GB accessed | M transc. | temp MB | fusions | instr. | dots | FLOP ratio | bytes ratio | model ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name, lab, v in rows:
    d = load(lab); r, s = d[v], d[std_of[lab]]
    print(f"| {name} | {r['flops']/1e9:.3f} | {r['bytes_accessed']/1e9:.3f} | {r['transcendentals']/1e6:.2f} | "
          f"{r['temp_bytes']/1e6:.1f} | {r['fusion_calls']} | {r['instructions']} | {r['dots']} | "
          f"{r['flops']/s['flops']:.3f} | {r['bytes_accessed']/s['bytes_accessed']:.3f} | {t(r)/t(s):.3f} |")
print()
print("standard rows: " + "; ".join(f"{lab}: {d[std_of[lab]]['flops']/1e9:.3f} GFLOP, {d[std_of[lab]]['bytes_accessed']/1e9:.3f} GB, model {1e3*t(d[std_of[lab]]):.0f} ms"
      for lab, d in ((l, load(l)) for l in ["old", "new", "ab_noremat", "ab_base"])))
