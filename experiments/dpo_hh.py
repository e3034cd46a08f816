"""Reruns docs/dpo.md's table "the DPO family on HH-RLHF": an SFT model made by gpt.py on the Assistant turns of an
HH-RLHF file, then 40 steps of 8 pairs of dpo.py from it with each of four losses (sigmoid, ipo, simpo, kto).

    python experiments/dpo_hh.py --data_path hh-rlhf-harmless-base-test.jsonl.gz   # about 30 min on 2 cores

--data_path is a local .jsonl/.jsonl.gz of HH-RLHF records (the table used the harmless-base test file, 2,312
dialogues); without it the scripts read Anthropic/hh-rlhf from the hub. --quick writes a tiny HH-shaped file of its
own and trains for a few steps (no network).
"""

import os

from common import final_results, fmt, metrics, parse_args, print_table, run, tiny_hh

LOSSES = [  # (row, flags)
    ("sigmoid, beta 0.1", ["--loss_type", "sigmoid", "--beta", "0.1"]),
    ("ipo, beta 0.1", ["--loss_type", "ipo", "--beta", "0.1"]),
    ("simpo, beta 2, gamma 1", ["--loss_type", "simpo", "--beta", "2", "--gamma", "1"]),
    ("kto, beta 0.1", ["--loss_type", "kto", "--beta", "0.1"]),
]


def both(first, last, key, digits=3):
    """A metric at the first and at the last evaluation, over seeds: "start -> end"."""
    return f"{fmt([r[key] for r in first], digits)} -> {fmt([r[key] for r in last], digits)}"


def main():
    extra = {"--data_path": ("", "local .jsonl/.jsonl.gz of HH-RLHF records (default: the hub)")}
    args = parse_args("dpo_hh", __doc__.splitlines()[0], seeds=(1337,), extra=extra)
    data_path = args.data_path
    sft = ["--block_size", "256", "--batch_size", "16", "--max_steps", "220", "--warmup_steps", "40", "--lr", "1e-3"]
    sft += ["--min_lr", "1e-4", "--eval_every", "110", "--eval_iters", "8"]
    dpo = ["--lr", "2e-4", "--min_lr", "2e-5", "--warmup_steps", "4", "--max_steps", "40", "--eval_every", "20"]
    dpo += ["--log_every", "10", "--device", "cpu"]
    losses = LOSSES
    if args.quick:
        os.makedirs(args.out, exist_ok=True)
        data_path = tiny_hh(f"{args.out}/tiny_hh.jsonl")
        sft = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--batch_size", "4"]
        sft += ["--max_steps", "4", "--warmup_steps", "1", "--eval_every", "4", "--eval_iters", "1"]
        sft += ["--num_samples", "1", "--sample_tokens", "2"]
        dpo = ["--lr", "2e-4", "--warmup_steps", "1", "--max_steps", "2", "--eval_every", "2", "--batch_size", "4"]
        dpo += ["--num_samples", "1", "--sample_tokens", "2", "--device", "cpu"]
        losses = LOSSES[:1]
    data = ["--data_path", data_path] if data_path else []
    table = []
    for name, flags in losses:
        runs = []
        for seed in args.seeds:
            sft_dir = run("gpt.py", ["--data", "hh_sft", *data, *sft, "--seed", seed], f"{args.out}/sft_s{seed}")
            init = ["--init_from", f"{sft_dir}/ckpt.pt", "--seed", seed]
            runs.append(run("dpo.py", [*data, *init, *dpo, *flags], f"{args.out}/{flags[1]}_s{seed}"))
        first = [[r for r in metrics(d) if "eval/loss" in r][0] for d in runs]
        last = [[r for r in metrics(d) if "eval/loss" in r][-1] for d in runs]

        logps = f"{both(first, last, 'eval/chosen_logp', 1)} / {both(first, last, 'eval/rejected_logp', 1)}"
        table.append(
            [
                name,
                both(first, last, "eval/reward_acc"),
                both(first, last, "eval/margin", 4),
                fmt([r["eval/logratio_acc"] for r in last]),
                fmt([r["eval/logratio_margin"] for r in last], 2),
                logps,
                fmt([final_results(d)["wall_time_s"] for d in runs], 0) + " s",
            ]
        )
    header = ["loss", "reward accuracy, step 0 -> end", "margin (its reward)", "DPO log-ratio accuracy"]
    header += ["log-ratio margin h (nats)", "log p chosen / rejected, step 0 -> end", "wall time of the run"]
    print_table(header, table)


if __name__ == "__main__":
    main()
