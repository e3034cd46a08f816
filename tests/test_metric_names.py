"""docs/metrics.md lists exactly the metric names the scripts log: each script runs a few steps in enough
configurations that every name is logged by some run, and the keys of every metrics.jsonl row are compared with the
backticked names of the first column of docs/metrics.md's tables."""

import importlib
import json
import re

import pytest
import torch
from conftest import ROOT, TINY, bpe_checkpoint, char_checkpoint, hh_file, needs_bpe, run_main, synthetic_text

# logged only where the GPU's peak FLOPs are known: these CPU runs leave it out
CUDA_ONLY = {"perf/mfu"}


def documented_names():
    """The backticked names in the first column of docs/metrics.md's tables."""
    names = set()
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        match = re.match(r"\|\s*`([a-z]+/[a-z0-9_]+)`\s*\|", line)
        if match:
            names.add(match.group(1))
    return names


def logged_names(out_dir):
    """The keys of every metrics.jsonl row of a run folder, without "step"."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {k for r in rows for k in r if k != "step"}


START = re.compile(r"\d+\.\d\dM parameters, 1 x cpu, .+; run folder (.+)")
END = re.compile(r".+; run folder (.+); \d+ s")


def run(capsys, script, monkeypatch, out_dir, *args):
    """script.main() in this process with these flags (curves not drawn); returns the names its run logged. Its
    first line of output names the model's size, the device and the run folder, and its last the headline, the run
    folder and the time, alike in every script."""
    module = importlib.import_module(script)
    monkeypatch.setattr(module, "plot_curves", lambda *a: None)
    capsys.readouterr()
    run_main(module, monkeypatch, *args, "--device", "cpu", "--out_dir", out_dir)
    lines = capsys.readouterr().out.strip().splitlines()
    assert START.fullmatch(lines[0]) and START.fullmatch(lines[0]).group(1) == str(out_dir), lines[0]
    assert END.fullmatch(lines[-1]) and END.fullmatch(lines[-1]).group(1) == str(out_dir), lines[-1]
    return logged_names(out_dir)


def dpo_pairs(path, n=80):
    """HH-shaped preference pairs: the chosen response holds a marker word."""
    words = "the cat sat on a mat dog ran far sun".split()
    with open(path, "w") as f:
        for i in range(n):
            prompt = f"\n\nHuman: {words[i % 10]} {words[(3 * i) % 10]}?\n\nAssistant:"
            record = {"chosen": f"{prompt} please {words[i % 7]}", "rejected": f"{prompt} {words[i % 5]} no"}
            f.write(json.dumps(record) + "\n")
    return path


def reward_checkpoint(path, chars, task):
    """A tiny random char reward model saved as reward_model.py --task TASK saves one."""
    char_checkpoint(path, chars, block_size=64, seed=1, reward_head=True)
    ckpt = torch.load(path, weights_only=True)
    ckpt["reward_task"] = task
    torch.save(ckpt, path)
    return path


@pytest.mark.slow
@needs_bpe
def test_every_logged_metric_name_is_documented_and_every_documented_name_is_logged(tmp_path, monkeypatch, capsys):
    """Runs of every script (gpt text and arithmetic; char_grpo; grpo next_token, arithmetic of 2 steps with a reward
    model, reasoning, --dynamic_sampling, --top_entropy_quantile and --off_policy_mask, and the reward_model task; ppo
    next_token with --dual_clip and arithmetic with a reward model; dpo kto with --judge and bco_pair; reward_model
    preference, orm and prm; rookworld_grpo with --adv ema and with --value_head) log only names docs/metrics.md
    lists, and together log every name it lists."""
    import gpt
    import grpo

    text = tmp_path / "text.txt"
    text.write_text(synthetic_text(4000))
    arith = grpo.ARITHMETIC_CHARS
    arith_init = char_checkpoint(tmp_path / "arith.pt", arith, block_size=32)
    arith_rm = reward_checkpoint(tmp_path / "arith_rm.pt", arith, "orm")
    hh = hh_file(tmp_path / "hh.jsonl")
    hh_chars = "".join(sorted(set(hh.read_text()) | set("\n")))
    hh_init = char_checkpoint(tmp_path / "hh_init.pt", hh_chars, block_size=64)
    hh_rm = reward_checkpoint(tmp_path / "hh_rm.pt", hh_chars, "preference")
    pairs = dpo_pairs(tmp_path / "pairs.jsonl")
    pair_chars = "".join(sorted(set(pairs.read_text()) | set("\n")))
    pair_init = char_checkpoint(tmp_path / "pair_init.pt", pair_chars, block_size=64)
    pair_rm = reward_checkpoint(tmp_path / "pair_rm.pt", pair_chars, "preference")
    rook_data = tmp_path / "rook.txt"
    steps = ["--max_steps", "2", "--eval_every", "2"]

    logged = set()
    out = iter(tmp_path / f"run{i}" for i in range(100))
    # gpt.py: text and arithmetic
    gpt_args = [*TINY, "--eval_iters", "1", *steps, "--num_samples", "1", "--sample_tokens", "2"]
    logged |= run(capsys, "gpt", monkeypatch, next(out), "--data", text, "--tokenizer", "char", *gpt_args)
    logged |= run(capsys, "gpt", monkeypatch, next(out), "--data", "arithmetic", *gpt_args)
    # char_grpo.py
    char_args = [*TINY, "--context_len", "8", "--horizon", "4", "--group_size", "4", "--eval_size", "8"]
    logged |= run(capsys, "char_grpo", monkeypatch, next(out), "--data", text, *char_args, *steps)
    # grpo.py: next_token; arithmetic with a reward model and every masking flag; HH prompts and a reward model
    small = ["--horizon", "4", "--batch_size", "2", "--group_size", "4", "--eval_size", "8", *steps]
    next_token = [*TINY, "--tokenizer", "char", "--context_len", "8", "--data", text]
    logged |= run(capsys, "grpo", monkeypatch, next(out), *next_token, *small, "--reference", "init")
    flags = ["--dynamic_sampling", "--top_entropy_quantile", "0.5", "--off_policy_mask", "1e-3"]
    arithmetic = ["--task", "arithmetic", "--init_from", arith_init, "--reward_model", arith_rm]
    logged |= run(
        capsys, "grpo", monkeypatch, next(out), *arithmetic, *flags, "--num_iterations", "2", "--steps", "2", *small
    )
    reasoning_init = char_checkpoint(tmp_path / "reasoning.pt", gpt.REASONING_CHARS, block_size=32)
    reasoning = ["--task", "reasoning", "--init_from", reasoning_init, "--steps", "2", "--ops", "+-"]
    logged |= run(capsys, "grpo", monkeypatch, next(out), *reasoning, *small)
    hh_task = ["--task", "reward_model", "--init_from", hh_init, "--reward_model", hh_rm, "--data_path", hh]
    logged |= run(capsys, "grpo", monkeypatch, next(out), *hh_task, "--max_prompt_len", "40", *small)
    # ppo.py: next_token with the dual clip; arithmetic with a reward model
    ppo_small = ["--horizon", "4", "--batch_size", "4", "--num_minibatches", "2", "--eval_size", "8", *steps]
    logged |= run(
        capsys, "ppo", monkeypatch, next(out), *next_token, *ppo_small, "--reference", "init", "--dual_clip", "3"
    )
    logged |= run(capsys, "ppo", monkeypatch, next(out), *arithmetic, *ppo_small)
    # dpo.py: kto with a judge, bco_pair
    dpo_args = ["--data_path", pairs, "--init_from", pair_init, "--max_len", "64", "--batch_size", "4", *steps]
    dpo_args += ["--num_samples", "0", "--eval_size", "4", "--sample_tokens", "8"]
    judge = ["--judge", pair_rm, "--judge_prompts", "2"]
    logged |= run(capsys, "dpo", monkeypatch, next(out), *dpo_args, "--loss_type", "kto", *judge)
    logged |= run(capsys, "dpo", monkeypatch, next(out), *dpo_args, "--loss_type", "bco_pair")
    # reward_model.py: preference, orm, prm
    rm_args = [*TINY[:-2], "--block_size", "64", "--max_len", "64", "--batch_size", "4", *steps]
    logged |= run(capsys, "reward_model", monkeypatch, next(out), "--data_path", pairs, "--tokenizer", "char", *rm_args)
    for task in ("orm", "prm"):
        synthetic = ["--task", task, "--n_train", "100", "--n_val", "20", "--steps", "2" if task == "prm" else "1"]
        logged |= run(capsys, "reward_model", monkeypatch, next(out), *synthetic, *rm_args)
    # rookworld_grpo.py: --adv ema (the baselines), --value_head (the value loss)
    rw = importlib.import_module("rookworld_grpo")
    run_main(rw, monkeypatch, "--make_data", "30", "--out", rook_data)
    rook_init = bpe_checkpoint(tmp_path / "rook.pt", block_size=192)
    rook = ["--init_from", rook_init, "--data_path", rook_data, "--batch_size", "2", "--group_size", "2"]
    rook += ["--horizon", "8", "--eval_size", "2", *steps]
    logged |= run(capsys, "rookworld_grpo", monkeypatch, next(out), *rook, "--adv", "ema")
    logged |= run(capsys, "rookworld_grpo", monkeypatch, next(out), *rook, "--value_head")

    documented = documented_names()
    assert not logged - documented, f"logged but not in docs/metrics.md: {sorted(logged - documented)}"
    unlogged = documented - logged - CUDA_ONLY
    assert not unlogged, f"in docs/metrics.md but logged by no run: {sorted(unlogged)}"
