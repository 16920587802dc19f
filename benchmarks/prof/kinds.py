"""Bytes accessed by top-level instruction kind (fusion name prefix, e.g. copy_slice_fusion) for a list of HLO files."""
import sys, re, collections
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hlo_ops import parse
def kinds(path):
    top, _ = parse(open(path).read())
    c = collections.defaultdict(lambda: [0, 0])
    for r in top:
        k = re.sub(r"\.\d+$", "", r["name"]) if r["op"] == "fusion" else r["op"]
        c[k][0] += 1; c[k][1] += r["out_bytes"] + r["in_bytes"]
    return c
if __name__ == "__main__":
    files = sys.argv[1:]
    ks = [kinds(f) for f in files]
    names = sorted(set().union(*ks), key=lambda k: -max(abs(x[k][1] - ks[0][k][1]) for x in ks))
    print("| kind | " + " | ".join(f.split("/")[-1].replace(".hlo.txt", "") for f in files) + " |")
    print("|---" * (len(files) + 1) + "|")
    for k in names[:25]:
        print(f"| {k} | " + " | ".join(f"{x[k][0]} / {x[k][1]/1e6:.1f}" for x in ks) + " |")
