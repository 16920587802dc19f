"""Markdown tables (per commit: metric per variant and ratio to standard) from prof_hlo.py's JSON files."""
import json, os, re, sys, collections
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hlo_ops import parse

def extra(rec, directory):
    t = open(os.path.join(directory, os.path.basename(rec["hlo_file"]))).read()  # the HLO text beside the JSON
    top, dots = parse(t)
    cpl = [r for r in top if "while" in r["op_name"] or "_recompute" in r["op_name"]]
    allcpl = len(re.findall(r'op_name="[^"]*while[^"]*"', t))
    return dict(top_ops=len(top), coupling_top_ops=len(cpl), coupling_all_ops=allcpl,
                coupling_bytes=sum(r["out_bytes"] + r["in_bytes"] for r in cpl),
                copies=rec["copies_top"] + rec["copies_in_fusions"],
                transposes=rec["transposes_top"] + rec["transposes_in_fusions"],
                dot_flops=sum(d["flops"] for d in dots), reduce_precision=t.count("reduce-precision("),
                ckpt_ops=t.count("/checkpoint/"))

METRICS = [("flops", 1e9, "GFLOP"), ("bytes_accessed", 1e9, "GB accessed"), ("transcendentals", 1e6, "M transc."),
           ("temp_bytes", 1e6, "temp MB"), ("fusion_calls", 1, "fusions"), ("instructions", 1, "instructions"),
           ("top_ops", 1, "top-level ops"), ("dots", 1, "dots"), ("whiles", 1, "while"), ("custom_calls", 1, "custom calls"),
           ("copies", 1, "copies"), ("transposes", 1, "transposes"), ("reduce_precision", 1, "reduce-precision"),
           ("coupling_all_ops", 1, "coupling ops (all)"), ("coupling_top_ops", 1, "coupling top ops"),
           ("coupling_bytes", 1e6, "coupling MB accessed")]

def table(path, label):
    recs = json.load(open(path))
    for r in recs:
        r.update(extra(r, os.path.dirname(path)))
    std = recs[0]
    names = [r["variant"].replace("coupled_", "c_").replace("dynamics_backward=", "bwd=") for r in recs]
    out = [f"| {label} | " + " | ".join(names) + " | " + " | ".join(f"{n}/std" for n in names[1:]) + " |",
           "|---" * (2 * len(recs)) + "|"]
    for key, div, title in METRICS:
        vals = [r[key] for r in recs]
        fmt = (lambda v: f"{v / div:.3f}") if div != 1 else (lambda v: f"{v}")
        rat = [(f"{v / std[key]:.3f}" if std[key] else "-") for v in vals[1:]]
        out.append(f"| {title} | " + " | ".join(fmt(v) for v in vals) + " | " + " | ".join(rat) + " |")
    return "\n".join(out), recs

if __name__ == "__main__":
    for path, label in zip(sys.argv[1::2], sys.argv[2::2]):
        print(table(path, label)[0]); print()
