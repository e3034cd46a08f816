"""The README's over-optimisation figure and table from a KL sweep of grpo.py and ppo.py runs on a learned reward.

    python docs/overoptimization_sweep.py docs/overoptimization.png out/sweep/*

Each argument after the figure is a run folder of `grpo.py` or `ppo.py --task arithmetic --reward_model RM`; runs are
grouped by script and --beta_kl, seeds averaged. The figure has Gao et al. (2022) Fig. 1's axes: the gold reward
(exact answers) and the proxy (the reward model's score) against sqrt(KL to the initial policy), for best-of-n of
the initial policy (squares, best_of_n.json, held-out problems) and for RL (lines: each step's rollouts, seeds
averaged, then a moving mean over 10 steps). The table, printed as markdown, is of the greedy evaluations on the
held-out problems: gold accuracy at step 0, at the peak of the seeds' mean and at the end, each as the mean over
seeds +- its standard error; the rollouts' KL at the peak; the proxy score of the greedy answers at the end.
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
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    script = "PPO" if "ppo_epochs" in config else "GRPO"
    kl_key = "rl/kl" if script == "PPO" else "rl/rollout_kl"
    return script, config, rows, kl_key


def mean_se(values):
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def smooth(values, width=10):
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def main(figure, folders):
    groups = defaultdict(list)  # (script, beta_kl) -> [(config, rows, kl_key)]
    best_of_n = None
    for folder in folders:
        script, config, rows, kl_key = read_run(folder)
        groups[(script, config["beta_kl"])].append((config, rows, kl_key))
        path = os.path.join(folder, "best_of_n.json")
        if best_of_n is None and os.path.exists(path):
            with open(path) as f:
                best_of_n = json.load(f)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex="col")
    print("| run | --beta_kl | seeds | held-out problems | gold at step 0 | gold at peak (step) | KL at peak | "
          "gold at end | proxy at end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for column, script in enumerate(["GRPO", "PPO"]):
        betas = sorted(beta for s, beta in groups if s == script)
        colors = plt.cm.viridis([i / max(1, len(betas) - 1) * 0.85 for i in range(len(betas))])
        for beta, color in zip(betas, colors):
            runs = groups[(script, beta)]
            # the rollouts of every step, averaged over seeds
            per_step = defaultdict(list)
            evals = defaultdict(list)
            for config, rows, kl_key in runs:
                for r in rows:
                    if "rl/gold_reward" in r and kl_key in r:
                        per_step[r["step"]].append((r[kl_key], r["rl/gold_reward"], r["rl/reward_mean"]))
                    if "eval/accuracy" in r:
                        evals[r["step"]].append((r["eval/accuracy"], r["eval/rm_score"], r["eval/n_problems"]))
            steps = sorted(s for s in per_step if len(per_step[s]) == len(runs))
            kl = smooth([sum(v[0] for v in per_step[s]) / len(runs) for s in steps])
            gold = smooth([sum(v[1] for v in per_step[s]) / len(runs) for s in steps])
            proxy = smooth([sum(v[2] for v in per_step[s]) / len(runs) for s in steps])
            x = [math.sqrt(max(k, 0.0)) for k in kl]
            label = f"beta_kl {beta:g}"
            axes[0, column].plot(x, gold, color=color, label=label)
            axes[1, column].plot(x, proxy, color=color, label=label)
            # the table: greedy evaluations on the held-out problems
            eval_steps = sorted(s for s in evals if len(evals[s]) == len(runs))
            accuracy = {s: mean_se([e[0] for e in evals[s]]) for s in eval_steps}
            peak = max(eval_steps, key=lambda s: accuracy[s][0])
            end = eval_steps[-1]
            kl_peak = sum(v[0] for v in per_step[peak]) / len(runs) if peak in per_step else float("nan")
            proxy_end = mean_se([e[1] for e in evals[end]])
            n_problems = evals[end][0][2]

            def cell(m_se):
                return f"{m_se[0]:.3f} +- {m_se[1]:.3f}"

            print(
                f"| {script} | {beta:g} | {len(runs)} | {n_problems} | {cell(accuracy[eval_steps[0]])} | "
                f"{cell(accuracy[peak])} ({peak}) | {kl_peak:.2f} | {cell(accuracy[end])} | {cell(proxy_end)} |"
            )
        for row, key, name in [(0, "gold_accuracy", "gold reward (exact answer)"), (1, "proxy_score", "proxy")]:
            ax = axes[row, column]
            if best_of_n:
                bon_x = [math.sqrt(b["kl_bon"]) for b in best_of_n]
                ax.plot(bon_x, [b[key] for b in best_of_n], "s--", color="tab:red", label="best-of-n (n = 1, 2, 4, ..)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0, column].set_title(f"{script} on the verifier, by --beta_kl (mean of the seeds)")
        axes[1, column].set_xlabel("sqrt(KL to the initial policy per completion, nats)")
        axes[0, column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(figure, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
