"""The DPO table of docs/rlhf_loop.md: DPO (with RPO's SFT term) on gold-labelled pairs against pairs judged by the
verifier, from one SFT model of the RLHF loop's earlier recipe (rlhf_loop.EARLIER_SFT, 3 layers of width 96, 2,000
steps, gpt.py's default seed) and its verifier, greedy exact answers on the held-out problems.

    python experiments/dpo_gold_vs_judged.py       # the SFT model, the verifier, 2 x 3 DPO runs of 150 steps

The SFT model samples 8 answers (temperature 1) to each of 1,024 training problems (drawn with the seed); a gold pair
is a right answer (chosen) and a wrong one (rejected) of one problem; with --judge the verifier's highest- and
lowest-scored answers make the pair instead.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import final_results, fmt, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import EARLIER_SFT, QUICK, VERIFIER, flags  # noqa: E402

DPO = dict(
    data="arithmetic", digits=2, ops="+-", pair_prompts=1024, lr=3e-4, min_lr=1e-6, sft_weight=1, max_steps=150,
    eval_every=25, eval_size=300,
)  # fmt: skip
QUICK_DPO = dict(pair_prompts=16, batch_size=4, max_steps=2, eval_every=1, eval_size=16)


def accuracy_at(folder, step):
    return [row["eval/accuracy"] for row in metrics(folder) if row["step"] == step and "eval/accuracy" in row][0]


def main():
    args = parse_args("dpo_gold_vs_judged", __doc__.splitlines()[0])
    sft = run("gpt.py", flags(EARLIER_SFT, QUICK["sft"] if args.quick else None), f"{args.out}/sft") + "/ckpt.pt"
    verifier_flags = flags(VERIFIER, QUICK["verifier"] if args.quick else None) + ["--samples_from", sft]
    verifier = run("reward_model.py", verifier_flags, f"{args.out}/verifier") + "/ckpt.pt"
    dpo = flags(DPO, QUICK_DPO if args.quick else None) + ["--init_from", sft]
    end = QUICK_DPO["max_steps"] if args.quick else DPO["max_steps"]
    rows = []
    for tag, name, extra in [
        ("gold", "gold-labelled", []),
        ("judged", "judged by the verifier (--judge)", ["--judge", verifier]),
    ]:
        folders = [run("dpo.py", dpo + extra + ["--seed", seed], f"{args.out}/{tag}_{seed}") for seed in args.seeds]
        results = [final_results(folder) for folder in folders]
        pairs = [r["train_pairs"] for r in results]
        rows.append(
            [
                name,
                f"{min(pairs)} to {max(pairs)}",
                fmt([r["gold_agreement"] for r in results]),
                fmt([accuracy_at(folder, 0) for folder in folders]),
                fmt([accuracy_at(folder, end // 2) for folder in folders]),
                fmt([accuracy_at(folder, end) for folder in folders]),
            ]
        )
    header = ["pairs", "training pairs", "pairs whose chosen answer gold agrees with", "greedy gold accuracy, step 0",
              str(end // 2), f"{end} (mean +- s.e. of {len(args.seeds)} seeds)"]  # fmt: skip
    print_table(header, rows)


if __name__ == "__main__":
    main()
