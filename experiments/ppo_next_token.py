"""The next-token table of docs/ppo.md: PPO against GRPO (process advantages) on the dense next-token reward, a
character-level model of tiny Shakespeare trained from scratch with a bigram reference, 64 completions a step.

    python experiments/ppo_next_token.py        # two runs of 150 steps (457 and 77 ms a step, 2 CPU cores, 2026-11-23)

The table: the mean of rl/reward_mean (the per-token reward) over windows of steps, eval/next_token_acc and
eval/greedy_match at the first and the last evaluation, and the median time per step (perf/step_ms).
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import flags  # noqa: E402

MODEL = dict(
    tokenizer="char", n_layer=2, n_head=2, n_embd=64, block_size=64, context_len=32, horizon=16, max_steps=150,
    eval_every=50, data_path="data/tinyshakespeare.txt",
)  # fmt: skip
QUICK_MODEL = dict(n_embd=32, max_steps=3, eval_every=3, eval_size=8)
RUNS = [  # (row, script, flags): 64 completions a step in both
    ("PPO", "ppo.py", ["--batch_size", 64]),
    ("GRPO (process advantages)", "grpo.py", ["--batch_size", 8, "--group_size", 8]),
]
WINDOWS = [(0, 9), (20, 29), (50, 59), (90, 99), (140, 149)]  # steps whose rewards are averaged


def window_mean(rows, name, lo, hi):
    """The mean of a metric over the logged steps lo..hi of a run."""
    return statistics.mean(row[name] for row in rows if lo <= row["step"] <= hi and name in row)


def first_to_last(runs, name):
    """ "first -> last" evaluation of a metric, each over the seeds."""
    evals = [[row[name] for row in rows if name in row] for rows in runs]
    return f"{fmt([e[0] for e in evals])} -> {fmt([e[-1] for e in evals])}"


def main():
    args = parse_args("ppo_next_token", __doc__.splitlines()[0], seeds=(1337,))
    model = flags(MODEL, QUICK_MODEL if args.quick else None)
    max_steps = QUICK_MODEL["max_steps"] if args.quick else MODEL["max_steps"]
    windows = [(lo, min(hi, max_steps - 1)) for lo, hi in WINDOWS if lo < max_steps]
    table = []
    for i, (name, script, run_flags) in enumerate(RUNS):
        runs = []
        for seed in args.seeds:
            folder = run(script, model + run_flags + ["--seed", seed], f"{args.out}/run{i}_{seed}")
            runs.append(metrics(folder))
        rewards = [fmt([window_mean(rows, "rl/reward_mean", lo, hi) for rows in runs]) for lo, hi in windows]
        step_ms = [statistics.median(row["perf/step_ms"] for row in rows if "perf/step_ms" in row) for rows in runs]
        acc = first_to_last(runs, "eval/next_token_acc")
        match = first_to_last(runs, "eval/greedy_match")
        table.append([name, " / ".join(rewards), acc, match, f"{fmt(step_ms, 0)} ms"])
    steps = " / ".join(f"{lo}-{hi}" for lo, hi in windows)
    print_table(["run", f"reward, steps {steps}", "eval next_token_acc", "eval greedy_match", "step"], table)


if __name__ == "__main__":
    main()
