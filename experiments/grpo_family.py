"""Reruns the table "the GRPO family on arithmetic" of docs/grpo.md: first the 2-digit `+`/`-` SFT model of the
RLHF loop (gpt.py, 2,000 steps), then from it 100 GRPO steps of 32 prompts x 8 answers at lr 1e-4 on the exact-answer
reward for every row (loss type and flags) and seed; greedy exact answers on the held-out problems at steps 0, 25,
50, 75 and 100, mean +- s.e. over the seeds, and the median step time.

    python experiments/grpo_family.py                  # 1 SFT run + 8 rows x 3 seeds (seeds 1, 2, 3)

--quick trains a one-layer SFT model for 20 steps and runs 2 rows for 2 steps, one seed.
"""

import statistics

from common import fmt, metrics, parse_args, print_table, run

args = parse_args("grpo_family", __doc__)

SFT = ["--data", "arithmetic", "--tokenizer", "char", "--digits", 2, "--ops", "+-", "--n_layer", 3, "--n_head", 4]
SFT += ["--n_embd", 96, "--block_size", 32, "--batch_size", 64, "--lr", 3e-3, "--warmup_steps", 50]
SFT += ["--min_lr", 2e-4, "--max_steps", 2000, "--eval_every", 1000]
G = ["--task", "arithmetic", "--digits", 2, "--ops", "+-", "--horizon", 6, "--batch_size", 32, "--group_size", 8]
G += ["--max_steps", 100, "--lr", 1e-4, "--min_lr", 1e-4, "--warmup_steps", 5, "--eval_every", 25, "--eval_size", 300]
steps = [0, 25, 50, 75, 100]
ROWS = [
    ("`grpo`", ["--loss_type", "grpo"]),
    ("`dr_grpo`", ["--loss_type", "dr_grpo", "--scale_rewards", "none"]),
    ("`dapo`", ["--loss_type", "dapo", "--clip_eps_high", 0.28]),
    ("`sapo`", ["--loss_type", "sapo"]),
    ("`luspo`", ["--loss_type", "luspo"]),
    ("`dapo` + 80/20 entropy mask", ["--loss_type", "dapo", "--clip_eps_high", 0.28, "--top_entropy_quantile", 0.2]),
    ("`grpo`, 4 updates per batch", ["--loss_type", "grpo", "--num_iterations", 4]),
    ("the same + off-policy masking", ["--loss_type", "grpo", "--num_iterations", 4, "--off_policy_mask", 0.05]),
]
if args.quick:
    SFT += ["--n_layer", 1, "--n_head", 2, "--n_embd", 32, "--batch_size", 16, "--max_steps", 20, "--eval_every", 20]
    G += ["--batch_size", 4, "--group_size", 4, "--max_steps", 2, "--eval_every", 1, "--eval_size", 20]
    steps = [0, 1, 2]
    ROWS = [ROWS[5], ROWS[7]]

sft = run("gpt.py", [*SFT, "--device", "cpu"], f"{args.out}/sft2")  # one SFT model, as the table used
G += ["--init_from", f"{sft}/ckpt.pt", "--device", "cpu"]

table = []
for name, flags in ROWS:
    tag = "_".join(str(f).lstrip("-") for f in flags)
    outs = [run("grpo.py", [*G, *flags, "--seed", s], f"{args.out}/{tag}_seed{s}") for s in args.seeds]
    accuracy = {step: [] for step in steps}
    step_ms = []
    for out in outs:
        for row in metrics(out):
            if "eval/accuracy" in row:
                accuracy[row["step"]].append(row["eval/accuracy"])
            if "perf/step_ms" in row:
                step_ms.append(row["perf/step_ms"])
    cells = [fmt(accuracy[step]) for step in steps]
    table.append([name, " ".join(map(str, flags[2:])), *cells, f"{statistics.median(step_ms):,.0f} ms"])
print_table(["loss", "flags", *[f"greedy accuracy, step {s}" for s in steps], "median step"], table)
