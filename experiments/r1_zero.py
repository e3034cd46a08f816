"""R1-Zero in miniature (docs/r1_zero.md): GRPO on an outcome reward finds the
worked steps that a char base model of gpt.py's `--data reasoning` almost never writes after a question, and its
accuracy rises with them; five runs a seed, each from a base of its own seed:
  - main: Dr. GRPO (`--loss_type dr_grpo --scale_rewards none`), no KL, a horizon that fits the steps;
  - (a) a horizon of 6, where only a direct answer `A:n` fits;
  - (b) a base trained without worked or bridge documents (`--worked_frac 0 --bridge_frac 0`);
  - (c) a base with worked documents but no bridge (`--bridge_frac 0`): steps never follow a question;
  - (d) `--loss_type grpo` with its std scaling (Liu et al. 2025: longer wrong answers?).
Before any RL, the gate measures each base on 400 held-out problems of 3 to 5 operations at temperature 1: the
accuracy of its natural completions of `Q:<expr>;` and the share that write steps, and its accuracy forced into each
mode, direct (the prompt ends with `A:`) or steps (the prompt ends with the expression's first number). RL can only
amplify a step mode the base has: the aim is forced steps at least 0.3 above forced direct, and steps in at least 1%
of natural completions.

    python experiments/r1_zero.py          # seeds 1, 2 and 3: three bases and five RL runs each; the tables and
                                           # docs/r1_zero.png (about 40 minutes on 2 CPU cores)

A completion's answer is its last `A:n`, else its last step's result (grpo.py's read_answer).
"""

import os
import random
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, fmt, mean_se, metrics, parse_args, print_table, run  # noqa: E402

sys.path.insert(0, str(ROOT))
import gpt  # noqa: E402  (the gate samples the base models itself)
import grpo  # noqa: E402  (and reads answers as the task does)

TASK = dict(digits=1, ops="+-", steps=5)
BASE = dict(
    data="reasoning", tokenizer="char", n_layer=3, n_head=4, n_embd=96, block_size=128, batch_size=64, lr=3e-3,
    warmup_steps=100, max_steps=3000, eval_every=1000, eval_iters=5, bridge_frac=0.02, **TASK,
)  # fmt: skip
BASES = {  # folder: what the corpus changes
    "base": {},
    "base_direct": dict(worked_frac=0, bridge_frac=0),  # (b)
    "base_nobridge": dict(bridge_frac=0),  # (c)
}
RL = dict(
    task="reasoning", min_steps=3, horizon=80, loss_type="dr_grpo", scale_rewards="none", beta_kl=0, reference="none",
    batch_size=16, group_size=8, lr=2e-4, max_steps=60, eval_every=5, eval_size=100, log_every=10, save_every=1000,
    **TASK,
)  # fmt: skip
RUNS = {  # label: (folder, base folder, what the run changes)
    "main": ("main", "base", {}),
    "(a) horizon 6": ("short", "base", dict(horizon=6)),
    "(b) no steps in the corpus": ("direct", "base_direct", {}),
    "(c) --bridge_frac 0": ("nobridge", "base_nobridge", {}),
    "(d) --loss_type grpo": ("grpo", "base", dict(loss_type="grpo", scale_rewards="group")),
}
QUICK = dict(n_layer=1, n_head=2, n_embd=32, max_steps=20, eval_every=20, eval_iters=1, warmup_steps=2)
QUICK_RL = dict(max_steps=2, eval_every=1, eval_size=2, warmup_steps=1)
GATE_OPS = (3, 5)  # the held-out problems the gate asks: 3 to 5 operations
N_PROBLEMS = 400
CURVES = {"sample_accuracy": "held-out accuracy (sampled)", "sample_step_share": "share that write steps",
          "sample_length": "completion length (tokens)"}  # fmt: skip


def flags(values):
    return [x for k, v in values.items() for x in (f"--{k}", v)]


def gate_problems(n, seed=1234):
    """n distinct held-out problems of GATE_OPS operations as (expression, answer), the same for every seed."""
    rng = random.Random(seed)
    found = {}
    while len(found) < n:
        prompt, solution = gpt.draw_problem(rng, TASK["digits"], TASK["ops"], True, rng.randint(*GATE_OPS))
        found[prompt[:-1]] = int(solution.split()[-1].split("=")[-1])
    return list(found.items())


def complete(model, tok, prompts, max_new):
    """Completions of the prompts at temperature 1, their newline included, with noise of their own."""
    newline = tok.encode("\n")[0]
    texts = []
    with torch.no_grad():
        for i in range(0, len(prompts), 200):
            ids = [tok.encode(p) for p in prompts[i : i + 200]]
            gen = torch.Generator().manual_seed(i)
            tokens, mask = gpt.generate(model, ids, max_new, 1.0, None, newline, gen)
            texts += [tok.decode(t[m > 0].tolist()) for t, m in zip(tokens, mask)]
    return texts


def forced_prompts(expr):
    """The gate's three prompts for an expression: natural (the question alone), forced direct (it ends with "A:")
    and forced steps (it ends with the first step's first operand, the expression's first number)."""
    first = re.match(r"\d+", expr).group()
    return {"natural": f"Q:{expr};", "direct": f"Q:{expr};A:", "steps": f"Q:{expr};{first}"}


