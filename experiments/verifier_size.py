"""The verifier-size table of docs/rlhf_loop.md (Gao et al. 2022, Fig. 3 in miniature), from the SFT models of
experiments/rlhf_loop.py (the same run folders: the default --out is that experiment's).

    python experiments/verifier_size.py

Verifiers of three widths learn the same answers of the loop's SFT model. As Gao et al.'s reward models start from
pretrained models of each size, each starts from an SFT model of its width (gpt.py with the loop's recipe at
--n_embd 64 and 96; at 128, the loop's own verifier): reward_model.py --task orm --samples_from SFT --init_from
SFT_WIDTH. Then best-of-n under each, GRPO on each at --beta_kl 0, and Gao et al.'s forms fitted to the seeds' mean
curve of each: best-of-n R(d) = d (alpha - beta d), GRPO R(d) = d (alpha - beta log d), R the gold gained over the
SFT model (all held-out problems) and d = sqrt(KL to it).
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, mean_se, parse_args, print_table, run  # noqa: E402
from overoptimization import curve, gao_fit  # noqa: E402
from rlhf_loop import GRPO, SFT, VERIFIER, best_of_n, flags, quick, read_json, rl_flags, start  # noqa: E402

WIDTHS = [64, 96, 128]  # n_embd of the verifiers (4 layers, 4 heads); 128 is the loop's SFT model and verifier


def sweep(args):
    """{seed: {label: run folder}} of every run (finished ones are kept)."""
    runs = {}
    for seed in args.seeds:
        sft, loop_verifier = start(args, seed)
        out = f"{args.out}/seed{seed}"
        grpo_beta0 = flags({**GRPO, "beta_kl": 0}, quick(args, "grpo")) + ["--seed", seed]
        folders = {}
        for width in WIDTHS[1:] if args.quick else WIDTHS:  # --quick: one width besides the loop's
            if width == SFT["n_embd"]:  # the loop's verifier: overoptimization.py's runs
                folders[f"best-of-n, width {width}"] = best_of_n(args, seed, sft, loop_verifier)
                rl = rl_flags(args, sft, loop_verifier) + grpo_beta0
                folders[f"GRPO, width {width}"] = run("grpo.py", rl, f"{out}/grpo_beta0")
                continue
            sft_width = flags({**SFT, "n_embd": width}, quick(args, "sft")) + ["--seed", seed]
            backbone = run("gpt.py", sft_width, f"{out}/sft_w{width}")
            verifier_flags = flags(VERIFIER, quick(args, "verifier")) + ["--samples_from", sft, "--seed", seed]
            verifier_flags += ["--init_from", f"{backbone}/ckpt.pt"]
            rm = run("reward_model.py", verifier_flags, f"{out}/verifier_w{width}") + "/ckpt.pt"
            folders[f"best-of-n, width {width}"] = best_of_n(args, seed, sft, rm, f"best_of_n_w{width}")
            rl = rl_flags(args, sft, rm) + grpo_beta0
            folders[f"GRPO, width {width}"] = run("grpo.py", rl, f"{out}/grpo_w{width}")
        runs[seed] = folders
    return runs


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0])  # the loop's runs are this sweep's start
    runs = sweep(args)
    rows = []
    for label in next(iter(runs.values())):
        points = curve([runs[seed][label] for seed in runs])
        xs = list(points)
        bon = label.startswith("best-of-n")
        gold_key, kl_key = ("gold", "kl") if bon else ("eval/sample_accuracy", "eval/sample_kl")
        gold = [mean_se([row[gold_key] for row in points[x]])[0] for x in xs]
        d = [math.sqrt(max(mean_se([row[kl_key] for row in points[x]])[0], 0.0)) for x in xs]
        alpha, beta, r2 = gao_fit(d, [g - gold[0] for g in gold], "bon" if bon else "rl")
        width = int(label.rsplit(" ", 1)[1])
        name = "verifier" if width == SFT["n_embd"] else f"verifier_w{width}"
        verifiers = [read_json(f"{args.out}/seed{seed}/{name}/final_results.json") for seed in runs]
        auc = fmt([v["auc_per_problem"] for v in verifiers])
        peak = f"{max(gold):.3f} at {'n = ' if bon else 'step '}{xs[gold.index(max(gold))]}"
        rows.append([label, auc, f"{alpha:.3f}", f"{beta:.3f}", f"{r2:.2f}", peak])
    header = ["curve", "verifier AUC within a problem", "alpha", "beta", "R^2", "gold peak of the mean curve"]
    print_table(header, rows)


if __name__ == "__main__":
    main()
