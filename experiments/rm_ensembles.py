"""The reward-model ensemble table of docs/rlhf_loop.md (Coste et al. 2023), from the SFT models and verifiers of
experiments/rlhf_loop.py (the same run folders: the default --out is that experiment's).

    python experiments/rm_ensembles.py

Three members: the loop's verifier and two more trained the same way at other seeds (reward_model.py --task orm
--samples_from SFT --seed 100 + S, 200 + S). GRPO at --beta_kl 0 on their mean, their minimum (worst-case
optimisation) and their mean minus 0.5 times their variance (uncertainty-weighted optimisation), against GRPO on the
loop's verifier alone (overoptimization.py's run). Gold is on half b of the held-out problems with the peak step
picked on the seeds' mean over half a; mean +- s.e. over the whole-pipeline seeds.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, mean_se, parse_args, print_table, run  # noqa: E402
from overoptimization import curve  # noqa: E402
from rlhf_loop import GRPO, VERIFIER, flags, quick, rl_flags, start  # noqa: E402

ENSEMBLES = ["mean", "min", "uwo"]


def sweep(args):
    """{seed: {label: run folder}} of every run (finished ones are kept)."""
    runs = {}
    for seed in args.seeds:
        sft, loop_verifier = start(args, seed)
        out = f"{args.out}/seed{seed}"
        grpo_beta0 = flags({**GRPO, "beta_kl": 0}, quick(args, "grpo")) + ["--seed", seed]
        single = run("grpo.py", rl_flags(args, sft, loop_verifier) + grpo_beta0, f"{out}/grpo_beta0")
        folders = {"single verifier": single}
        members = [loop_verifier]
        for k in (1,) if args.quick else (1, 2):  # --quick: two members, the mean only
            verifier_flags = flags(VERIFIER, quick(args, "verifier")) + ["--samples_from", sft]
            verifier_flags += ["--seed", 100 * k + seed]
            members.append(run("reward_model.py", verifier_flags, f"{out}/verifier_s{k}") + "/ckpt.pt")
        for kind in ENSEMBLES[:1] if args.quick else ENSEMBLES:
            ensemble = rl_flags(args, sft, ",".join(members)) + grpo_beta0
            ensemble += ["--rm_ensemble", kind, "--uwo_lambda", 0.5]
            folders[f"ensemble, {kind}"] = run("grpo.py", ensemble, f"{out}/grpo_ensemble_{kind}")
        runs[seed] = folders
    return runs


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0])  # the loop's runs are this sweep's start
    runs = sweep(args)
    rows = []
    for label in next(iter(runs.values())):
        points = curve([runs[seed][label] for seed in runs])
        steps = list(points)
        mean_a = [mean_se([row["eval/sample_accuracy_a"] for row in points[s]])[0] for s in steps]
        peak, end = steps[mean_a.index(max(mean_a))], steps[-1]  # the peak picked on half a
        gold = {step: fmt([row["eval/sample_accuracy_b"] for row in points[step]]) for step in (0, peak, end)}
        kl = fmt([row["eval/sample_kl"] for row in points[end]], 2)
        rows.append([label, gold[0], f"{gold[peak]} (step {peak})", gold[end], kl])
    header = ["GRPO at --beta_kl 0 on", "gold at step 0", "gold at the peak", "gold at the end", "KL at the end"]
    print_table(header, rows)


if __name__ == "__main__":
    main()