def gate(ckpt):
    """The gate's measures of a base model: {name: value}, each over the same held-out problems. A forced
    completion is read with the part of it that its prompt wrote (forced_prompts)."""
    model, spec, _ = gpt.load_model(ckpt)
    model.eval()
    tok = gpt.get_tokenizer(spec)
    problems = gate_problems(N_PROBLEMS)
    max_new = model.config.block_size - max(len(e) for e, _ in problems) - len("Q:;A:")  # the longest prompt fits
    answers = [a for _, a in problems]
    accuracy = {}
    written = {}  # mode: the completions, with what the prompt wrote after "Q:<expr>;"
    for mode in ("natural", "direct", "steps"):
        prompts = [forced_prompts(e)[mode] for e, _ in problems]
        texts = complete(model, tok, prompts, max_new)
        written[mode] = [p.split(";", 1)[1] + t for p, t in zip(prompts, texts)]
        accuracy[mode] = sum(grpo.read_answer(t) == a for t, a in zip(written[mode], answers)) / len(answers)
    wrote_steps = [not t.startswith("A:") and "=" in t for t in written["natural"]]
    return {
        "natural accuracy": accuracy["natural"],
        "natural step share": sum(wrote_steps) / len(problems),
        "forced direct": accuracy["direct"],
        "forced steps": accuracy["steps"],
        "forced steps - forced direct": accuracy["steps"] - accuracy["direct"],
    }


def curve(folder, key):
    """{RL step: value} of an eval/ metric of a run."""
    return {row["step"]: row[f"eval/{key}"] for row in metrics(folder) if f"eval/{key}" in row}


def samples(folder):
    """The sampled answers of the first evaluation and of the last one, to the same held-out prompts."""
    with open(os.path.join(folder, "samples.txt")) as f:
        blocks = f.read().split("--- step ")[1:]
    return [b.split("\n", 1)[1].strip().splitlines() for b in (blocks[0], blocks[-1])]


def figure(path, runs, seeds):
    fig, axes = plt.subplots(1, len(CURVES), figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, CURVES.items()):
        for label in RUNS:
            points = [curve(runs[seed][label], key) for seed in seeds]
            xs = sorted(set.intersection(*(set(p) for p in points)))
            stats = [mean_se([p[x] for p in points]) for x in xs]
            mean = [m for m, _ in stats]
            ax.plot(xs, mean, "o-", markersize=3, label=label)
            ax.fill_between(xs, [m - e for m, e in stats], [m + e for m, e in stats], alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"R1-Zero in miniature: held-out problems of 3-5 operations, mean +- s.e. over {len(seeds)} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    extra = {"--figure": ("", "where the PNG goes (default: docs/r1_zero.png; with --quick OUT/r1_zero.png)")}
    args = parse_args("r1_zero", __doc__.split("\n\n")[0], extra=extra)
    base = {**BASE, **(QUICK if args.quick else {})}
    rl = {**RL, **(QUICK_RL if args.quick else {})}
    gates, runs = {}, {}
    for seed in args.seeds:
        for name, change in BASES.items():
            folder = run("gpt.py", flags({**base, **change, "seed": seed}), f"{args.out}/{name}{seed}")
            gates[seed, name] = gate(os.path.join(folder, "ckpt.pt"))
        runs[seed] = {}
        for label, (name, base_name, change) in RUNS.items():
            init = f"{args.out}/{base_name}{seed}/ckpt.pt"
            runs[seed][label] = run(
                "grpo.py", flags({**rl, **change, "init_from": init, "seed": seed}), f"{args.out}/{name}{seed}"
            )
    seeds = args.seeds
    names = list(gates[seeds[0], "base"])
    rows = [[name] + [fmt([gates[s, b][name] for s in seeds]) for b in BASES] for name in names]
    print(f"the gate, {N_PROBLEMS} held-out problems of {GATE_OPS[0]}-{GATE_OPS[1]} operations, temperature 1")
    print_table(["measure", "base", "(b) base without steps", "(c) base without bridge"], rows)

    def first_last(label, key):
        points = [curve(runs[s][label], key) for s in seeds]
        return [p[min(p)] for p in points], [p[max(p)] for p in points]

    n = curve(runs[seeds[0]]["main"], "n_problems")
    rows = []
    for label in RUNS:
        row = [label]
        for key in (
            "sample_accuracy",
            "sample_step_share",
            "sample_length",
            "sample_length_right",
            "sample_length_wrong",
        ):
            before, after = first_last(label, key)
            row.append(f"{fmt(before, 2)} -> {fmt(after, 2)}")
        before, after = first_last(label, "sample_accuracy")
        row.append(fmt([b - a for a, b in zip(before, after)]))
        row.append(fmt(first_last(label, "sample_steps_right")[1], 2))
        row.append(fmt(first_last(label, "accuracy")[1], 2))
        rows.append(row)
    print(f"RL on {n[min(n)]:.0f} held-out problems of 3-5 operations, four answers each at temperature 1")
    print(f"mean +- s.e. over seeds {seeds}")
    header = ["run", "accuracy", "step share", "length", "length of right", "length of wrong", "accuracy gain",
              "every step right (end)", "greedy accuracy (end)"]  # fmt: skip
    print_table(header, rows)
    before, after = samples(runs[seeds[0]]["main"])
    print(f"seed {seeds[0]}, main run: the same held-out prompts, sampled answers of the base and of the RL model")
    print_table(["base", "after RL"], [[b, a] for b, a in zip(before, after)])
    path = args.figure or (os.path.join(args.out, "r1_zero.png") if args.quick else str(ROOT / "docs" / "r1_zero.png"))
    figure(path, runs, seeds)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
