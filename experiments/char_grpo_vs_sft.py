"""Reruns the table "GRPO from reward alone against the supervised baseline" of docs/char_grpo.md: char_grpo.py with
its default configuration (GRPO on tiny Shakespeare from scratch), then the supervised baseline on the same model,
data and number of characters (`--supervised`), as `python char_grpo.py --compare` does in one run. Validation
next-character accuracy and greedy 16-character match at every evaluation, against the characters seen.

    python experiments/char_grpo_vs_sft.py              # seed 1337, the char_grpo.py default the table used
    python experiments/char_grpo_vs_sft.py --seeds 1 2 3   # mean +- s.e. over three seeds

--quick runs a one-layer model for 4 steps.
"""

from common import final_results, fmt, metrics, parse_args, print_table, run

args = parse_args("char_grpo_vs_sft", __doc__, seeds=(1337,))

flags = ["--device", "cpu"]
if args.quick:
    flags += ["--max_steps", 4, "--eval_every", 2, "--eval_size", 8, "--batch_size", 2, "--group_size", 4]
    flags += ["--n_layer", 1, "--n_head", 2, "--n_embd", 32]

grpo = [run("char_grpo.py", [*flags, "--seed", s], f"{args.out}/grpo_seed{s}") for s in args.seeds]
sft = [run("char_grpo.py", [*flags, "--supervised", "--seed", s], f"{args.out}/supervised_seed{s}") for s in args.seeds]


def evals(out_dir):
    """{step: the evaluation row}."""
    return {row["step"]: row for row in metrics(out_dir) if "eval/greedy_match" in row}


grpo_evals = [evals(out) for out in grpo]
sft_evals = [evals(out) for out in sft]
table = []
for step in sorted(grpo_evals[0]):
    row = [step, f"{grpo_evals[0][step]['rl/tokens']:,.0f}"]
    for name in ("eval/next_token_acc", "eval/greedy_match"):
        row.append(fmt([e[step][name] for e in grpo_evals]))
        row.append(fmt([e[step][name] for e in sft_evals]))
    table.append(row)
header = ["step", "characters", "GRPO next-char acc", "supervised next-char acc"]
print_table(header + ["GRPO greedy match", "supervised greedy match"], table)

final = []
for name, outs in (("GRPO", grpo), ("supervised", sft)):
    results = [final_results(out) for out in outs]
    row = [name, fmt([r["bpc"] for r in results], 2), fmt([r["wall_time_s"] for r in results], 0)]
    final.append(row)
print_table(["run", "val bits per character, final", "wall time (s)"], final)
