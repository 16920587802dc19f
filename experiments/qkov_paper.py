"""Every synthetic study of the QK/OV paper at the paper's budgets, in one resumable queue.

Order (each step skips what is already finished, so rerunning this command resumes the queue):

1. the first seed of every constant-rate Figure-2 cell (row 1, FAFO x20 and CACO x5 with their equal-rate
   baselines);
2. the fixed-attention study (Figure 3, both OV types);
3. the first seed of the learning-rate ramps;
4. the remaining seeds of those cells (and two more seeds of row 1's FAFO and FACO, for the row-1 comparisons);
5. the CACO seq_len-128 rates the notebook lists as tried but does not plot (x2, x3, x4, x10), all seeds.

After every job that ran (and once at the end) the tables are rewritten by experiments/qkov_report.py, run as a
subprocess so that a report error is printed without stopping the queue. Meant to run in the background on a shared
machine:

    nohup nice -n 19 python experiments/qkov_paper.py > runs/qkov/queue.log 2>&1 &
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qkov_fixed_attention as fixed  # noqa: E402
import qkov_synthetic as synth  # noqa: E402

CONSTANT = ["fafo_r20", "fafo_eye_r1", "fafo_r1", "faco_r1", "caco128_r5", "caco128_r1", "caco_r1", "cafo_r1"]
RAMPS = ["fafo_incr40", "caco128_incr10"]
REST = ["fafo_r20", "fafo_eye_r1", "caco128_r5", "caco128_r1", "caco_r1", "fafo_incr40", "caco128_incr10",
        "cafo_r1", "fafo_r1", "faco_r1"]
EXTRA = ["caco128_r2", "caco128_r3", "caco128_r4", "caco128_r10"]  # the notebook's other tried rates, not plotted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/qkov")
    ap.add_argument("--work", default="runs/qkov")
    ap.add_argument("--eval-batches", type=int, default=200, help="Figure-3 evaluation batches of 4x32 (fixed set)")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))

    def log(m):
        print(f"{time.strftime('%H:%M:%S')} {m}", flush=True)

    def report():
        r = subprocess.run([sys.executable, os.path.join(here, "qkov_report.py"), "--out", args.out])
        if r.returncode:
            log(f"qkov_report.py exited {r.returncode}; the queue goes on")

    t0 = time.time()
    # The tables are rewritten after each job that ran (a resumed queue skips its finished jobs without a report).
    for cell in CONSTANT:
        if synth.run_cells([cell], "first", args.out, args.work, log=log):
            report()
    for ov in fixed.OV_TYPES:
        if fixed.run_job(ov, args.out, args.work, args.eval_batches, log=log):
            report()
    for cell in RAMPS:
        if synth.run_cells([cell], "first", args.out, args.work, log=log):
            report()
    for cell in REST:
        if synth.run_cells([cell], "rest", args.out, args.work, log=log):
            report()
    for which in ("first", "rest"):
        for cell in EXTRA:
            if synth.run_cells([cell], which, args.out, args.work, log=log):
                report()
    report()
    log(f"queue finished in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    raise SystemExit(main())
