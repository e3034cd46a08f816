"""Process against outcome supervision on 3-step arithmetic (docs/rlhf_loop.md, "Process reward models"): Lightman
et al. 2023's best-of-n comparison in miniature, and GRPO on process rewards (DeepSeekMath), at three seeds.

    python experiments/prm_vs_orm.py          # seeds 1, 2 and 3

For each seed S, all at seed S:
1. an SFT model of `17+2*5=` problems (three operations on 1-digit numbers, `+-*`), solved one step a line;
2. an outcome verifier (--task orm) and a process verifier (--task prm) trained on the same solutions of that SFT
   model (the same seed draws the same samples): the orm labels each solution's final answer, the prm each step up
   to the first wrong one (Lightman et al.'s labels), by the exact step checker;
3. best-of-n of the SFT model's sampled solutions to the held-out problems under the orm, and under the prm with each
   aggregate (prod, min, last), beside majority voting over the same solutions and voting weighted by each
   verifier's probability that a solution is right (n from 1 to 64);
4. GRPO from the SFT model on the prm's step rewards (--adv process), on the orm's outcome reward, and on the gold
   reward, the same budget; both verifiers' rewards are probabilities (sigmoid of the score: --rm_sigmoid for the
   orm), so the runs differ in where the reward sits, not in its transform.
Every measure is on the distinct held-out problems of 500 draws, and says how many.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, metrics, parse_args, print_table, run  # noqa: E402

TASK = dict(digits=1, ops="+-*", steps=3)
SFT = dict(
    data="arithmetic", tokenizer="char", n_layer=3, n_head=4, n_embd=96, block_size=48, batch_size=64, lr=2e-3,
    warmup_steps=100, max_steps=1000, eval_every=500, **TASK,
)  # fmt: skip
VERIFIER = dict(n_train=32000, n_val=2000, batch_size=64, max_steps=2000, eval_every=500, **TASK)
BEST_OF = dict(best_of="1,2,4,8,16,32,64", eval_size=500, **TASK)
RL = dict(task="arithmetic", horizon=34, eval_every=10, eval_size=500, warmup_steps=5, **TASK)
GRPO = dict(batch_size=16, group_size=8, max_steps=80, lr=5e-5, beta_kl=0.04)
QUICK = {
    "sft": dict(n_layer=1, n_head=2, n_embd=32, max_steps=60, eval_every=60, eval_iters=2, warmup_steps=2),
    "verifier": dict(n_train=128, n_val=64, batch_size=32, max_steps=3, eval_every=3),
    "best_of": dict(best_of="1,2,4", eval_size=12),
    "rl": dict(eval_every=1, eval_size=12, warmup_steps=1),
    "grpo": dict(batch_size=4, group_size=4, max_steps=1),
}
AGGREGATES = ("prod", "min", "last")
STEP_METRICS = ("eval/step_accuracy_right", "eval/step_accuracy_wrong")
RL_RUNS = {  # name: (the reward model, its flags)
    "GRPO on the prm, process advantages": ("prm", ["--adv", "process"]),
    "GRPO on the orm, outcome advantages": ("orm", ["--adv", "group", "--rm_sigmoid"]),
    "GRPO on the gold reward": (None, ["--adv", "group"]),
}


def flags(settings, overrides=None):
    merged = {**settings, **(overrides or {})}
    return [item for key, value in merged.items() for item in (f"--{key}", value)]


def best_of_runs(args):
    """The best-of-n runs: name -> (verifier, --prm_aggregate); --quick: the orm and the prm's product only."""
    aggregates = AGGREGATES[:1] if args.quick else AGGREGATES
    return {"bon_orm": ("orm", "prod"), **{f"bon_prm_{a}": ("prm", a) for a in aggregates}}


def pipeline(args, seed):
    """{name: run folder} of one seed's runs."""
    quick = QUICK if args.quick else {}
    out = f"{args.out}/seed{seed}"
    seed_flag = ["--seed", seed]
    folders = {"sft": run("gpt.py", flags(SFT, quick.get("sft")) + seed_flag, f"{out}/sft")}
    sft = f"{folders['sft']}/ckpt.pt"
    for task in ("orm", "prm"):
        task_flags = flags(VERIFIER, quick.get("verifier")) + ["--task", task, "--samples_from", sft, *seed_flag]
        folders[task] = run("reward_model.py", task_flags, f"{out}/{task}")
    for name, (task, aggregate) in best_of_runs(args).items():
        folder = f"{out}/{name}"
        if not os.path.exists(f"{folder}/best_of_n.json"):  # --best_of writes no final_results.json
            verifier = f"{folders[task]}/ckpt.pt"
            bon_flags = flags(BEST_OF, quick.get("best_of")) + ["--init_from", verifier, "--policy", sft, *seed_flag]
            run("reward_model.py", bon_flags + ["--prm_aggregate", aggregate], folder)
        folders[name] = folder
    for name, (task, adv_flags) in RL_RUNS.items():
        rm_flags = ["--reward_model", f"{folders[task]}/ckpt.pt"] if task else []
        rl_flags = flags(RL, quick.get("rl")) + flags(GRPO, quick.get("grpo")) + [*adv_flags, *rm_flags]
        folders[name] = run("grpo.py", rl_flags + ["--init_from", sft, *seed_flag], f"{out}/grpo_{task or 'gold'}")
    return folders


