"""What the experiment scripts share: run a project script into a run folder, read what it wrote, and print a
markdown table of means +- standard errors over seeds.

Every experiment script takes the same flags: --quick (a few steps and one seed: checks that the experiment still
runs, not its numbers), --out DIR (where its runs go; a run whose folder already holds final_results.json is not run
again, so an interrupted experiment continues where it stopped) and --seeds (which seeds to run).
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(name, description, seeds=(1, 2, 3), extra=None):
    """The flags every experiment takes; --out defaults to out/experiments/NAME. extra: {"--flag": (default, help)},
    string flags of this experiment alone."""
    parser = argparse.ArgumentParser(description=description)
    for flag, (default, help_text) in (extra or {}).items():
        parser.add_argument(flag, default=default, help=help_text)
    parser.add_argument("--quick", action="store_true", help="a few steps and one seed: does it still run?")
    parser.add_argument("--out", default=f"out/experiments/{name}", help="folder of this experiment's runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds), help="seeds to run")
    args = parser.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
    return args


def run(script, flags, out_dir):
    """python SCRIPT FLAGS --out_dir OUT_DIR from the repository root, unless OUT_DIR already holds a finished run.
    Returns OUT_DIR. A failed run stops the experiment with the run's last lines."""
    out_dir = str(out_dir)
    if os.path.exists(os.path.join(out_dir, "final_results.json")):
        return out_dir
    cmd = [sys.executable, str(ROOT / script), *map(str, flags), "--out_dir", out_dir]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        sys.exit(f"{script} failed (exit {proc.returncode}):\n{tail}")
    print(f"  done in {time.time() - start:.0f} s", flush=True)
    return out_dir


def final_results(out_dir):
    with open(os.path.join(out_dir, "final_results.json")) as f:
        return json.load(f)


def metrics(out_dir):
    """The rows of a run's metrics.jsonl, each a dict with its "step"."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last(out_dir, name):
    """The last logged value of a metric (None if the run never logged it)."""
    values = [row[name] for row in metrics(out_dir) if name in row]
    return values[-1] if values else None


def mean_se(values):
    """Mean and standard error of the mean (0 for a single value)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def fmt(values, digits=3):
    """ "0.635 +- 0.009" over seeds (just the value for one seed)."""
    mean, se = mean_se(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} +- {se:.{digits}f}"


def print_table(header, rows):
    """A markdown table, as the docs pages show it."""
    print()
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print(flush=True)


def tiny_hh(path, n=200):
    """A tiny HH-RLHF-shaped .jsonl for --quick runs (no download): a polite chosen answer and a rude rejected one
    to the same question."""
    rng = random.Random(0)
    topics = ["the weather", "a recipe", "my homework", "a poem", "the news", "a joke"]
    with open(path, "w") as f:
        for i in range(n):
            prompt = f"\n\nHuman: Can you help me with {rng.choice(topics)}? ({i})\n\nAssistant:"
            chosen = " Of course, here is what I know." + " Happy to help." * rng.randint(0, 2)
            rejected = " No. Go away." + " Stop asking." * rng.randint(0, 2)
            f.write(json.dumps({"chosen": prompt + chosen, "rejected": prompt + rejected}) + "\n")
    return path


# The HH-RLHF experiments (reward_model_hh.py, dpo_hh.py) start from one SFT model: gpt.py on the Assistant turns
HH_FLAGS = {"--data_path": ("", "local .jsonl/.jsonl.gz of HH-RLHF records (default: the hub)")}
HH_SFT = ["--block_size", "256", "--batch_size", "16", "--max_steps", "220", "--warmup_steps", "40", "--lr", "1e-3"]
HH_SFT += ["--min_lr", "1e-4", "--eval_every", "110", "--eval_iters", "8"]
HH_SFT_QUICK = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--batch_size", "4"]
HH_SFT_QUICK += ["--max_steps", "4", "--warmup_steps", "1", "--eval_every", "4", "--eval_iters", "1"]
HH_SFT_QUICK += ["--num_samples", "1", "--sample_tokens", "2"]


def hh_data_path(args):
    """The HH-RLHF file of an experiment: --data_path ("" reads the hub), or with --quick a tiny one written here."""
    if not args.quick:
        return args.data_path
    os.makedirs(args.out, exist_ok=True)
    return tiny_hh(f"{args.out}/tiny_hh.jsonl")


def hh_sft(args, data, seed):
    """The SFT model of the HH-RLHF tables (a tiny one with --quick) on the data flags: its run folder."""
    flags = HH_SFT_QUICK if args.quick else HH_SFT
    return run("gpt.py", ["--data", "hh_sft", *data, *flags, "--seed", seed], f"{args.out}/sft_s{seed}")
