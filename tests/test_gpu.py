"""The GPU tier: each test compares a result on CUDA with a reference (CPU, float32, eager). Marked `gpu` and
skipped without CUDA, so CI (CPU only) skips them; run them with `pytest -m gpu` on a machine with a GPU."""

import json

import pytest
import torch
from conftest import BPE_AVAILABLE, ROOT, bpe_checkpoint, char_checkpoint, hh_file, run_script, torchrun

from gpt import GPT, GPTConfig, decode_step, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHARS = "\n !'),-.:?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+=*"


def small_model(seed=0, vocab=96, block=128):
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block, vocab_size=vocab, n_layer=2, n_head=4, n_embd=128)
    return GPT(config)


@pytest.fixture
def no_tf32():
    """float32 matrix products in full float32 on the GPU (TF32 rounds them to 10 mantissa bits)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_float32_greedy_generation_on_cuda_equals_cpu(no_tf32):
    """The same weights and prompts give the same 32 greedy tokens on CUDA as on CPU, cache and left padding
    included (prompts of different lengths)."""
    model = small_model()
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    cpu_tokens, cpu_mask = generate(model.eval(), prompts, 32, temperature=0.0)
    gpu_tokens, gpu_mask = generate(model.cuda().eval(), prompts, 32, temperature=0.0)
    assert cpu_tokens.shape == (3, 32)
    assert torch.equal(gpu_tokens.cpu(), cpu_tokens)
    assert torch.equal(gpu_mask.cpu(), cpu_mask)


def test_the_compiled_decode_step_is_one_cuda_graph_and_gives_the_eager_tokens(no_tf32):
    """decode_step compiled as --compile compiles it (reduce-overhead: CUDA graphs) gives eager decoding's tokens
    and masks, greedy, sampled under one generator, ragged prompts and rows that stop at eos, and no step falls
    back from its CUDA graph."""
    model = small_model().cuda().eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    torch._dynamo.reset()
    decode = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    inductor = torch._dynamo.utils.counters["inductor"]
    skips = inductor["cudagraph_skips"]
    eos = [int(generate(model, prompts, 8, temperature=0.0)[0][0, 3])]  # row 0 stops at its fourth token
    for kwargs in (dict(temperature=0.0), dict(temperature=0.0, eos_id=eos), dict(temperature=1.0)):
        eager = generate(model, prompts, 32, generator=torch.Generator("cuda").manual_seed(7), **kwargs)
        fast = generate(model, prompts, 32, generator=torch.Generator("cuda").manual_seed(7), decode=decode, **kwargs)
        assert torch.equal(fast[0], eager[0]) and torch.equal(fast[1], eager[1])
    assert inductor["cudagraph_skips"] == skips
    torch._dynamo.reset()


def batch(seed=1, B=8, T=128, V=96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    return x.cuda(), y.cuda()


def train_step_loss(model, x, y, dtype):
    """One AdamW step's loss (forward under autocast as the scripts do), and the loss after the step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, y, output="loss")
    loss.backward()
    optimizer.step()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        _, after = model(x, y, output="loss")
    return loss.item(), after.item()


def test_bfloat16_autocast_training_step_loss_is_within_two_percent_of_float32(no_tf32):
    """A training step under bf16 autocast reports a loss within 2% of the float32 step on the same batch, before
    and after the optimizer step."""
    x, y = batch()
    fp32 = train_step_loss(small_model().cuda(), x, y, torch.float32)
    bf16 = train_step_loss(small_model().cuda(), x, y, torch.bfloat16)
    assert fp32[1] < fp32[0]  # the step learned something, so "after" compares trained weights
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * abs(a), (fp32, bf16)


def test_compiled_training_step_gives_the_eager_loss_to_bfloat16_tolerance():
    """torch.compile of the model gives the eager model's loss (bf16 autocast) before and after one step."""
    x, y = batch(seed=2)
    eager = train_step_loss(small_model().cuda(), x, y, torch.bfloat16)
    compiled = train_step_loss(torch.compile(small_model().cuda()), x, y, torch.bfloat16)
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-2 * abs(a), (eager, compiled)


