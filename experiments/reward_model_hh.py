"""Reruns docs/reward_model.md's table "a preference reward model on HH-RLHF": an SFT model made by gpt.py on the
Assistant turns of an HH-RLHF file, then a Bradley-Terry reward model from it, scored on the held-out pairs.

    python experiments/reward_model_hh.py --data_path hh-rlhf-harmless-base-test.jsonl.gz   # about 25 min on 2 cores

--data_path is a local .jsonl/.jsonl.gz of HH-RLHF records (the table used the harmless-base test file, 2,312
dialogues); without it the scripts read Anthropic/hh-rlhf from the hub. --quick writes a tiny HH-shaped file of its
own and trains for a few steps (no network).
"""

import gzip
import json
import random
import sys

from common import HH_FLAGS, ROOT, final_results, fmt, hh_data_path, hh_sft, metrics, parse_args, print_table, run

sys.path.insert(0, str(ROOT))


def held_out_pairs(data_path):
    """The held-out (prompt, chosen, rejected) pairs reward_model.py scores: 1 record in 20 of a local file (gpt.py's
    hh_sft split), or the hub's test split."""
    import reward_model

    if data_path:
        opener = gzip.open if data_path.endswith(".gz") else open
        with opener(data_path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        order = random.Random(0).sample(range(len(records)), len(records))
        records = [records[i] for i in order[: max(1, len(records) // 20)]]
    else:
        import datasets

        records = datasets.load_dataset("Anthropic/hh-rlhf")["test"].to_list()
    return reward_model.hh_pairs(records)[0]


def shorter_wins(pairs):
    """Accuracy of the rule "the response with fewer GPT-2 tokens is the chosen one" (ties count one half)."""
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    score = 0.0
    for _, chosen, rejected in pairs:
        n_chosen = len(enc.encode(chosen))
        n_rejected = len(enc.encode(rejected))
        score += 1.0 if n_chosen < n_rejected else 0.5 if n_chosen == n_rejected else 0.0
    return score / len(pairs)


def main():
    args = parse_args("reward_model_hh", __doc__.splitlines()[0], seeds=(1337,), extra=HH_FLAGS)
    rm = ["--max_steps", "280", "--warmup_steps", "20", "--eval_every", "20"]
    if args.quick:
        rm = ["--max_steps", "4", "--warmup_steps", "1", "--eval_every", "2", "--batch_size", "4"]
    data_path = hh_data_path(args)
    data = ["--data_path", data_path] if data_path else []
    rows = []
    for seed in args.seeds:
        sft_dir = hh_sft(args, data, seed)
        init = ["--init_from", f"{sft_dir}/ckpt.pt", "--seed", seed]
        rm_dir = run("reward_model.py", [*data, *init, *rm], f"{args.out}/rm_s{seed}")
        res = final_results(rm_dir)
        evals = [r for r in metrics(rm_dir) if "eval/loss" in r]
        acc_name = "eval/reward_acc"
        best = evals[0]
        for row in evals:
            if row[acc_name] > best[acc_name]:
                best = row
        rows.append(
            {
                "sft_val_loss": final_results(sft_dir)["final_val_loss"],
                "acc": evals[-1][acc_name],
                "margin": evals[-1]["eval/margin"],
                "loss": evals[-1]["eval/loss"],
                "best": best[acc_name],
                "best_step": best["step"],
                "n": res["eval_examples"],
            }
        )
    pairs = held_out_pairs(data_path)
    table = [
        ["SFT model's held-out loss (nats per token)", fmt([r["sft_val_loss"] for r in rows], 2)],
        ["accuracy (r_chosen > r_rejected)", fmt([r["acc"] for r in rows])],
        ["mean margin r_chosen - r_rejected", fmt([r["margin"] for r in rows], 2)],
        ["Bradley-Terry loss (chance: log 2 = 0.693)", fmt([r["loss"] for r in rows], 2)],
        ["best accuracy during the run (its step)", ", ".join(f"{r['best']:.3f} ({r['best_step']})" for r in rows)],
        ["baseline: the shorter response wins", f"{shorter_wins(pairs):.3f}"],
    ]
    print_table([f"held out: {rows[0]['n']} pairs", f"value (seeds {', '.join(map(str, args.seeds))})"], table)


if __name__ == "__main__":
    main()
