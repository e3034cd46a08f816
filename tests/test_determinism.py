"""--deterministic: two CPU runs of a script with the same seed write the same metrics.jsonl (timings under perf/
aside) and the same final weights (SPEC section 4). Each run is a separate process, so that anything that depends
on the process (the hash seed of str, set iteration order, object addresses) shows up as a difference.

The data of the runs that read JSONL or RookWorld lines holds a few malformed lines: they are skipped with a count
on stderr and the run goes on (the other half of the bad-input matrix's "all lines malformed" case)."""

import random

import pytest
import torch
from conftest import BPE_AVAILABLE, bpe_checkpoint, char_checkpoint, hh_file, metrics, run_script, synthetic_text

MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "32", "--device", "cpu"]
BAD_LINES = 'not json\n{"rejected": "no chosen field"}\n'


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    import rookworld_grpo

    d = tmp_path_factory.mktemp("inputs")
    ns = {"text": d / "text.txt", "hh": d / "hh.jsonl", "rook": d / "rook.txt"}
    ns["text"].write_text(synthetic_text(4000))
    hh_file(ns["hh"], n=24)
    ns["hh"].write_text(ns["hh"].read_text() + BAD_LINES)
    lines = rookworld_grpo.make_lines(40, random.Random(0))
    ns["rook"].write_text("\n".join([*lines[:20], "garbage", *lines[20:]]) + "\n")
    ns["hh_ckpt"] = char_checkpoint(d / "hh_ckpt.pt", "".join(sorted(set(ns["hh"].read_text()))), block_size=64)
    ns["bpe_ckpt"] = bpe_checkpoint(d / "bpe_ckpt.pt", block_size=192)
    return type("Files", (), ns)


def run_args(script, f):
    """A few steps of a tiny model with every source of randomness the script has (dropout, sampling) switched on."""
    steps = ["--max_steps", "3", "--eval_every", "3", "--seed", "7", "--deterministic"]
    rl = ["--context_len", "8", "--horizon", "4", "--temperature", "1.0"]
    return [*steps, *{
        "gpt": ["--data", f.text, *MODEL, "--batch_size", "4", "--dropout", "0.1", "--eval_iters", "1",
                "--num_samples", "1", "--sample_tokens", "8"],
        "char_grpo": ["--data", f.text, *MODEL, *rl, "--batch_size", "2", "--group_size", "2",
                      "--eval_size", "4"],
        "grpo": ["--data", f.text, *MODEL, *rl, "--tokenizer", "char", "--batch_size", "2", "--group_size", "2",
                 "--eval_size", "4"],
        "ppo": ["--data", f.text, *MODEL, *rl, "--tokenizer", "char", "--batch_size", "4", "--num_minibatches", "2",
                "--ppo_epochs", "2", "--eval_size", "4"],
        "dpo": ["--data_path", f.hh, "--init_from", f.hh_ckpt, "--max_len", "64", "--batch_size", "2",
                "--dropout", "0.1", "--eval_size", "2", "--num_samples", "1", "--sample_tokens", "4",
                "--device", "cpu"],
        "reward_model": ["--data_path", f.hh, *MODEL, "--block_size", "64", "--tokenizer", "char",
                         "--batch_size", "2", "--dropout", "0.1", "--eval_size", "2"],
        "rookworld_grpo": ["--data_path", f.rook, "--init_from", f.bpe_ckpt, "--batch_size", "2", "--group_size", "2",
                           "--horizon", "8", "--eval_size", "2", "--device", "cpu"],
    }[script]]  # fmt: skip


SKIP_COUNT = {"dpo": "skipped 2 malformed line(s)", "reward_model": "skipped 2 malformed line(s)"}
SKIP_COUNT["rookworld_grpo"] = "skipped 1 line(s) in neither format"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo"])
def test_two_deterministic_cpu_runs_with_one_seed_write_identical_metrics(script, f, tmp_path):
    if script == "rookworld_grpo" and not BPE_AVAILABLE:
        pytest.skip("GPT-2 BPE files unavailable")
    outs = [tmp_path / "a", tmp_path / "b"]
    for hash_seed, out in enumerate(outs):  # str hashes, and so the order of sets of strings, differ between the two
        env = {"PYTHONHASHSEED": str(hash_seed)}
        proc = run_script(f"{script}.py", *run_args(script, f), "--out_dir", out, env=env, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert script not in SKIP_COUNT or SKIP_COUNT[script] in proc.stderr, proc.stderr[-3000:]
    first, second = metrics(outs[0]), metrics(outs[1])
    assert sum("train/lr" in r for r in first) == 3 and sum("train/grad_norm" in r for r in first) == 3, first
    assert first == second
    weights = [torch.load(out / "ckpt.pt", weights_only=True)["model"] for out in outs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
