"""Reruns docs/rookworld_grpo.md's table "GRPO on the RookWorld chess tasks": 2000 P: and A: lines from games of
Stockfish (rookworld_grpo.py --make_data), a small GPT-2 BPE model trained on them by gpt.py, then 20 GRPO steps of
8 prompts x 8 samples, evaluated greedily on 32 held-out P: and 32 held-out A: prompts at steps 0, 10 and 20.

    python experiments/rookworld.py --stockfish /usr/games/stockfish   # about 27 min on 2 cores

--stockfish PATH is the engine that plays the games and annotates P: lines (default /usr/games/stockfish when it
exists); without one, --make_data plays at random and annotates by a one-ply material count, which is not chess
knowledge and gives other numbers. --quick: 60 random-play lines, a tiny model, 2 steps (no Stockfish needed).
"""

import os

from common import fmt, metrics, parse_args, print_table, run

ROWS = [  # (row, metric names shown as "a / b" when two)
    ("P: format (parses)", ["eval/p_format"]),
    ("P: best move legal", ["eval/p_legal_best"]),
    ("P: best-move accuracy / top-5 accuracy", ["eval/p_best_acc", "eval/p_top5_acc"]),
    ("P: reward", ["eval/p_reward"]),
    ("A: format (parses)", ["eval/a_format"]),
    ("A: exact new FEN / whole line exact", ["eval/a_fen_acc", "eval/a_line_acc"]),
    ("A: both flags right", ["eval/a_flags_acc"]),
    ("A: reward", ["eval/a_reward"]),
]


def main():
    default_engine = "/usr/games/stockfish" if os.path.exists("/usr/games/stockfish") else ""
    extra = {"--stockfish": (default_engine, "path of a Stockfish binary (annotates the made data)")}
    args = parse_args("rookworld", __doc__.splitlines()[0], seeds=(1337,), extra=extra)
    stockfish = args.stockfish
    make = ["--make_data", "2000"]
    sft = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "224", "--batch_size", "8"]
    sft += ["--max_steps", "600", "--lr", "5e-3", "--min_lr", "2e-4", "--warmup_steps", "20", "--eval_every", "200"]
    sft += ["--eval_iters", "4"]
    grpo = ["--batch_size", "8", "--group_size", "8", "--max_steps", "20", "--eval_every", "10", "--eval_size", "32"]
    grpo += ["--lr", "1e-4", "--min_lr", "0", "--warmup_steps", "2"]
    if args.quick:
        stockfish = ""
        make = ["--make_data", "60", "--illegal_frac", "0.2"]
        sft = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "192", "--batch_size", "4"]
        sft += ["--max_steps", "2", "--eval_every", "2", "--eval_iters", "1", "--num_samples", "1"]
        sft += ["--sample_tokens", "2"]
        grpo = ["--batch_size", "2", "--group_size", "2", "--horizon", "40", "--max_steps", "2", "--eval_every", "1"]
        grpo += ["--eval_size", "2", "--lr", "1e-3", "--device", "cpu"]
    if not stockfish:
        print("no Stockfish: the data are random play annotated by a material count (not the table's data)")
    os.makedirs(args.out, exist_ok=True)
    data = f"{args.out}/rookworld_lines.txt"
    if not os.path.exists(data):  # --make_data never overwrites a file
        engine = ["--stockfish", stockfish] if stockfish else []
        run("rookworld_grpo.py", [*make, "--out", data, *engine], f"{args.out}/make_data")
    evals = {}  # step -> the evaluation rows of every seed
    for seed in args.seeds:
        sft_flags = ["--data", data, "--tokenizer", "gpt2", *sft, "--seed", seed]
        sft_dir = run("gpt.py", sft_flags, f"{args.out}/sft_s{seed}")
        init = ["--init_from", f"{sft_dir}/ckpt.pt", "--data_path", data, "--seed", seed]
        grpo_dir = run("rookworld_grpo.py", [*init, *grpo], f"{args.out}/grpo_s{seed}")
        for row in metrics(grpo_dir):
            if "eval/p_format" in row:
                evals.setdefault(row["step"], []).append(row)
    steps = sorted(evals)
    table = []
    for name, keys in ROWS:
        cells = []
        for step in steps:
            cells.append(" / ".join(fmt([row[key] for row in evals[step]]) for key in keys))
        table.append([name, *cells])
    print_table(["held out, greedy", *[f"step {step}" for step in steps]], table)


if __name__ == "__main__":
    main()
