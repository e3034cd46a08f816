"""Reruns docs/performance.md's CPU table: `python bench.py --model tiny --vs hf` (our hot paths and each script's
optimizer step against transformers / TRL on the same work and weights), printed as the page's table.

    python experiments/bench_cpu.py            # the documented command (~6 min on 2 cores; needs transformers, trl)
    python experiments/bench_cpu.py --quick    # tiny sizes, sampling and training only: does it still run?

bench.py writes no run folder: its JSON lines are kept in --out/bench.jsonl, and a finished file is not rerun.
"""

import json
import os
import subprocess
import sys

from common import ROOT, parse_args, print_table

args = parse_args("bench_cpu", __doc__, seeds=(1337,))
flags = ["--model", "tiny", "--device", "cpu", "--vs", "hf"]
if args.quick:
    flags = ["--model", "tiny", "--device", "cpu", "--only", "sample_kv,sample_nocache,train", "--batch_size", "4"]
    flags += ["--new_tokens", "8", "--train_batch", "2", "--train_seq", "32", "--warmup", "0", "--repeats", "1"]
path = os.path.join(args.out, "bench.jsonl")
if not os.path.exists(path):
    cmd = [sys.executable, str(ROOT / "bench.py"), *flags, "--seed", str(args.seeds[0])]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench.py failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        f.write(proc.stdout)
lines = [json.loads(line) for line in open(path) if line.startswith("{")]
ours = {r["bench"]: r for r in lines if r["impl"] == "ours"}
hf = {r["bench"]: r for r in lines if r["impl"] == "hf"}
rows = []
for name, r in ours.items():
    theirs = hf.get(name)
    other = f"{theirs['value']:,.0f} {theirs['unit']}" if theirs else ""
    speedup = f"{theirs['speedup']:.2f}x" if theirs else ""
    rows.append([f"`{name}`", f"{r['value']:,.0f} {r['unit']}", other, speedup])
print_table(["measurement", "ours", "transformers / TRL", "ours is (x faster)"], rows)
