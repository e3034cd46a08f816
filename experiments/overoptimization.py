"""The over-optimisation figure, table and fits of docs/rlhf_loop.md: best-of-n, GRPO, PPO and DPO optimising a
learned verifier, the gold reward (exact answers) watched beside the proxy (the verifier's score), at three
whole-pipeline seeds.

    python experiments/overoptimization.py --figure docs/overoptimization.png

For each seed S it takes the SFT model and the verifier of experiments/rlhf_loop.py (the same run folders: the
default --out is that experiment's), best-of-n of the SFT model under the verifier (reward_model.py --best_of, with
the exact KL), GRPO on the verifier at --beta_kl 0.2 (the loop's run) and 0, PPO at --beta_kl 0, and DPO on pairs
the verifier judges (--judge) at --beta 0.01, 0.05, 0.1 and 0.5, each logging the same held-out measures
(--reward_model: eval/sample_accuracy, eval/sample_rm_score, eval/sample_kl; four answers a held-out problem at
temperature 1). The figure has Gao et al. (2022) Fig. 1's axes: gold and proxy against sqrt(KL to the SFT model),
the mean of the seeds; best-of-n at its exact KL, and at the bound log n - (n - 1)/n (hollow). The table: gold at
the start, at the peak and at the end, the KL and the proxy there, mean +- s.e. over the seeds; the peak (a step, or
best-of-n's n) is picked on the seeds' mean over the held-out problems at even places of their sorted list (half a)
and every gold value is reported on the others (half b). The fits: Gao et al.'s functional forms for the gain in
gold over the start, R = gold - gold at the start, against d = sqrt(KL), fitted by least squares to the seeds' mean
curve (all held-out problems): best-of-n R(d) = d (alpha - beta d), RL and DPO R(d) = d (alpha - beta log d).
"""

import math
import os
import sys
from collections import defaultdict

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, mean_se, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import GRPO, best_of_n, flags, quick, read_json, rl_flags, start  # noqa: E402

PPO = dict(batch_size=256, max_steps=100, lr=1e-5)  # the same 256 answers a step as GRPO's 32 x 8
DPO = dict(
    data="arithmetic", digits=2, ops="+-", pair_prompts=1024, lr=3e-5, min_lr=1e-6, max_steps=300, eval_every=20,
    eval_size=1000,
)  # fmt: skip
QUICK_DPO = dict(pair_prompts=16, batch_size=4, max_steps=2, eval_every=1, eval_size=16)
DPO_BETAS = [0.01, 0.05, 0.1, 0.5]


def sweep(args):
    """Every run of every seed (finished ones are kept): {seed: {label: run folder}}."""
    runs = {}
    for seed in args.seeds:
        sft, verifier = start(args, seed)
        out = f"{args.out}/seed{seed}"
        rl = rl_flags(args, sft, verifier) + ["--seed", seed]
        grpo = rl + flags(GRPO, quick(args, "grpo"))  # the loop's run: --beta_kl 0.2
        grpo_beta0 = rl + flags({**GRPO, "beta_kl": 0}, quick(args, "grpo"))
        ppo = rl + flags(PPO, quick(args, "ppo")) + ["--beta_kl", 0]
        folders = {"best-of-n": best_of_n(args, seed, sft, verifier)}
        folders["GRPO, beta_kl 0.2"] = run("grpo.py", grpo, f"{out}/grpo")
        folders["GRPO, beta_kl 0"] = run("grpo.py", grpo_beta0, f"{out}/grpo_beta0")
        folders["PPO, beta_kl 0"] = run("ppo.py", ppo, f"{out}/ppo_beta0")
        if args.dpo == "no":
            runs[seed] = folders
            continue
        dpo = flags(DPO, QUICK_DPO if args.quick else None) + ["--init_from", sft, "--seed", seed]
        dpo += ["--judge", verifier, "--reward_model", verifier]
        for beta in DPO_BETAS[-1:] if args.quick else DPO_BETAS:
            folders[f"DPO, beta {beta:g}"] = run("dpo.py", dpo + ["--beta", beta], f"{out}/dpo_beta{beta:g}")
        runs[seed] = folders
    return runs


def curve(folders):
    """The seeds' runs of one label as {x: [row of each seed]}: best-of-n by n (best_of_n.json), a run by step."""
    by_x = defaultdict(list)
    for folder in folders:
        path = os.path.join(folder, "best_of_n.json")
        if os.path.exists(path):
            rows = {r["n"]: r for r in read_json(path)}
        else:
            rows = {r["step"]: r for r in metrics(folder) if "eval/sample_accuracy" in r}
        for x, row in rows.items():
            by_x[x].append(row)
    return {x: rows for x, rows in sorted(by_x.items()) if len(rows) == len(folders)}  # measured in every seed


BEST_OF_KEYS = {"gold": "gold", "gold_a": "gold_a", "gold_b": "gold_b", "proxy": "proxy", "kl": "kl"}
RUN_KEYS = {
    "gold": "eval/sample_accuracy",
    "gold_a": "eval/sample_accuracy_a",
    "gold_b": "eval/sample_accuracy_b",
    "proxy": "eval/sample_rm_score",
    "kl": "eval/sample_kl",
}


def values(rows, key, keys):
    return [row[keys[key]] for row in rows]


