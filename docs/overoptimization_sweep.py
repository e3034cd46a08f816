"""The README's over-optimisation figure and table from a KL sweep of grpo.py and ppo.py runs on a learned reward.

    python docs/overoptimization_sweep.py docs/overoptimization.png out/sweep/*

Each argument after the figure is a run folder of `grpo.py` or `ppo.py --task arithmetic --reward_model RM`; runs are
grouped by script and --beta_kl, seeds averaged. Everything is measured on the held-out problems, on
answers sampled at temperature 1. The figure has Gao et al. (2022) Fig. 1's axes: the gold reward (exact answers)
and the proxy (the reward model's score) against sqrt(KL to the initial policy), for best-of-n of the initial policy
(squares, best_of_n.json) and for RL (a dot for each evaluation: eval/sample_accuracy, eval/sample_rm_score and
eval/sample_kl, the mean of the seeds). The table, printed as markdown: gold at step 0, at the peak of the seeds' mean
and at the end, the KL at the peak, the proxy at the peak and at the end, each the mean of the seeds +- its standard
error; and the greedy answers' gold accuracy (eval/accuracy) at step 0 and at the end.
"""

import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_run(folder):
    """(script, --beta_kl, {step: eval row}) of a run folder."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    evals = {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "eval/sample_accuracy" in row:
                evals[row["step"]] = row
    script = "PPO" if "ppo_epochs" in config else "GRPO"
    return script, config["beta_kl"], evals


def mean_se(values):
    """The mean of the seeds' values and its standard error (nan for one seed)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def over_seeds(seeds, key, step):
    """mean_se of one metric at one step over the seeds' runs."""
    return mean_se([evals[step][key] for evals in seeds])


def cell(m_se):
    return f"{m_se[0]:.3f} +- {m_se[1]:.3f}"


def main(figure, folders):
    groups = defaultdict(list)  # (script, beta_kl) -> [{step: eval row}], one a seed
    best_of_n = None
    for folder in folders:
        script, beta, evals = read_run(folder)
        groups[(script, beta)].append(evals)
        path = os.path.join(folder, "best_of_n.json")
        if best_of_n is None and os.path.exists(path):
            with open(path) as f:
                best_of_n = json.load(f)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex="col", sharey="row")
    print(
        "| run | --beta_kl | seeds | held-out problems | gold at step 0 | gold at its peak (step) | KL at the peak | "
        "gold at the end | proxy at the peak | proxy at the end | greedy gold at 0 / end |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for column, script in enumerate(["GRPO", "PPO"]):
        betas = sorted(beta for s, beta in groups if s == script)
        colors = plt.cm.viridis([0.85 * i / max(1, len(betas) - 1) for i in range(len(betas))])
        for beta, color in zip(betas, colors):
            seeds = groups[(script, beta)]
            steps = sorted(set.intersection(*[set(evals) for evals in seeds]))  # evaluated in every seed
            kl = [over_seeds(seeds, "eval/sample_kl", s)[0] for s in steps]
            gold = [over_seeds(seeds, "eval/sample_accuracy", s)[0] for s in steps]
            proxy = [over_seeds(seeds, "eval/sample_rm_score", s)[0] for s in steps]
            x = [math.sqrt(max(k, 0.0)) for k in kl]
            label = f"--beta_kl {beta:g}"
            axes[0, column].plot(x, gold, "o-", markersize=3, color=color, label=label)
            axes[1, column].plot(x, proxy, "o-", markersize=3, color=color, label=label)
            peak = steps[gold.index(max(gold))]  # the step of the seeds' mean's peak
            end = steps[-1]
            columns = [
                script,
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
            print("| " + " | ".join(columns) + " |")
        for row, key in [(0, "gold_accuracy"), (1, "proxy_score")]:
            if best_of_n:
                bon_x = [math.sqrt(b["kl_bon"]) for b in best_of_n]
                label = "best-of-n, n = " + ", ".join(str(b["n"]) for b in best_of_n)
                axes[row, column].plot(bon_x, [b[key] for b in best_of_n], "s--", color="tab:red", label=label)
            axes[row, column].grid(alpha=0.3)
        axes[0, column].set_title(f"{script} on the verifier (mean of the seeds)")
        axes[1, column].set_xlabel("sqrt(KL to the initial policy, nats per answer)")
        axes[0, column].legend(fontsize=8)
    axes[0, 0].set_ylabel("gold: exact answers, held-out")
    axes[1, 0].set_ylabel("proxy: the verifier's score")
    fig.tight_layout()
    fig.savefig(figure, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
