"""bench.py prints one parseable JSON line per measurement, and ddp_launch.sh documents itself, rejects bad
arguments with exit code 2 and launches a real two-process gpt.py run through torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpe, run_script

LAUNCH = ROOT / "ddp_launch.sh"
# the launcher finds torchrun (or python) on PATH: put this interpreter's bin folder first, as an activated venv does
LAUNCH_ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "disabled",
    "PYTHONUNBUFFERED": "1",
}


def launch(*args, timeout=60):
    return subprocess.run(
        ["bash", str(LAUNCH), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=LAUNCH_ENV,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_bench_prints_one_json_line_with_a_positive_value_per_measurement():
    """A tiny CPU run of all four measurements: stdout is only JSON lines, one per name, each positive."""
    names = ["sample_kv", "sample_nocache", "train", "memory"]
    args = ["--model", "tiny", "--only", ",".join(names), "--batch_size", "4", "--prompt_len", "8"]
    args += ["--new_tokens", "8", "--train_batch", "2", "--train_seq", "32", "--repeats", "1", "--warmup", "0"]
    proc = run_script("bench.py", *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert sorted(r["bench"] for r in rows) == sorted(names)
    for r in rows:
        assert r["value"] > 0 and r["model"] == "tiny" and r["device"] == "cpu" and r["dtype"] == "float32", r
    units = {r["bench"]: r["unit"] for r in rows}
    assert units == {"sample_kv": "tokens/s", "sample_nocache": "tokens/s", "train": "tokens/s", "memory": "MB"}
    assert next(r for r in rows if r["bench"] == "train")["mfu"] is None  # no peak FLOPs on CPU


@pytest.mark.slow
@needs_bpe
def test_bench_times_a_step_of_each_post_training_script():
    """The *_step measurements run the scripts themselves on tiny work: a positive median in ms per step, the
    child's peak memory, and the script named."""
    names = ["grpo_step", "ppo_step", "dpo_step", "rm_step", "rookworld_step"]
    args = ["--model", "tiny", "--only", ",".join(names), "--prompt_len", "4", "--new_tokens", "4", "--rl_prompts", "2"]
    args += ["--group_size", "2", "--pairs", "2", "--pair_len", "16", "--rw_prompts", "2", "--rw_samples", "2"]
    args += ["--repeats", "1", "--warmup", "0"]
    proc = run_script("bench.py", *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["bench"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(rows) == sorted(names)
    scripts = {"grpo_step": "grpo.py", "ppo_step": "ppo.py", "dpo_step": "dpo.py", "rm_step": "reward_model.py"}
    scripts["rookworld_step"] = "rookworld_grpo.py"
    for name, r in rows.items():
        assert r["unit"] == "ms" and r["value"] > 0 and r["peak_mb"] > 100 and r["script"] == scripts[name], r


TINY_SAMPLING = ["--model", "tiny", "--batch_size", "2", "--prompt_len", "4", "--new_tokens", "4"]
TINY_SAMPLING += ["--repeats", "1", "--warmup", "0"]
SAMPLE_FIELDS = ("seconds", "prefill_ms", "decode_step_ms")


def test_bench_sampling_rows_give_prefill_and_ms_per_decode_step():
    """sample_kv and sample_nocache keep their tokens/s value and add the prefill's ms and the decode loop's ms per
    new token, all positive; the decode steps and the prefill together take no longer than the whole run."""
    proc = run_script("bench.py", *TINY_SAMPLING, "--only", "sample_kv,sample_nocache", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["bench"] for r in rows] == ["sample_kv", "sample_nocache"]
    for r in rows:
        assert r["unit"] == "tokens/s" and r["value"] > 0, r
        assert all(isinstance(r[k], float) and r[k] > 0 for k in SAMPLE_FIELDS), r
        assert r["prefill_ms"] + r["new_tokens"] * r["decode_step_ms"] <= 1000 * r["seconds"] * 1.01, r


def test_bench_sample_kv_profile_writes_a_table_sorted_by_cpu_time_beside_trains(tmp_path):
    """sample_kv --profile writes its own table (sorted by self CPU time: the host's share of decoding) to
    --profile_out with _sample_kv before the suffix, named in the sample_kv row; train's keeps --profile_out."""
    out = tmp_path / "profile.txt"
    args = ["--model", "tiny", "--only", "sample_kv,train", "--train_batch", "2", "--train_seq", "16"]
    args += ["--batch_size", "2", "--prompt_len", "4", "--new_tokens", "4", "--repeats", "1", "--warmup", "0"]
    proc = run_script("bench.py", *args, "--profile", "--profile_out", out, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["bench"]: row for row in map(json.loads, proc.stdout.splitlines())}
    assert rows["train"]["profile"] == str(out)
    assert rows["sample_kv"]["profile"] == str(tmp_path / "profile_sample_kv.txt")
    table = (tmp_path / "profile_sample_kv.txt").read_text()
    assert "bench.py sample_kv --profile" in table and "aten::" in table and "self_cpu_time_total" in table


def test_bench_train_profile_writes_a_table_of_aten_ops(tmp_path):
    """train --profile writes the profiler's table of top ops by self CPU time to --profile_out, names the file in
    the train row, and keeps stdout one JSON line per measurement."""
    out = tmp_path / "profile.txt"
    args = ["--model", "tiny", "--only", "train", "--train_batch", "2", "--train_seq", "16", "--repeats", "1"]
    args += ["--warmup", "0", "--profile", "--profile_out", out]
    proc = run_script("bench.py", *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["bench"] == "train" and row["value"] > 0 and row["profile"] == str(out), row
    table = out.read_text()
    assert "aten::" in table and "self_cpu_time_total" in table, table[:2000]


def test_bench_vs_hf_adds_a_static_cache_peer_row_with_the_same_fields():
    """--vs hf --only sample_kv: one row each for ours, transformers' generate (impl hf) and generate with a static
    KV cache (impl hf_static), the peers with the same fields as ours plus speedup and decode_speedup. Skipped
    without transformers, or when this transformers cannot sample GPT-2 with a static cache (bench.py says so)."""
    pytest.importorskip("transformers")
    proc = run_script("bench.py", *TINY_SAMPLING, "--only", "sample_kv", "--vs", "hf", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "cannot sample GPT-2 with a static cache" in proc.stderr:
        pytest.skip("this transformers has no static cache for GPT-2")
    rows = {r["impl"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(rows) == ["hf", "hf_static", "ours"]
    for impl in ("hf", "hf_static"):
        r = rows[impl]
        assert r["bench"] == "sample_kv" and r["unit"] == "tokens/s" and r["value"] > 0, r
        assert all(isinstance(r[k], float) and r[k] > 0 for k in SAMPLE_FIELDS + ("speedup", "decode_speedup")), r
        ratio = rows["ours"]["value"] / r["value"]
        assert abs(r["speedup"] / ratio - 1) < 0.01, (r, rows["ours"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["--only", "nope"], ["--vs", "trl"], ["--group_size", "1"], ["--profile", "--only", "memory"]]
)
def test_bench_new_flags_refuse_bad_values_in_one_line(args):
    proc = run_script("bench.py", *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--only", "nope"], ["--batch_size", "0"], ["--model", "huge"], ["--bogus"]])
def test_bench_bad_flag_exits_2_with_one_line(args):
    """Bad input is refused before any model is built: one line on stderr, exit code 2."""
    proc = run_script("bench.py", *args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_launch_help_exits_0_and_documents_multi_node(flag):
    """--help prints the usage with the multi-node variables and the CPU smoke example, and exits 0."""
    proc = launch(flag)
    assert proc.returncode == 0, proc.stderr
    for word in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "--device cpu"):
        assert word in proc.stdout, word


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["gpt.py"], ["gpt.py", "0"], ["gpt.py", "-1"], ["gpt.py", "two"], ["no.py", "2"]])
def test_launch_missing_or_bad_arguments_exit_2_with_one_line(args):
    """Missing SCRIPT/NPROC, an NPROC that is not a positive integer, or no such script: one line, exit 2."""
    proc = launch(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_launch_is_executable():
    """git keeps the mode bit, so `./ddp_launch.sh` works in a fresh clone."""
    assert os.access(LAUNCH, os.X_OK)


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_runs_gpt_py_on_two_cpu_processes_and_saves_a_checkpoint(tmp_path, text_file):
    """ddp_launch.sh gpt.py 2 --device cpu trains under torchrun (gloo) with 2 ranks and writes ckpt.pt."""
    out = tmp_path / "run"
    args = ["--device", "cpu", "--data", text_file, "--n_layer", "1", "--n_head", "2", "--n_embd", "16"]
    args += ["--block_size", "16", "--batch_size", "2", "--max_steps", "3", "--eval_every", "3", "--eval_iters", "1"]
    args += ["--log_every", "1", "--num_samples", "1", "--sample_tokens", "4", "--out_dir", out]
    proc = launch("gpt.py", "2", *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "M parameters, 2 x cpu," in proc.stdout
    assert (out / "ckpt.pt").is_file()