def best_of_rows(folder):
    with open(f"{folder}/best_of_n.json") as f:
        return {row["n"]: row for row in json.load(f)}


def main():
    args = parse_args("prm_vs_orm", __doc__.splitlines()[0])
    runs = [pipeline(args, seed) for seed in args.seeds]
    sft = [[r for r in metrics(run["sft"]) if "eval/accuracy" in r][-1] for run in runs]
    print(f"SFT greedy gold: {fmt([r['eval/accuracy'] for r in sft])} on {int(sft[0]['eval/n_problems'])} problems")
    for task in ("orm", "prm"):
        auc = [[r for r in metrics(run[task]) if "eval/auc_per_problem" in r][-1] for run in runs]
        print(f"{task} AUC within a problem: {fmt([r['eval/auc_per_problem'] for r in auc])}")

    # best-of-n: gold of the verifier's pick and of majority voting, per n
    names = list(best_of_runs(args))
    bon = {name: [best_of_rows(run[name]) for run in runs] for name in names}
    ns = sorted(bon["bon_orm"][0])
    n_problems = bon["bon_orm"][0][ns[0]]["n_problems"]
    header = ["n", "ORM", *[f"PRM ({aggregate})" for _, aggregate in list(best_of_runs(args).values())[1:]]]
    header += ["majority voting", "weighted by the ORM", "weighted by the PRM (prod)", "PRM (prod) - ORM"]
    table = []
    for n in ns:
        row = [str(n)]
        for name in names:
            row.append(fmt([b[n]["gold"] for b in bon[name]]))
        row.append(fmt([b[n]["majority"] for b in bon["bon_orm"]]))
        row.append(fmt([b[n]["weighted_majority"] for b in bon["bon_orm"]]))
        row.append(fmt([b[n]["weighted_majority"] for b in bon["bon_prm_prod"]]))
        row.append(fmt([p[n]["gold"] - o[n]["gold"] for p, o in zip(bon["bon_prm_prod"], bon["bon_orm"])]))
        table.append(row)
    print(f"\nbest-of-n gold on {n_problems} held-out problems, mean +- s.e. over {len(runs)} seeds:")
    print_table(header, table)

    # the best n of each, picked on the problems at even places (gold_a), reported on the others (gold_b)
    table = []
    for name, header_name in zip(names, ["ORM", *[f"PRM ({a})" for _, a in list(best_of_runs(args).values())[1:]]]):
        pick = max(ns, key=lambda n: sum(b[n]["gold_a"] for b in bon[name]))
        table.append([header_name, str(pick), fmt([b[pick]["gold_b"] for b in bon[name]])])
    print_table(["verifier", "best n (picked on half a)", "its gold on half b"], table)

    # GRPO: gold, steps and KL against training steps; the peak step picked on half a, its gold on half b
    header = ["run", "step", "sampled gold", "greedy gold", "right steps, right answers", "right steps, wrong", "KL"]
    table = []
    for name in RL_RUNS:
        curves = [[r for r in metrics(run[name]) if "eval/accuracy" in r] for run in runs]
        for i in sorted({0, 1, 2, len(curves[0]) // 2, len(curves[0]) - 1} & set(range(len(curves[0])))):
            rows = [c[i] for c in curves]
            cells = [name, str(rows[0]["step"])]
            for key in ("eval/sample_accuracy", "eval/accuracy", *STEP_METRICS):
                cells.append(fmt([r.get(key, float("nan")) for r in rows]))
            cells.append(fmt([r.get("eval/sample_kl", float("nan")) for r in rows], 2))
            table.append(cells)
        peak = max(range(len(curves[0])), key=lambda i: sum(c[i]["eval/sample_accuracy_a"] for c in curves))
        gold_b = fmt([c[peak]["eval/sample_accuracy_b"] for c in curves])
        peak_step = f"peak: {curves[0][peak]['step']} (picked on half a)"
        table.append([name, peak_step, f"{gold_b} (half b)", "", "", "", ""])
    print(f"\nGRPO on {n_problems} held-out problems, mean +- s.e. over {len(runs)} seeds:")
    print_table(header, table)


if __name__ == "__main__":
    main()
