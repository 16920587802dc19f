"""Per-instruction table of an optimised HLO text (XLA:CPU, jax 0.10): top-level (non-fused) instructions with
opcode, bytes (output + operands, operand shapes looked up by name), op_name; dot FLOPs everywhere."""
import collections, re
SHAPE_RE = re.compile(r"(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64|u64)\[([0-9,]*)\]")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8, "u64": 8}
INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def nbytes(text):
    t = 0
    for dt, dims in SHAPE_RE.findall(text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        t += n * BYTES[dt]
    return t


def dims(text):
    m = SHAPE_RE.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def computations(text):
    comps, cur = {}, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            cur = name.lstrip("%")
            comps[cur] = []
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur:
            comps[cur].append(line)
    return comps


def parse(text):
    """-> (rows of top-level instructions, dot rows) ; row = dict."""
    comps = computations(text)
    fused = set(re.findall(r"calls=%?([\w.\-]+)", text))
    top, dots = [], []
    for cname, lines in comps.items():
        shapes = {}
        parsed = []
        for line in lines:
            m = INSTR_RE.match(line)
            if not m:
                continue
            iname, out, op, rest = m.groups()
            shapes[iname] = out
            parsed.append((iname, out, op, rest, line))
        for iname, out, op, rest, line in parsed:
            mo = re.search(r'op_name="([^"]*)"', line)
            opn = mo.group(1) if mo else ""
            argtext = rest.split(")")[0]
            operands = re.findall(r"%([\w.\-]+)", argtext)
            if op == "dot":
                lhs = dims(shapes.get(operands[0], "")) if operands else []
                mc = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                c = 1
                for d in (mc.group(1).split(",") if mc else []):
                    if d and lhs:
                        c *= lhs[int(d)]
                n = 1
                for d in dims(out):
                    n *= d
                dots.append(dict(comp=cname, name=iname, flops=2 * n * c, op_name=opn, out=out.strip(),
                                 fused=cname in fused))
            if cname in fused or op in SKIP:
                continue
            ob = nbytes(out)
            ib = sum(nbytes(shapes.get(o, "")) for o in operands)
            top.append(dict(comp=cname, name=iname, op=op, out_bytes=ob, in_bytes=ib, op_name=opn, out=out.strip()))
    return top, dots


def category(opn, depth=None):
    o = opn.replace("jit(train_step)/", "")
    o = re.sub(r"\[\\'blocks\\'\]\[\d+\]", "[blocks][i]", o)
    if depth:
        o = "/".join(o.split("/")[:depth])
    return o
