"""The ten-minute RLHF loop of README.md at whole-pipeline seeds (the SFT model, the verifier and GRPO all at seed S),
and best-of-n with its exact KL on the same checkpoints (docs/rlhf_loop.md): two tables, a column or a mean per seed.

    python experiments/loop_seeds.py                 # seeds 1, 2 and 3: about 30 minutes on 2 CPU cores
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import GRPO, QUICK, RL, SFT, VERIFIER, flags  # noqa: E402

BEST_OF = "1,2,4,8,16,32"  # grpo.py's pass at step 0 (the README's command)
EXACT_BEST_OF = "1,2,4,8,16,32,64"  # reward_model.py's pass, with the exact KL
QUICK_BEST_OF = "1,2,4"


def pipeline(args, seed):
    """SFT, verifier, GRPO with best-of-n at step 0, and reward_model.py's best-of-n, all at one seed: the folders."""
    out = f"{args.out}/seed{seed}"
    quick = QUICK if args.quick else {}
    sft = run("gpt.py", flags(SFT, quick.get("sft")) + ["--seed", seed], f"{out}/sft")
    verifier_flags = flags(VERIFIER, quick.get("verifier")) + ["--samples_from", f"{sft}/ckpt.pt", "--seed", seed]
    verifier = run("reward_model.py", verifier_flags, f"{out}/verifier")
    best_of = QUICK_BEST_OF if args.quick else BEST_OF
    rl = flags(RL, quick.get("rl")) + ["--init_from", f"{sft}/ckpt.pt", "--reward_model", f"{verifier}/ckpt.pt"]
    grpo_flags = rl + flags(GRPO, quick.get("grpo")) + ["--best_of", best_of, "--seed", seed]
    grpo = run("grpo.py", grpo_flags, f"{out}/grpo")
    exact = ["--init_from", f"{verifier}/ckpt.pt", "--policy", f"{sft}/ckpt.pt", "--digits", "2", "--ops", "+-"]
    exact += ["--best_of", QUICK_BEST_OF if args.quick else EXACT_BEST_OF, "--seed", seed]
    exact += ["--eval_size", str(quick.get("rl", RL)["eval_size"])]
    bon = run("reward_model.py", exact, f"{out}/best_of_n")
    return sft, verifier, grpo, bon


def read_json(path):
    with open(path) as f:
        return json.load(f)


def main():
    args = parse_args("loop_seeds", __doc__.splitlines()[0])
    runs = {seed: pipeline(args, seed) for seed in args.seeds}
    columns = {}
    for seed, (sft, verifier, grpo, _) in runs.items():
        sft_eval = [r for r in metrics(sft) if "eval/accuracy" in r][-1]
        verdicts = read_json(f"{verifier}/final_results.json")
        rows = {r["n"]: r for r in read_json(f"{grpo}/best_of_n.json")}
        top = max(n for n in rows if n <= 16)
        evals = [r for r in metrics(grpo) if "eval/sample_accuracy" in r]
        first, end = evals[0], evals[-1]
        columns[seed] = [
            f"{sft_eval['eval/accuracy']:.3f} ({int(sft_eval['eval/n_problems'])} problems)",
            f"{verdicts['auc']:.3f}",
            f"{verdicts['auc_per_problem']:.3f} ({verdicts['auc_problems']} problems)",
            f"{rows[1]['gold_accuracy']:.3f} -> {rows[top]['gold_accuracy']:.3f} (n = {top})",
            f"{first['eval/sample_accuracy']:.3f} -> {end['eval/sample_accuracy']:.3f}",
            f"{first['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f}",
        ]
    names = [
        "SFT greedy accuracy (gpt.py's eval/accuracy)",
        "verifier AUC, pooled (eval/auc)",
        "verifier AUC within a problem (eval/auc_per_problem)",
        "best-of-1 -> best-of-16 gold accuracy",
        f"GRPO's sampled gold accuracy, step 0 -> {end['step']}",
        f"GRPO's greedy gold accuracy, step 0 -> {end['step']}",
    ]
    header = ["measure", *[f"seed {s}" for s in columns]]
    print_table(header, [[name, *[columns[s][i] for s in columns]] for i, name in enumerate(names)])

    exact = [read_json(f"{bon}/best_of_n.json") for (*_, bon) in runs.values()]
    table = []
    for i, row in enumerate(exact[0]):
        gold = [e[i]["gold"] for e in exact]
        proxy = [e[i]["proxy"] for e in exact]
        kl = [e[i]["kl"] for e in exact]
        table.append([row["n"], fmt(gold), fmt(proxy, 2), fmt(kl, 2), f"{row['kl_bound']:.2f}"])
    print_table(["n", "gold accuracy", "proxy (verifier's score)", "exact KL (nats)", "bound log n - (n-1)/n"], table)


if __name__ == "__main__":
    main()