def gao_fit(d, gain, form):
    """Least-squares alpha, beta and R^2 of Gao et al.'s gain in gold against d = sqrt(KL): best-of-n (form "bon")
    R = d (alpha - beta d), RL R = d (alpha - beta log d). Both are linear in (alpha, beta), with no intercept."""
    d = np.asarray(d, dtype=float)
    gain = np.asarray(gain, dtype=float)
    second = d**2 if form == "bon" else d * np.log(np.where(d > 0, d, 1.0))  # d log d -> 0 at d = 0
    design = np.stack([d, -second], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, gain, rcond=None)
    residual = gain - design @ np.array([alpha, beta])
    total = ((gain - gain.mean()) ** 2).sum()
    return alpha, beta, 1 - (residual**2).sum() / total if total > 0 else float("nan")


def figure_and_tables(figure, runs):
    labels = list(next(iter(runs.values())))
    with_dpo = any(label.startswith("DPO") for label in labels)  # --dpo no: one column, RL and best-of-n
    fig, axes = plt.subplots(2, 1 + with_dpo, figsize=(6 + 6 * with_dpo, 8), sharex=True, sharey="row", squeeze=False)
    table = []
    fits = []
    rl_colors = {"GRPO, beta_kl 0.2": "tab:blue", "GRPO, beta_kl 0": "tab:cyan", "PPO, beta_kl 0": "tab:purple"}
    dpo_colors = plt.cm.viridis(np.linspace(0, 0.85, len([label for label in labels if label.startswith("DPO")])))
    dpo_colors = dict(zip([label for label in labels if label.startswith("DPO")], dpo_colors))
    for label in labels:
        points = curve([runs[seed][label] for seed in runs])
        keys = BEST_OF_KEYS if label == "best-of-n" else RUN_KEYS
        xs = list(points)
        mean = {key: [mean_se(values(points[x], key, keys))[0] for x in xs] for key in keys}
        d = [math.sqrt(max(k, 0.0)) for k in mean["kl"]]  # k1 can dip below 0
        columns = [0, 1][: 1 + with_dpo] if label == "best-of-n" else [1 if label.startswith("DPO") else 0]
        for column in columns:
            color = "tab:red" if label == "best-of-n" else {**rl_colors, **dpo_colors}[label]
            marker = "s-" if label == "best-of-n" else "o-"
            axes[0, column].plot(d, mean["gold"], marker, markersize=3, color=color, label=label)
            axes[1, column].plot(d, mean["proxy"], marker, markersize=3, color=color, label=label)
            if label == "best-of-n":  # at the bound, where best-of-n is often drawn
                bound = [math.sqrt(points[n][0]["kl_bound"]) for n in xs]
                hollow = dict(mfc="none", color=color, alpha=0.5)
                axes[0, column].plot(bound, mean["gold"], "s--", **hollow, label="best-of-n at the bound")
                axes[1, column].plot(bound, mean["proxy"], "s--", **hollow)
        peak = xs[max(range(len(xs)), key=lambda i: mean["gold_a"][i])]  # picked on half a
        start_x, end = xs[0], xs[-1]
        table.append(
            [
                label,
                fmt(values(points[start_x], "gold_b", keys)),
                f"{fmt(values(points[peak], 'gold_b', keys))} ({'n = ' if label == 'best-of-n' else 'step '}{peak})",
                fmt(values(points[peak], "kl", keys), 2),
                fmt(values(points[end], "gold_b", keys)),
                fmt(values(points[end], "kl", keys), 2),
                fmt(values(points[peak], "proxy", keys), 2),
                fmt(values(points[end], "proxy", keys), 2),
            ]
        )
        gain = [g - mean["gold"][0] for g in mean["gold"]]
        alpha, beta, r2 = gao_fit(d, gain, "bon" if label == "best-of-n" else "rl")
        form = "d (alpha - beta d)" if label == "best-of-n" else "d (alpha - beta log d)"
        fits.append([label, form, f"{alpha:.3f}", f"{beta:.3f}", f"{r2:.2f}", len(xs)])
    for column, title in enumerate(["GRPO and PPO on the verifier", "DPO on verifier-judged pairs"][: 1 + with_dpo]):
        axes[0, column].set_title(f"{title} (mean of {len(runs)} seeds)")
        axes[1, column].set_xlabel("sqrt(KL to the SFT model, nats per answer)")
        axes[0, column].legend(fontsize=8)
        for row in range(2):
            axes[row, column].grid(alpha=0.3)
    axes[0, 0].set_ylabel("gold: exact answers, held-out")
    axes[1, 0].set_ylabel("proxy: the verifier's score")
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    n_problems = int(read_json(f"{runs[next(iter(runs))]['best-of-n']}/best_of_n.json")[0]["n_problems"])
    header = [
        "run", "gold at the start", "gold at the peak (where)", "KL at the peak", "gold at the end", "KL at the end",
        "proxy at the peak", "proxy at the end",
    ]  # fmt: skip
    print(f"gold on half b of the {n_problems} held-out problems, the peak picked on half a; KL in nats per answer")
    print_table(header, table)
    print_table(["run", "form of R(d)", "alpha", "beta", "R^2", "points"], fits)
    print(f"figure: {figure}")


def main():
    extra = {
        "--figure": ("", "where the PNG goes (default: OUT/overoptimization.png)"),
        "--dpo": ("yes", "no: best-of-n, GRPO and PPO only, without the 4 DPO runs a seed"),
    }
    args = parse_args("rlhf_loop", __doc__.splitlines()[0], extra=extra)  # the loop's runs are this sweep's start
    figure_and_tables(args.figure or os.path.join(args.out, "overoptimization.png"), sweep(args))


if __name__ == "__main__":
    main()
