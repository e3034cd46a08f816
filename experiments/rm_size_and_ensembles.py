"""The verifier-size and ensemble tables of docs/rlhf_loop.md, from the SFT models of experiments/rlhf_loop.py (the
same run folders: the default --out is that experiment's).

    python experiments/rm_size_and_ensembles.py

Verifier size (Gao et al. 2022, Fig. 3 in miniature): verifiers of three widths trained on the same answers of the
loop's SFT model. As Gao et al.'s reward models start from pretrained models of each size, each starts from an SFT
model of its width (gpt.py with the loop's recipe at --n_embd 64 and 96; at 128, the loop's own verifier):
reward_model.py --task orm --samples_from SFT --init_from SFT_WIDTH. Then best-of-n under each and GRPO on each at
--beta_kl 0, and Gao et al.'s forms fitted to each curve: best-of-n R(d) = d (alpha - beta d), GRPO
R(d) = d (alpha - beta log d), R the gold gained over the SFT model and d = sqrt(KL).

Ensembles (Coste et al. 2023): the loop's verifier and two more trained the same way at other seeds, GRPO at
--beta_kl 0 on their mean, their minimum (worst-case optimisation) and their mean minus 0.5 times their variance
(uncertainty-weighted optimisation), against GRPO on the loop's verifier alone (overoptimization.py's run).

Gold is on half b of the held-out problems, a peak step picked on half a, mean +- s.e. over the whole-pipeline seeds.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, mean_se, parse_args, print_table, run  # noqa: E402
from overoptimization import curve, gao_fit  # noqa: E402
from rlhf_loop import GRPO, SFT, VERIFIER, best_of_n, flags, quick, read_json, rl_flags, start  # noqa: E402

WIDTHS = [64, 96, 128]  # n_embd of the verifiers (4 layers, 4 heads); 128 is the loop's SFT model and verifier
ENSEMBLES = ["mean", "min", "uwo"]


def verifier(args, seed, sft, name, extra):
    """A verifier on the SFT model's answers (reward_model.py --task orm --samples_from): its ckpt.pt."""
    verifier_flags = flags(VERIFIER, quick(args, "verifier")) + ["--samples_from", sft, *extra]
    return run("reward_model.py", verifier_flags, f"{args.out}/seed{seed}/{name}") + "/ckpt.pt"


def sweep(args):
    """{seed: {label: run folder}} of every run (finished ones are kept)."""
    runs = {}
    for seed in args.seeds:
        sft, loop_verifier = start(args, seed)
        out = f"{args.out}/seed{seed}"
        grpo_beta0 = flags({**GRPO, "beta_kl": 0}, quick(args, "grpo")) + ["--seed", seed]
        folders = {
            "single verifier": run("grpo.py", rl_flags(args, sft, loop_verifier) + grpo_beta0, f"{out}/grpo_beta0")
        }
        for width in WIDTHS:
            if width == SFT["n_embd"]:  # the loop's verifier, its best-of-n and GRPO at --beta_kl 0
                rm = loop_verifier
                folders[f"best-of-n, width {width}"] = best_of_n(args, seed, sft, rm)
                folders[f"GRPO, width {width}"] = folders["single verifier"]
                continue
            backbone = run(
                "gpt.py", flags({**SFT, "n_embd": width}, quick(args, "sft")) + ["--seed", seed], f"{out}/sft_w{width}"
            )
            rm = verifier(args, seed, sft, f"verifier_w{width}", ["--init_from", f"{backbone}/ckpt.pt", "--seed", seed])
            folders[f"best-of-n, width {width}"] = best_of_n(args, seed, sft, rm, f"best_of_n_w{width}")
            folders[f"GRPO, width {width}"] = run(
                "grpo.py", rl_flags(args, sft, rm) + grpo_beta0, f"{out}/grpo_w{width}"
            )
        members = [loop_verifier] + [
            verifier(args, seed, sft, f"verifier_s{k}", ["--seed", 100 * k + seed]) for k in (1, 2)
        ]
        for kind in ENSEMBLES[:1] if args.quick else ENSEMBLES:
            ensemble = (
                rl_flags(args, sft, ",".join(members)) + grpo_beta0 + ["--rm_ensemble", kind, "--uwo_lambda", 0.5]
            )
            folders[f"ensemble, {kind}"] = run("grpo.py", ensemble, f"{out}/grpo_ensemble_{kind}")
        runs[seed] = folders
    return runs


def peak_and_end(points):
    """(peak step picked on the seeds' mean of half a, end step) of a run's curve."""
    steps = list(points)
    mean_a = [mean_se([row["eval/sample_accuracy_a"] for row in points[s]])[0] for s in steps]
    return steps[mean_a.index(max(mean_a))], steps[-1]


def gold_b(points, step):
    return fmt([row["eval/sample_accuracy_b"] for row in points[step]])


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0])  # the loop's runs are this sweep's start
    runs = sweep(args)
    labels = list(next(iter(runs.values())))
    curves = {label: curve([runs[seed][label] for seed in runs]) for label in labels}

    size_rows = []
    for label in labels:
        if "width" not in label:
            continue
        points = curves[label]
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
        size_rows.append([label, auc, f"{alpha:.3f}", f"{beta:.3f}", f"{r2:.2f}", peak])
    header = ["curve", "verifier AUC within a problem", "alpha", "beta", "R^2", "gold peak of the mean curve"]
    print_table(header, size_rows)

    ensemble_rows = []
    for label in ["single verifier"] + [label for label in labels if label.startswith("ensemble")]:
        points = curves[label]
        peak, end = peak_and_end(points)
        kl = fmt([row["eval/sample_kl"] for row in points[end]], 2)
        ensemble_rows.append(
            [label, gold_b(points, 0), f"{gold_b(points, peak)} (step {peak})", gold_b(points, end), kl]
        )
    print_table(
        ["GRPO at --beta_kl 0 on", "gold at step 0", "gold at the peak", "gold at the end", "KL at the end"],
        ensemble_rows,
    )


if __name__ == "__main__":
    main()
