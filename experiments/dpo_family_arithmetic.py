"""Reruns docs/dpo.md's table "the DPO family on arithmetic": forms of the family beside plain DPO, each trained on
gold-labelled pairs of an arithmetic SFT model's own answers (a right answer chosen, a wrong one rejected) and scored
by greedy exact answers on held-out problems (a problem is held out iff zlib.crc32(prompt) % 10 == 0).

    python experiments/dpo_family_arithmetic.py   # one SFT (3 min), then 8 forms x 3 seeds of about 2 min each

No data to download: gpt.py and dpo.py make the problems. --quick: a tiny SFT, two forms, a few steps.
"""

import statistics

from common import fmt, metrics, parse_args, print_table, run

FORMS = [  # (row, flags added to the common dpo.py command)
    ("DPO (sigmoid, reverse KL)", []),
    ("f-DPO, forward KL (Wang et al. 2023)", ["--f_divergence", "forward_kl"]),
    ("f-DPO, Jensen-Shannon", ["--f_divergence", "js"]),
    ("f-DPO, alpha-divergence", ["--f_divergence", "alpha", "--f_alpha", "0.5"]),
    ("AOT, paired (Melnyk et al. 2024)", ["--loss_type", "aot"]),
    ("AOT, unpaired", ["--loss_type", "aot_unpaired"]),
    ("DPO on per-token mean log-ratios", ["--loss_type", "sigmoid_norm"]),
    ("LD-DPO (Liu et al. 2024)", ["--ld_alpha", "0.5"]),
]


def main():
    args = parse_args("dpo_family_arithmetic", __doc__.splitlines()[0])
    sft = ["--data", "arithmetic", "--tokenizer", "char", "--digits", "2", "--ops", "+-", "--n_layer", "3"]
    sft += ["--n_head", "4", "--n_embd", "96", "--block_size", "32", "--batch_size", "64", "--lr", "3e-3"]
    sft += ["--min_lr", "2e-4", "--warmup_steps", "50", "--max_steps", "2000", "--eval_every", "1000"]
    dpo = ["--data", "arithmetic", "--digits", "2", "--ops", "+-", "--pair_prompts", "1024", "--lr", "3e-4"]
    dpo += ["--min_lr", "1e-6", "--sft_weight", "1", "--max_steps", "150", "--eval_every", "25", "--eval_size", "300"]
    forms = FORMS
    if args.quick:
        sft = ["--data", "arithmetic", "--tokenizer", "char", "--digits", "1", "--ops", "+-", "--n_layer", "1"]
        sft += ["--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "32", "--lr", "3e-3"]
        sft += ["--warmup_steps", "2", "--max_steps", "20", "--eval_every", "20", "--eval_iters", "1"]
        sft += ["--num_samples", "1", "--sample_tokens", "2"]
        dpo = ["--data", "arithmetic", "--digits", "1", "--ops", "+-", "--pair_prompts", "32", "--lr", "3e-4"]
        dpo += ["--sft_weight", "1", "--max_steps", "2", "--eval_every", "1", "--eval_size", "30"]
        dpo += ["--num_samples", "1"]
        forms = FORMS[:2]
    sft_dir = run("gpt.py", sft, f"{args.out}/sft")
    max_steps = int(dpo[dpo.index("--max_steps") + 1])
    steps = [0, max_steps // 2, max_steps]
    table = []
    for i, (name, flags) in enumerate(forms):
        acc = {step: [] for step in steps}
        step_ms = []
        for seed in args.seeds:
            out_dir = run(
                "dpo.py",
                [*dpo, "--init_from", f"{sft_dir}/ckpt.pt", *flags, "--seed", seed],
                f"{args.out}/form{i}_s{seed}",
            )
            rows = metrics(out_dir)
            for row in rows:
                if row["step"] in acc and "eval/accuracy" in row:
                    acc[row["step"]].append(row["eval/accuracy"])
            step_ms += [row["perf/step_ms"] for row in rows if "perf/step_ms" in row]
        flag = f"`{' '.join(flags)}`" if flags else ""
        table.append([name, flag, *[fmt(acc[step]) for step in steps], f"{statistics.median(step_ms):.0f} ms"])
    header = ["form", "flag", *[f"accuracy, step {step}" for step in steps], "median step"]
    print_table(header, table)


if __name__ == "__main__":
    main()
