"""The SFT recipe's seed table of docs/rlhf_loop.md: the RLHF loop's SFT command (gpt.py on 2-digit `+`/`-`
arithmetic) at seeds 1 to 5, its greedy exact answers on the 461 held-out problems, validation loss and wall time.

    python experiments/sft_seeds.py           # 5 SFT runs (seeds 1-3 are the loop's own: the default --out is its)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import final_results, fmt, metrics, parse_args, print_table, run  # noqa: E402
from rlhf_loop import SFT, flags, quick  # noqa: E402


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0], seeds=(1, 2, 3, 4, 5))  # the loop's SFT folders
    rows = []
    accuracy = []
    wall = []
    for seed in args.seeds:
        folder = run("gpt.py", flags(SFT, quick(args, "sft")) + ["--seed", seed], f"{args.out}/seed{seed}/sft")
        last = [r for r in metrics(folder) if "eval/accuracy" in r][-1]
        results = final_results(folder)
        accuracy.append(last["eval/accuracy"])
        wall.append(results["wall_time_s"])
        problems = int(last["eval/n_problems"])
        rows.append([seed, f"{accuracy[-1]:.3f}", problems, f"{results['final_val_loss']:.4f}", f"{wall[-1]:.0f}"])
    rows.append(["mean +- s.e.", fmt(accuracy), "", "", fmt(wall, 0)])
    rows.append(["lowest", f"{min(accuracy):.3f}", "", "", ""])
    header = ["seed", "greedy exact answers (eval/accuracy)", "held-out problems", "validation loss", "wall time (s)"]
    print_table(header, rows)


if __name__ == "__main__":
    main()
