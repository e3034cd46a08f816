"""Reruns the tables "What the reward adds to its reference" of docs/char_grpo.md and redraws
docs/char_grpo_compare.png: char_grpo.py on tiny Shakespeare from scratch, the same model, data, seed and number of
characters in every run, at 3 seeds and at two budgets (300 steps, the default, and 600):

    (a) GRPO from reward alone, no reference          --reference none
    (b) the KL to the bigram alone, no reward          --reward_mode none --beta_kl 0.5 --kl_warmup_tokens 0
    (c) GRPO, reward and bigram KL, as the default was --beta_kl 0.02 --kl_warmup_tokens 200000
    (c) GRPO, reward and a constant bigram KL          --beta_kl 0.5 --kl_warmup_tokens 0
    (d) the supervised baseline                        --supervised
    (e) the bigram reference itself                    --eval_reference (nothing trained)

    python experiments/char_grpo_vs_sft.py                           # seeds 1 2 3, budgets 300 and 600
    python experiments/char_grpo_vs_sft.py --seeds 1 --budgets 300   # one seed, one budget (runs can be split so)

Every run is its own process with the settings written out, so a change of char_grpo.py's defaults leaves the
table as it is. --quick runs a one-layer model for 4 steps.
"""

import os

from common import ROOT, final_results, fmt, mean_se, metrics, parse_args, print_table, run

args = parse_args(
    "char_grpo_vs_sft",
    __doc__,
    extra={
        "--budgets": ("300,600", "steps of each budget, comma-separated"),
        "--only": ("", "the settings to run, by short name (a,b,c_warm,c_const,d; default: all)"),
    },
)
budgets = [int(b) for b in args.budgets.split(",")]

flags = ["--device", "cpu"]
if args.quick:
    budgets = [4]
    flags += ["--eval_every", 2, "--eval_size", 8, "--batch_size", 2, "--group_size", 4]
    flags += ["--n_layer", 1, "--n_head", 2, "--n_embd", 32]
constant_kl = ["--beta_kl", 0.5, "--kl_warmup_tokens", 0]
SETTINGS = {  # name: (short name, flags)
    "(a) reward alone, no reference": ("a", ["--reference", "none"]),
    "(b) bigram KL alone, no reward": ("b", ["--reward_mode", "none", *constant_kl]),
    "(c) reward + bigram KL, beta 0.02 warmed up": ("c_warm", ["--beta_kl", 0.02, "--kl_warmup_tokens", 200000]),
    "(c) reward + bigram KL, beta 0.5 constant": ("c_const", constant_kl),
    "(d) supervised": ("d", ["--supervised"]),
}
if args.only:  # a part of the runs (to split them over processes); the tables show that part
    SETTINGS = {name: v for name, v in SETTINGS.items() if v[0] in args.only.split(",")}
METRICS = ("eval/next_token_acc", "eval/bpc", "eval/greedy_match", "eval/greedy_space_frac")

bigram = [run("char_grpo.py", [*flags, "--eval_reference", "--seed", s], f"{args.out}/e_seed{s}") for s in args.seeds]
runs = {}  # (name, budget): [run folder of each seed]
for steps in budgets:
    for name, (short, extra) in SETTINGS.items():
        runs[name, steps] = [
            run(
                "char_grpo.py",
                [*flags, *extra, "--max_steps", steps, "--seed", s],
                f"{args.out}/{short}_{steps}_seed{s}",
            )
            for s in args.seeds
        ]


def evals(out_dir):
    """[the evaluation rows], in step order."""
    return [row for row in metrics(out_dir) if "eval/next_token_acc" in row]


header = ["run", "steps", "characters", "next-char acc", "bits per char", "greedy match", "greedy spaces"]
for steps in budgets:
    rows = [["(e) bigram reference", "-", "-"] + [fmt([final_results(o)[m[5:]] for o in bigram]) for m in METRICS]]
    for name in SETTINGS:
        results = [final_results(o) for o in runs[name, steps]]
        row = [name, steps, f"{results[0]['tokens']:,}"]
        row += [fmt([r[m[5:]] for r in results]) for m in METRICS]
        rows.append(row)
    print_table(header, rows)

# what the reward adds over its reference: (c) with the constant KL minus (b), seed by seed (the same seed's runs
# share their model's initialisation and the windows they are trained on)
for steps in budgets:
    if "(b) bigram KL alone, no reward" not in SETTINGS or "(c) reward + bigram KL, beta 0.5 constant" not in SETTINGS:
        break
    diffs = {}
    for m in METRICS:
        c = [final_results(o)[m[5:]] for o in runs["(c) reward + bigram KL, beta 0.5 constant", steps]]
        b = [final_results(o)[m[5:]] for o in runs["(b) bigram KL alone, no reward", steps]]
        diffs[m] = fmt([x - y for x, y in zip(c, b)])
    print(f"{steps} steps, (c) constant minus (b): " + ", ".join(f"{m} {d}" for m, d in diffs.items()))


def draw(path, steps):
    """Next-char accuracy and bits per character against characters at one budget, the mean over seeds of each
    setting, +- s.e. as a band; the bigram as a horizontal line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="tight")
    for ax, key in zip(fig.subplots(1, 2), ("eval/next_token_acc", "eval/bpc")):
        for name in SETTINGS:
            curves = [evals(o) for o in runs[name, steps]]
            x = [row["rl/tokens"] for row in curves[0]]
            stats = [mean_se([c[i][key] for c in curves]) for i in range(len(x))]
            mean = [m for m, _ in stats]
            ax.plot(x, mean, marker=".", label=name)
            ax.fill_between(x, [m - s for m, s in stats], [m + s for m, s in stats], alpha=0.2)
        level = mean_se([final_results(o)[key[5:]] for o in bigram])[0]
        ax.axhline(level, color="black", linestyle="--", label="(e) bigram reference")
        ax.set(title=key, xlabel="characters (generated or trained on)", ylabel=key[5:])
        if key == "eval/bpc":
            ax.set_ylim(top=8)
    fig.axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=100)


figure = ROOT / "docs" / "char_grpo_compare.png"
if args.quick:
    figure = os.path.join(args.out, "char_grpo_compare.png")
draw(figure, budgets[-1])
print(f"figure: {figure}")
