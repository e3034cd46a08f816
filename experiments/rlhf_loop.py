"""The RLHF loop's pipeline and best-of-n tables of docs/rlhf_loop.md: an SFT model, a verifier trained on its own
answers, and GRPO on the verifier with best-of-n of the SFT model measured at step 0, on 2-digit `+`/`-` arithmetic
whose gold reward (the exact answer) is known.

    python experiments/rlhf_loop.py          # the three commands of docs/rlhf_loop.md, about 10 minutes on 2 CPU cores

The other experiments of that page (overoptimization.py, dpo_gold_vs_judged.py, ppo_vs_grpo.py) start from the
same SFT model and verifier, through train_sft(), train_verifier() and rl_flags() here.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import final_results, fmt, metrics, parse_args, print_table, run  # noqa: E402

SFT = dict(
    data="arithmetic", tokenizer="char", digits=2, ops="+-", n_layer=3, n_head=4, n_embd=96, block_size=32,
    batch_size=64, lr=3e-3, warmup_steps=50, max_steps=2000, eval_every=1000,
)  # fmt: skip
VERIFIER = dict(
    task="orm", digits=2, ops="+-", n_train=50000, n_val=2000, batch_size=64, max_steps=2000, eval_every=500
)
RL = dict(task="arithmetic", digits=2, ops="+-", horizon=6, eval_every=10, eval_size=300, warmup_steps=5)
GRPO = dict(batch_size=32, group_size=8, max_steps=150, lr=3e-5, scale_rewards="none", beta_kl=0.2)
BEST_OF = "1,2,4,8,16,32"
# --quick: a tiny SFT model, a verifier of a few steps, 2 RL steps on a few held-out problems
QUICK = {
    "sft": {
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 32,
        "batch_size": 32,
        "lr": 1e-2,
        "warmup_steps": 2,
        "max_steps": 100,  # enough for a few right answers (DPO's gold pairs need them)
        "eval_every": 100,
        "eval_iters": 2,
    },
    "verifier": dict(n_train=256, n_val=64, batch_size=32, max_steps=4, eval_every=4),
    "rl": dict(eval_every=1, eval_size=16, warmup_steps=1),
    "grpo": dict(batch_size=4, group_size=4, max_steps=2),
    "ppo": dict(batch_size=16, max_steps=2),
}
QUICK_BEST_OF = "1,2,4"


def flags(settings, quick=None):
    """--key value flags of a settings dict, with the --quick overrides when given."""
    merged = {**settings, **(quick or {})}
    return [item for key, value in merged.items() for item in (f"--{key}", value)]


def train_sft(args):
    """The SFT model (gpt.py, its default seed): the path of its ckpt.pt."""
    return run("gpt.py", flags(SFT, QUICK["sft"] if args.quick else None), f"{args.out}/sft") + "/ckpt.pt"


def train_verifier(args, sft):
    """The verifier (reward_model.py --task orm) trained on answers sampled from the SFT model: its ckpt.pt."""
    verifier_flags = flags(VERIFIER, QUICK["verifier"] if args.quick else None) + ["--samples_from", sft]
    return run("reward_model.py", verifier_flags, f"{args.out}/verifier") + "/ckpt.pt"


def rl_flags(args, sft, reward_model=None):
    """grpo.py's and ppo.py's arithmetic flags, from the SFT model, on the verifier's reward when given (else gold)."""
    start = ["--init_from", sft] + (["--reward_model", reward_model] if reward_model else [])
    return flags(RL, QUICK["rl"] if args.quick else None) + start


def main():
    args = parse_args("rlhf_loop", __doc__.splitlines()[0], seeds=(1337,))
    sft_ckpt = train_sft(args)
    rl = rl_flags(args, sft_ckpt, train_verifier(args, sft_ckpt))
    best_of = QUICK_BEST_OF if args.quick else BEST_OF
    grpo = []
    for seed in args.seeds:
        grpo_flags = rl + flags(GRPO, QUICK["grpo"] if args.quick else None) + ["--best_of", best_of, "--seed", seed]
        grpo.append(run("grpo.py", grpo_flags, f"{args.out}/grpo_verifier_seed{seed}"))

    sft = final_results(f"{args.out}/sft")
    verifier = final_results(f"{args.out}/verifier")
    first = [metrics(folder)[0] for folder in grpo]  # step 0: the SFT model
    last = [[row for row in metrics(folder) if "eval/accuracy" in row][-1] for folder in grpo]
    wall = [final_results(folder)["wall_time_s"] for folder in grpo]
    verdicts = f"{verifier['auc']:.3f} / {verifier['accuracy_wrong']:.3f} / {verifier['accuracy_correct']:.3f}"
    print_table(
        ["stage", "measure (held-out problems)", "value", "wall time (s)"],
        [
            ["SFT (gpt.py)", "parameters / validation loss", f"{sft['params']} / {sft['final_val_loss']:.3f}",
             f"{sft['wall_time_s']:.0f}"],
            ["SFT (gpt.py)", "greedy / sampled exact answers", f"{fmt([r['eval/accuracy'] for r in first])} / "
             f"{fmt([r['eval/sample_accuracy'] for r in first])}", ""],
            ["verifier (reward_model.py)", "auc / accuracy_wrong / accuracy_correct", verdicts,
             f"{verifier['wall_time_s']:.0f}"],
            ["GRPO on the verifier (grpo.py)", f"greedy / sampled exact answers at step {last[0]['step']}",
             f"{fmt([r['eval/accuracy'] for r in last])} / {fmt([r['eval/sample_accuracy'] for r in last])}",
             fmt(wall, 0)],
        ],
    )  # fmt: skip
    with open(os.path.join(grpo[0], "best_of_n.json")) as f:
        best_of_n = json.load(f)
    print_table(
        ["n", "KL_bon (nats)", f"gold accuracy (+- s.e., {best_of_n[0]['n_problems']} problems)", "proxy"],
        [
            [b["n"], f"{b['kl_bon']:.2f}", f"{b['gold_accuracy']:.3f} +- {b['gold_accuracy_se']:.3f}",
             f"{b['proxy_score']:.2f}"]
            for b in best_of_n
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
