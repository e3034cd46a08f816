"""The "PPO against GRPO" table of docs/ppo.md: PPO (three value-model and update settings) against GRPO (one and four
updates per batch) on the gold reward of 2-digit `+`/`-` arithmetic, from one SFT model of the RLHF loop's earlier
recipe (rlhf_loop.EARLIER_SFT, 3 layers of width 96, 2,000 steps, gpt.py's default seed), the same 256 answers a
step (GRPO: 32 prompts x 8 answers; PPO: 256 prompts x 1) for 100 steps at lr 1e-4.

    python experiments/ppo_vs_grpo.py     # the SFT model, then 5 rows x 3 seeds (median steps of 2026-11-27: ~45 min)

Greedy exact answers on the held-out problems at every evaluation, mean +- s.e. over the seeds, and the median
time per step (perf/step_ms; the mean over the seeds of each run's median).
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import EARLIER_SFT, QUICK, flags  # noqa: E402

GOLD = dict(
    task="arithmetic", digits=2, ops="+-", horizon=6, max_steps=100, lr=1e-4, min_lr=1e-4, warmup_steps=5,
    eval_every=25, eval_size=300,
)  # fmt: skip
QUICK_GOLD = dict(max_steps=2, warmup_steps=1, eval_every=1, eval_size=16)
BATCH = {"grpo.py": ["--batch_size", 32, "--group_size", 8], "ppo.py": ["--batch_size", 256]}  # 256 answers a step
QUICK_BATCH = {"grpo.py": ["--batch_size", 4, "--group_size", 4], "ppo.py": ["--batch_size", 16]}
ROWS = [  # (row, script, updates per batch, flags)
    ("GRPO (`grpo`)", "grpo.py", 1, ["--loss_type", "grpo"]),
    ("GRPO, `--num_iterations 4`", "grpo.py", 4, ["--num_iterations", 4]),
    ("PPO, separate value model (defaults: 4 epochs x 4 minibatches)", "ppo.py", 16, []),
    ("PPO, `--value_model shared`", "ppo.py", 16, ["--value_model", "shared"]),
    ("PPO, `--ppo_epochs 1 --num_minibatches 1`", "ppo.py", 1, ["--ppo_epochs", 1, "--num_minibatches", 1]),
]
QUICK_ROWS = [0, 2]  # --quick: GRPO and PPO with their defaults


def accuracy_by_step(folder):
    """{step: eval/accuracy} of a run."""
    return {row["step"]: row["eval/accuracy"] for row in metrics(folder) if "eval/accuracy" in row}


def median_step_ms(folder):
    return statistics.median(row["perf/step_ms"] for row in metrics(folder) if "perf/step_ms" in row)


def main():
    args = parse_args("ppo_vs_grpo", __doc__.splitlines()[0])
    sft = run("gpt.py", flags(EARLIER_SFT, QUICK["sft"] if args.quick else None), f"{args.out}/sft") + "/ckpt.pt"
    gold = flags(GOLD, QUICK_GOLD if args.quick else None) + ["--init_from", sft]
    batch = QUICK_BATCH if args.quick else BATCH
    rows = [ROWS[i] for i in QUICK_ROWS] if args.quick else ROWS
    table = []
    for i, (name, script, updates, row_flags) in enumerate(rows):
        folders = [
            run(script, gold + batch[script] + row_flags + ["--seed", seed], f"{args.out}/row{i}_{seed}")
            for seed in args.seeds
        ]
        evals = [accuracy_by_step(folder) for folder in folders]
        steps = sorted(evals[0])
        accuracy = [fmt([e[step] for e in evals]) for step in steps]
        step_ms = [median_step_ms(folder) for folder in folders]
        table.append([name, updates, *accuracy, f"{fmt(step_ms, 0)} ms"])
    header = ["run", "updates per batch", f"accuracy at step {steps[0]}", *map(str, steps[1:]), "median step"]
    print_table(header, table)


if __name__ == "__main__":
    main()