def final_metrics(out_dir):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def test_grpo_and_ppo_train_three_steps_on_cuda(tmp_path, text_file):
    """grpo.py and ppo.py (char next_token, tiny model) take three finite steps on CUDA in bf16."""
    tiny = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--tokenizer", "char"]
    tiny += ["--context_len", "16", "--horizon", "8", "--batch_size", "8", "--max_steps", "3", "--eval_size", "8"]
    for script in ("grpo.py", "ppo.py"):
        out = tmp_path / script
        proc = run_script(script, "--data", text_file, *tiny, "--device", "cuda", "--out_dir", out)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = final_metrics(out)
        assert len(rows) == 3 and all(abs(r["train/loss"]) < 1e6 for r in rows)
        assert json.loads((out / "config.json").read_text())["device"] == "cuda"


def test_dpo_trains_three_steps_on_cuda(tmp_path):
    """dpo.py on HH-shaped pairs from a char checkpoint: three finite steps on CUDA in bf16."""
    data = hh_file(tmp_path / "hh.jsonl", n=60)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    chars = "".join(sorted(set("".join(r["chosen"] + r["rejected"] for r in records))))
    init = char_checkpoint(tmp_path / "init.pt", chars, block_size=64)
    args = ["--data_path", data, "--init_from", init, "--max_len", "64", "--batch_size", "4", "--max_steps", "3"]
    proc = run_script("dpo.py", *args, "--sample_tokens", "8", "--device", "cuda", "--out_dir", tmp_path / "dpo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(final_metrics(tmp_path / "dpo")) == 3


@pytest.mark.skipif(not BPE_AVAILABLE, reason="GPT-2 BPE files unavailable")
def test_rookworld_grpo_trains_three_steps_on_cuda(tmp_path):
    """rookworld_grpo.py on --make_data lines (random play, no Stockfish) from a tiny BPE checkpoint: three steps."""
    pytest.importorskip("chess")
    data = tmp_path / "data.txt"
    proc = run_script("rookworld_grpo.py", "--make_data", "40", "--out", data)
    assert proc.returncode == 0, proc.stderr[-2000:]
    init = bpe_checkpoint(tmp_path / "init.pt", block_size=192)
    args = ["--init_from", init, "--data_path", data, "--batch_size", "2", "--group_size", "4", "--horizon", "40"]
    args += ["--eval_size", "2", "--max_steps", "3", "--device", "cuda", "--out_dir", tmp_path / "rw"]
    proc = run_script("rookworld_grpo.py", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(final_metrics(tmp_path / "rw")) == 3


def test_torchrun_fsdp_on_cuda_runs_and_resumes_to_the_uninterrupted_metrics(tmp_path, text_file):
    """torchrun --nproc_per_node=1 --parallel fsdp on CUDA (nccl): stopped by SIGTERM after step 2 of 4, saved,
    resumed; the resumed run ends at the uninterrupted run's step count and its losses are close to them (CUDA
    kernels need not be bitwise deterministic, so only closeness is asked)."""
    args = ["--data", text_file, "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64"]
    args += ["--tokenizer", "char", "--context_len", "16", "--horizon", "8", "--batch_size", "8", "--max_steps", "4"]
    args += ["--save_every", "2", "--eval_size", "8", "--device", "cuda", "--parallel", "fsdp", "--dtype", "float32"]
    full, part = tmp_path / "full", tmp_path / "part"
    proc = torchrun(ROOT / "grpo.py", 1, *args, "--out_dir", full)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = torchrun(ROOT / "grpo.py", 1, *args, "--out_dir", part, env={"FAULT_SIGTERM_AT_STEP": "2"})
    assert proc.returncode != 0 and (part / "ckpt.pt").is_file(), proc.stderr[-2000:]
    assert torch.load(part / "ckpt.pt", weights_only=True, map_location="cpu")["step"] == 2
    proc = torchrun(ROOT / "grpo.py", 1, "--resume", "--out_dir", part)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = final_metrics(full), final_metrics(part)
    assert len(a) == 4 and [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-3, abs=1e-4)
