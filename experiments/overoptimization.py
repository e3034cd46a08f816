"""The over-optimisation figure and table of docs/rlhf_loop.md: GRPO and PPO trained on a learned verifier at three KL
coefficients, the gold reward (exact answers) watched beside the proxy (the verifier's score).

    python experiments/overoptimization.py --figure docs/overoptimization.png     # 18 + 3 RL runs

The 18 GRPO and PPO runs took 104 min of wall time together on 2 CPU cores, two to five at a time
(2026-11-27, PyTorch 2.13, float32).

It runs the SFT model and the verifier of docs/rlhf_loop.md (one run each, default seed), then GRPO (150 steps of
32 prompts x 8 answers, --scale_rewards none) and PPO (100 steps of 256 prompts x 1 answer) on the verifier at
--beta_kl 0, 0.05 and 0.2 with --seed 1, 2, 3, and GRPO at --beta_kl 0 with its default std-scaled advantages.
Everything is measured on the held-out problems, on answers sampled at temperature 1. The figure has Gao et al.
(2022) Fig. 1's axes: the gold reward and the proxy against sqrt(KL to the initial policy), for best-of-n of the
initial policy (squares, best_of_n.json) and for RL (a dot for each evaluation: eval/sample_accuracy,
eval/sample_rm_score and eval/sample_kl, the mean of the seeds). The table: gold at step 0, at the peak of the seeds'
mean and at the end, the KL at the peak, the proxy at the peak and at the end, each the mean of the seeds +- its
standard error; and the greedy answers' gold accuracy (eval/accuracy) at step 0 and at the end.
"""

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mean_se, print_table, run  # noqa: E402
from rlhf_loop import QUICK, QUICK_BEST_OF, flags, rl_flags, train_sft, train_verifier  # noqa: E402

GRPO = dict(batch_size=32, group_size=8, max_steps=150, lr=3e-5, best_of="1,2,4,8,16,32")
PPO = dict(batch_size=256, max_steps=100, lr=1e-5)  # the same 256 answers a step as GRPO's 32 x 8


def sweep(args):
    """Run the SFT model, the verifier and every RL run (those already finished are kept); returns the RL folders."""
    sft = train_sft(args)
    rl = rl_flags(args, sft, train_verifier(args, sft))
    grpo = flags(GRPO, {**QUICK["grpo"], "best_of": QUICK_BEST_OF} if args.quick else None)
    ppo = flags(PPO, QUICK["ppo"] if args.quick else None)
    betas = [0.2] if args.quick else [0, 0.05, 0.2]  # --quick: one coefficient
    folders = []
    for seed in args.seeds:
        for beta in betas:
            common = rl + ["--beta_kl", beta, "--seed", seed]
            dr_grpo = common + grpo + ["--scale_rewards", "none"]  # Dr. GRPO's advantages: no division by the std
            folders.append(run("grpo.py", dr_grpo, f"{args.out}/grpo_{beta}_{seed}"))
            folders.append(run("ppo.py", common + ppo, f"{args.out}/ppo_{beta}_{seed}"))
        if not args.quick:  # GRPO's default advantages, divided by each group's std
            std_scaled = rl + ["--beta_kl", 0, "--seed", seed] + grpo + ["--scale_rewards", "group"]
            folders.append(run("grpo.py", std_scaled, f"{args.out}/grpo_std_scaled_0_{seed}"))
    return folders


def read_run(folder):
    """(run label, --beta_kl, {step: eval row}) of a run folder."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    evals = {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "eval/sample_accuracy" in row:
                evals[row["step"]] = row
    if "ppo_epochs" in config:
        label = "PPO"
    elif config.get("scale_rewards") == "group":
        label = "GRPO, std-scaled advantages"
    else:
        label = "GRPO"
    return label, config["beta_kl"], evals


def over_seeds(seeds, key, step):
    """mean_se of one metric at one step over the seeds' runs."""
    return mean_se([evals[step][key] for evals in seeds])


def cell(m_se):
    return f"{m_se[0]:.3f} +- {m_se[1]:.3f}"


