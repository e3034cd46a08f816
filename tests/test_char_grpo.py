"""char_grpo.py: the reward, the bigram reference, and end-to-end runs (run folder, resume, torchrun, learning)."""

import json
import math

import pytest
import torch
from conftest import ROOT, run_script, torchrun

import char_grpo as cg

TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--context_len", "8"]
SMALL_RUN = [*TINY, "--horizon", "4", "--batch_size", "4", "--group_size", "4", "--eval_contexts", "16"]


def metrics(out_dir):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_rewards_hand_values_for_both_modes_and_partial_credit():
    """Rollout 'abxd' vs truth 'abcd': plus1 -> 1 1 0 1; pm1 -> 1 1 -1 1; partial credit adds w * log p."""
    rollout, truth = torch.tensor([[0, 1, 9, 3]]), torch.tensor([[0, 1, 2, 3]])
    assert cg.char_rewards(rollout, truth, "plus1").tolist() == [[1, 1, 0, 1]]
    assert cg.char_rewards(rollout, truth, "pm1").tolist() == [[1, 1, -1, 1]]
    logp_true = torch.log(torch.tensor([[0.5, 0.25, 0.125, 1.0]]))
    got = cg.char_rewards(rollout, truth, "plus1", logp_true, 0.5)
    assert torch.allclose(got, torch.tensor([[1 - 0.5 * math.log(2), 1 - math.log(2), -1.5 * math.log(2), 1.0]]))


def test_bigram_reference_is_the_normalised_add_one_counts():
    """ids 0 1 0 1 2 over a 3-token vocabulary: p(next | prev) = (count + 1) / (count(prev) + 3), rows sum to 1."""
    table = cg.bigram_logprobs(torch.tensor([0, 1, 0, 1, 2]), 3).exp()
    counts = torch.tensor([[0.0, 2, 0], [1, 0, 1], [0, 0, 0]]) + 1
    assert torch.allclose(table, counts / counts.sum(1, keepdim=True))
    assert torch.allclose(table.sum(1), torch.ones(3))


def test_run_writes_the_run_folder_and_resume_reproduces_metrics(tmp_path, text_file):
    """A few GRPO steps write SPEC section 4's folder; stopping at 4 of 6 steps and resuming gives the same metrics."""
    common = ["--data", text_file, *SMALL_RUN, "--eval_every", "2", "--save_every", "2", "--log_every", "1"]
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--reference", "init", "--partial_logprob", "0.1", "--ppo_epochs", "2", "--grad_accum", "2"]
    assert run_script("char_grpo.py", *common, *args, "--out_dir", full, "--max_steps", "6").returncode == 0
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt", "samples.txt"):
        assert (full / name).is_file(), name
    proc = run_script("char_grpo.py", *common, *args, "--out_dir", part, "--max_steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # resuming keeps the run's settings; only --max_steps is given again (the lr schedule follows max_steps)
    cfg = json.loads((part / "config.json").read_text())
    assert cfg["reference"] == "init"
    proc = run_script("char_grpo.py", "--resume", "--out_dir", part, "--max_steps", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = metrics(full), metrics(part)
    # the lr schedule depends on max_steps, so compare the steps both runs took with the same settings
    assert [r for r in a if r["step"] < 4] == [r for r in b if r["step"] < 4]
    keys = {"rl/reward_mean", "rl/kl", "rl/tokens"}
    assert all(k in r for r in a if "train/loss" in r for k in keys)
    results = json.loads((full / "final_results.json").read_text())
    assert results["tokens"] == 6 * 4 * 4 * 4 and 0 <= results["next_char_acc"] <= 1


def test_supervised_and_compare_runs(tmp_path, text_file):
    """--compare runs GRPO then the supervised baseline on the same token budget; final_results.json holds both."""
    out = tmp_path / "cmp"
    proc = run_script(
        "char_grpo.py",
        "--data",
        text_file,
        *SMALL_RUN,
        "--compare",
        "--max_steps",
        "3",
        "--eval_every",
        "3",
        "--out_dir",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "final_results.json").read_text())
    assert results["grpo"]["tokens"] == results["supervised"]["tokens"] == 3 * 4 * 4 * 4
    assert (out / "compare.png").is_file() and (out / "supervised" / "ckpt.pt").is_file()
    assert torch.load(out / "supervised" / "ckpt.pt", weights_only=True)["supervised"] is True


@pytest.mark.distributed
def test_two_process_gloo_run(tmp_path, text_file):
    """torchrun with 2 CPU ranks trains, counts both ranks' tokens, and saves one checkpoint."""
    out = tmp_path / "run"
    proc = torchrun(
        ROOT / "char_grpo.py",
        2,
        "--device",
        "cpu",
        "--data",
        text_file,
        *SMALL_RUN,
        "--max_steps",
        "2",
        "--eval_every",
        "2",
        "--out_dir",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["tokens"] == 2 * 2 * 4 * 4 * 4 and len(ckpt["rng_ranks"]) == 2


@pytest.mark.learning
def test_mean_reward_rises_on_repetitive_text(tmp_path):
    """On a text that repeats one short phrase, GRPO alone lifts the per-character reward far above chance."""
    path = tmp_path / "rep.txt"
    path.write_text("the cat sat on the mat. " * 400)  # chance per character: about 1/11
    out = tmp_path / "run"
    proc = run_script(
        "char_grpo.py",
        "--data",
        path,
        *TINY,
        "--horizon",
        "8",
        "--batch_size",
        "8",
        "--group_size",
        "8",
        "--max_steps",
        "80",
        "--lr",
        "3e-3",
        "--warmup_steps",
        "5",
        "--eval_every",
        "80",
        "--out_dir",
        out,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rewards = [r["rl/reward_mean"] for r in metrics(out) if "rl/reward_mean" in r]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert start < 0.15 and end > 2 * start and end > start + 0.1, (start, end)
