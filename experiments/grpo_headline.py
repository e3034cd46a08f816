"""Reruns the table "grpo.py: the headline command" of docs/grpo.md: the next_token task on tiny Shakespeare, a
4-layer, 128-wide character model from scratch, 16 prompts x 8 completions of 70 characters per rank and step on
two processes, 200 steps, every other setting at its default; the metrics at steps 0, 25, 100 and 200.

    python experiments/grpo_headline.py   # torchrun --standalone --nproc_per_node=2 grpo.py --horizon 70 --device cpu
                                          # at seeds 1, 2, 3: mean +- s.e. over the seeds

--quick runs a one-layer model for 4 steps in one process.
"""

import torch.distributed.run
from common import fmt, metrics, parse_args, print_table, run

args = parse_args("grpo_headline", __doc__)

if args.quick:
    script = "grpo.py"
    flags = ["--horizon", 8, "--batch_size", 2, "--group_size", 4, "--max_steps", 4, "--eval_every", 2]
    flags += ["--eval_size", 8, "--n_layer", 1, "--n_head", 2, "--n_embd", 32, "--device", "cpu"]
    steps = [0, 2, 4]
else:
    script = torch.distributed.run.__file__  # torchrun, as a script
    flags = ["--standalone", "--nproc_per_node=2", "grpo.py", "--horizon", 70, "--device", "cpu"]
    steps = [0, 25, 100, 200]

runs = [run(script, [*flags, "--seed", seed], f"{args.out}/seed{seed}") for seed in args.seeds]


def at(out_dir, name, step):
    """The value of a metric logged at the last step <= step (rl/ metrics end at step max_steps - 1)."""
    return [row[name] for row in metrics(out_dir) if name in row and row["step"] <= step][-1]


ROWS = [
    ("rl/reward_mean (matched characters per position)", "rl/reward_mean"),
    ("rl/zero_std_frac (groups without signal)", "rl/zero_std_frac"),
    ("eval/next_token_acc", "eval/next_token_acc"),
    ("eval/greedy_match", "eval/greedy_match"),
    ("eval/val_loss (nats per character)", "eval/val_loss"),
    ("rl/entropy (nats)", "rl/entropy"),
]
table = []
for label, name in ROWS:
    table.append([label] + [fmt([at(out, name, step) for out in runs]) for step in steps])
print_table(["step"] + [str(step) for step in steps], table)