def figure_and_table(figure, folders):
    groups = defaultdict(list)  # (label, beta_kl) -> [{step: eval row}], one a seed
    best_of_n = None
    for folder in folders:
        label, beta, evals = read_run(folder)
        groups[(label, beta)].append(evals)
        path = os.path.join(folder, "best_of_n.json")
        if best_of_n is None and os.path.exists(path):
            with open(path) as f:
                best_of_n = json.load(f)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex="col", sharey="row")
    header = [
        "run", "--beta_kl", "seeds", "held-out problems", "gold at step 0", "gold at its peak (step)",
        "KL at the peak", "gold at the end", "proxy at the peak", "proxy at the end", "greedy gold at 0 / end",
    ]  # fmt: skip
    rows = []
    for label in ["GRPO", "PPO", "GRPO, std-scaled advantages"]:
        column = {"GRPO": 0, "PPO": 1}.get(label)  # the std-scaled runs are in the table only
        betas = sorted(beta for s, beta in groups if s == label)
        colors = plt.cm.viridis([0.85 * i / max(1, len(betas) - 1) for i in range(len(betas))])
        for beta, color in zip(betas, colors):
            seeds = groups[(label, beta)]
            steps = sorted(set.intersection(*[set(evals) for evals in seeds]))  # evaluated in every seed
            kl = [over_seeds(seeds, "eval/sample_kl", s)[0] for s in steps]
            gold = [over_seeds(seeds, "eval/sample_accuracy", s)[0] for s in steps]
            proxy = [over_seeds(seeds, "eval/sample_rm_score", s)[0] for s in steps]
            if column is not None:
                x = [math.sqrt(max(k, 0.0)) for k in kl]
                axes[0, column].plot(x, gold, "o-", markersize=3, color=color, label=f"--beta_kl {beta:g}")
                axes[1, column].plot(x, proxy, "o-", markersize=3, color=color, label=f"--beta_kl {beta:g}")
            peak = steps[gold.index(max(gold))]  # the step of the seeds' mean's peak
            end = steps[-1]
            rows.append(
                [
                    label,
                    f"{beta:g}",
                    str(len(seeds)),
                    f"{seeds[0][end]['eval/n_problems']:.0f}",
                    cell(over_seeds(seeds, "eval/sample_accuracy", 0)),
                    f"{cell(over_seeds(seeds, 'eval/sample_accuracy', peak))} ({peak})",
                    f"{over_seeds(seeds, 'eval/sample_kl', peak)[0]:.2f}",
                    cell(over_seeds(seeds, "eval/sample_accuracy", end)),
                    cell(over_seeds(seeds, "eval/sample_rm_score", peak)),
                    cell(over_seeds(seeds, "eval/sample_rm_score", end)),
                    f"{over_seeds(seeds, 'eval/accuracy', 0)[0]:.3f} / {cell(over_seeds(seeds, 'eval/accuracy', end))}",
                ]
            )
    for column, label in enumerate(["GRPO", "PPO"]):
        for row, key in [(0, "gold_accuracy"), (1, "proxy_score")]:
            if best_of_n:
                bon_x = [math.sqrt(b["kl_bon"]) for b in best_of_n]
                bon_label = "best-of-n, n = " + ", ".join(str(b["n"]) for b in best_of_n)
                axes[row, column].plot(bon_x, [b[key] for b in best_of_n], "s--", color="tab:red", label=bon_label)
            axes[row, column].grid(alpha=0.3)
        axes[0, column].set_title(f"{label} on the verifier (mean of the seeds)")
        axes[1, column].set_xlabel("sqrt(KL to the initial policy, nats per answer)")
        axes[0, column].legend(fontsize=8)
    axes[0, 0].set_ylabel("gold: exact answers, held-out")
    axes[1, 0].set_ylabel("proxy: the verifier's score")
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    print_table(header, rows)
    print(f"figure: {figure}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, one seed, one coefficient: does it run?")
    parser.add_argument("--out", default="out/experiments/overoptimization", help="folder of this experiment's runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the RL runs")
    parser.add_argument("--figure", default="", help="where the PNG goes (default: OUT/overoptimization.png)")
    args = parser.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
    folders = sweep(args)
    figure_and_table(args.figure or os.path.join(args.out, "overoptimization.png"), folders)


if __name__ == "__main__":
    main()
