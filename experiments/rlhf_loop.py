"""The RLHF loop's tables of docs/rlhf_loop.md and README.md, at three whole-pipeline seeds: an SFT model, a verifier
trained on its own answers, best-of-n of the SFT model under the verifier, and GRPO on the verifier, all at seed S,
on 2-digit `+`/`-` arithmetic whose gold reward (the exact answer) is known.

    python experiments/rlhf_loop.py          # seeds 1, 2 and 3: about 12 minutes a seed on 2 CPU cores

Every measure is on the 461 distinct held-out problems (1000 held-out draws, repeats dropped). A best n is picked on
the problems at even places of their sorted list and reported on those at odd places.

The other experiments of that page (sft_seeds.py, overoptimization.py, verifier_size.py, rm_ensembles.py) start
from the same SFT models and verifiers, in the same run folders, through start() and rl_flags() here.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import final_results, fmt, mean_se, metrics, parse_args, print_table, run  # noqa: E402

SFT = dict(
    data="arithmetic", tokenizer="char", digits=2, ops="+-", n_layer=4, n_head=4, n_embd=128, block_size=32,
    batch_size=64, lr=2e-3, warmup_steps=100, max_steps=2500, eval_every=500,
)  # fmt: skip
# the earlier recipe (one SFT model, gpt.py's default seed 1337), which the tables of dpo_gold_vs_judged.py and
# ppo_vs_grpo.py were measured from: its greedy held-out accuracy ranged from 0.21 to 0.55 over seeds 1-3
EARLIER_SFT = {
    **SFT,
    "n_layer": 3,
    "n_embd": 96,
    "lr": 3e-3,
    "min_lr": 2e-4,
    "warmup_steps": 50,
    "max_steps": 2000,
    "eval_every": 1000,
}
VERIFIER = dict(
    task="orm", digits=2, ops="+-", n_train=50000, n_val=2000, batch_size=64, max_steps=2000, eval_every=500
)
RL = dict(task="arithmetic", digits=2, ops="+-", horizon=6, eval_every=10, eval_size=1000, warmup_steps=5)
GRPO = dict(batch_size=32, group_size=8, max_steps=150, lr=3e-5, scale_rewards="none", beta_kl=0.2)
BEST_OF = dict(digits=2, ops="+-", best_of="1,2,4,8,16,32,64", eval_size=1000)
# --quick: a tiny SFT model, a verifier of a few steps, 2 RL steps on a few held-out problems
QUICK = {
    "sft": {
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 32,
        "batch_size": 32,
        "lr": 1e-2,
        "warmup_steps": 2,
        "max_steps": 100,  # enough for a few right answers (DPO's gold pairs need them)
        "eval_every": 100,
        "eval_iters": 2,
    },
    "verifier": dict(n_train=256, n_val=64, batch_size=32, max_steps=4, eval_every=4),
    "rl": dict(eval_every=1, eval_size=16, warmup_steps=1),
    "grpo": dict(batch_size=4, group_size=4, max_steps=2),
    "ppo": dict(batch_size=16, max_steps=2),
    "best_of": dict(best_of="1,2,4", eval_size=16),
}


def flags(settings, quick=None):
    """--key value flags of a settings dict, with the --quick overrides when given."""
    merged = {**settings, **(quick or {})}
    return [item for key, value in merged.items() for item in (f"--{key}", value)]


def quick(args, stage):
    """The --quick overrides of a stage, or None."""
    return QUICK[stage] if args.quick else None


def start(args, seed):
    """The SFT model (gpt.py) and the verifier (reward_model.py --task orm on the SFT model's own answers) of one
    whole-pipeline seed, in OUT/seedS: their ckpt.pt paths."""
    sft = run("gpt.py", flags(SFT, quick(args, "sft")) + ["--seed", seed], f"{args.out}/seed{seed}/sft")
    verifier_flags = flags(VERIFIER, quick(args, "verifier")) + ["--samples_from", f"{sft}/ckpt.pt", "--seed", seed]
    verifier = run("reward_model.py", verifier_flags, f"{args.out}/seed{seed}/verifier")
    return f"{sft}/ckpt.pt", f"{verifier}/ckpt.pt"


def best_of_n(args, seed, policy, verifier, name="best_of_n"):
    """reward_model.py --best_of: best-of-n of the policy's answers under the verifier (exact KL): its folder."""
    folder = f"{args.out}/seed{seed}/{name}"
    if os.path.exists(f"{folder}/best_of_n.json"):  # finished (--best_of writes no final_results.json)
        return folder
    bon_flags = flags(BEST_OF, quick(args, "best_of")) + ["--init_from", verifier, "--policy", policy, "--seed", seed]
    return run("reward_model.py", bon_flags, folder)


def rl_flags(args, sft, reward_model=None):
    """grpo.py's and ppo.py's arithmetic flags, from the SFT model, on the verifier's reward when given (else gold)."""
    start_flags = ["--init_from", sft] + (["--reward_model", reward_model] if reward_model else [])
    return flags(RL, quick(args, "rl")) + start_flags


def loop(args, seed):
    """The whole pipeline at one seed: {stage: run folder}."""
    sft, verifier = start(args, seed)
    grpo_flags = rl_flags(args, sft, verifier) + flags(GRPO, quick(args, "grpo")) + ["--seed", seed]
    return {
        "sft": os.path.dirname(sft),
        "verifier": os.path.dirname(verifier),
        "best_of_n": best_of_n(args, seed, sft, verifier),
        "grpo": run("grpo.py", grpo_flags, f"{args.out}/seed{seed}/grpo"),
    }


def read_json(path):
    with open(path) as f:
        return json.load(f)


def with_mean(values, digits=3):
    """Each seed's value, then their mean +- s.e."""
    return [f"{v:.{digits}f}" for v in values] + [fmt(values, digits)]


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0])
    runs = [loop(args, seed) for seed in args.seeds]
    sft = [[r for r in metrics(run["sft"]) if "eval/accuracy" in r][-1] for run in runs]
    verifier = [final_results(run["verifier"]) for run in runs]
    bon = [{row["n"]: row for row in read_json(f"{run['best_of_n']}/best_of_n.json")} for run in runs]
    grpo = [[r for r in metrics(run["grpo"]) if "eval/sample_accuracy" in r] for run in runs]
    wall = [sum(final_results(run[stage])["wall_time_s"] for stage in ("sft", "verifier", "grpo")) for run in runs]
    ns = sorted(bon[0])
    pick = max(ns, key=lambda n: mean_se([b[n]["gold_a"] for b in bon])[0])  # the best n on the even places
    rows = [
        ["SFT greedy gold (gpt.py eval/accuracy)", *with_mean([r["eval/accuracy"] for r in sft])],
        ["verifier AUC, pooled (eval/auc)", *with_mean([v["auc"] for v in verifier])],
        ["verifier AUC within a problem (eval/auc_per_problem)", *with_mean([v["auc_per_problem"] for v in verifier])],
        ["best-of-1 sampled gold", *with_mean([b[1]["gold"] for b in bon])],
        [f"best-of-{pick} gold (n picked on half a, reported on half b)", *with_mean([b[pick]["gold_b"] for b in bon])],
        ["GRPO sampled gold, step 0", *with_mean([g[0]["eval/sample_accuracy"] for g in grpo])],
        [f"GRPO sampled gold, step {grpo[0][-1]['step']}", *with_mean([g[-1]["eval/sample_accuracy"] for g in grpo])],
        ["GRPO greedy gold, step 0", *with_mean([g[0]["eval/accuracy"] for g in grpo])],
        [f"GRPO greedy gold, step {grpo[0][-1]['step']}", *with_mean([g[-1]["eval/accuracy"] for g in grpo])],
        ["GRPO KL to the SFT model (nats per answer), end", *with_mean([g[-1]["eval/sample_kl"] for g in grpo], 2)],
        ["wall time of SFT + verifier + GRPO (s)", *with_mean(wall, 0)],
    ]
    n_problems = int(sft[0]["eval/n_problems"])
    header = ["measure", *[f"seed {s}" for s in args.seeds], f"mean +- s.e. ({n_problems} held-out problems)"]
    print_table(header, rows)

    table = []
    for n in ns:
        kl = [b[n]["kl"] for b in bon]
        table.append(
            [
                n,
                fmt([b[n]["gold"] for b in bon]),
                fmt([b[n]["gold_a"] for b in bon]),
                fmt([b[n]["gold_b"] for b in bon]),
                fmt([b[n]["proxy"] for b in bon], 2),
                fmt(kl, 2),
                f"{bon[0][n]['kl_bound']:.2f}",
            ]
        )
    header = ["n", "gold", "gold, half a", "gold, half b", "proxy (verifier's score)", "exact KL (nats)", "bound"]
    print_table(header, table)


if __name__ == "__main__":
    main()
