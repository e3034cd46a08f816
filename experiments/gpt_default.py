"""Reruns docs/gpt.md's "default run" table: `python gpt.py` (char-level tiny Shakespeare, 4 layers, 128 wide,
1,500 steps of 32 x 128 characters) per seed, and prints its final validation and training loss and wall time.

    python experiments/gpt_default.py                 # the documented run: seed 1337, gpt.py's default (~6 min)
    python experiments/gpt_default.py --seeds 1 2 3   # mean +- s.e. over three seeds
    python experiments/gpt_default.py --quick         # a tiny model for a few steps: does it still run?
"""

import os

from common import final_results, fmt, parse_args, print_table, run

args = parse_args("gpt_default", __doc__, seeds=(1337,))
flags = []
if args.quick:
    flags = ["--max_steps", "20", "--eval_every", "10", "--eval_iters", "2", "--n_layer", "1", "--n_embd", "32"]
    flags += ["--block_size", "32", "--batch_size", "4", "--sample_tokens", "16"]
results = []
for seed in args.seeds:
    out_dir = run("gpt.py", [*flags, "--seed", seed], os.path.join(args.out, f"seed{seed}"))
    results.append(final_results(out_dir))
row = [
    "`python gpt.py`",
    len(args.seeds),
    fmt([r["final_val_loss"] for r in results]),
    fmt([r["final_train_loss"] for r in results]),
    fmt([r["wall_time_s"] for r in results], 0),
]
print_table(["run", "seeds", "val loss (nats/char)", "train loss", "wall time (s)"], [row])
