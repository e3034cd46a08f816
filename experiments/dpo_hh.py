"""Reruns docs/dpo.md's table "the DPO family on HH-RLHF": an SFT model made by gpt.py on the Assistant turns of an
HH-RLHF file, then 40 steps of 8 pairs of dpo.py from it with each of four losses (sigmoid, ipo, simpo, kto).

    python experiments/dpo_hh.py --data_path hh-rlhf-harmless-base-test.jsonl.gz   # about 30 min on 2 cores

--data_path is a local .jsonl/.jsonl.gz of HH-RLHF records (the table used the harmless-base test file, 2,312
dialogues); without it the scripts read Anthropic/hh-rlhf from the hub. --quick writes a tiny HH-shaped file of its
own and trains for a few steps (no network).
"""

from common import HH_FLAGS, final_results, fmt, hh_data_path, hh_sft, metrics, parse_args, print_table, run

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
    args = parse_args("dpo_hh", __doc__.splitlines()[0], seeds=(1337,), extra=HH_FLAGS)
    dpo = ["--lr", "2e-4", "--min_lr", "2e-5", "--warmup_steps", "4", "--max_steps", "40", "--eval_every", "20"]
    dpo += ["--log_every", "10", "--device", "cpu"]
    losses = LOSSES
    if args.quick:
        dpo = ["--lr", "2e-4", "--warmup_steps", "1", "--max_steps", "2", "--eval_every", "2", "--batch_size", "4"]
        dpo += ["--num_samples", "1", "--sample_tokens", "2", "--device", "cpu"]
        losses = LOSSES[:1]
    data_path = hh_data_path(args)
    data = ["--data_path", data_path] if data_path else []
    table = []
    for name, flags in losses:
        runs = []
        for seed in args.seeds:
            sft_dir = hh_sft(args, data, seed)
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
