"""gpt.py end to end: the run folder, exact resume, checkpoints, data preparation, distributed gradients, and
bad input answered with one line and exit code 2."""

import importlib
import json
import os
import random
import subprocess
import sys
import zlib

import pytest
import torch
from conftest import ROOT, TINY, metrics, needs_bpe, run_main, run_script, torchrun

import gpt

RUN = [*TINY, "--eval_iters", "2", "--log_every", "1", "--num_samples", "1", "--sample_tokens", "8"]


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.plots
def test_default_style_run_writes_the_run_folder_and_learns(tmp_path, text_file, monkeypatch):
    """A short gpt.py run writes every file of SPEC section 4, and its val loss beats character frequencies."""
    out = tmp_path / "run"
    args = ["--data", text_file, "--out_dir", out, *RUN, "--max_steps", "80", "--eval_every", "40"]
    run_main(gpt, monkeypatch, *args, "--warmup_steps", "5", "--lr", "1e-2")
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt", "samples.txt"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["max_steps"] == 80 and config["data"] == str(text_file)
    results = json.loads((out / "final_results.json").read_text())
    vocab = len(set(text_file.read_text()))
    first = metrics(out)[0]["eval/val_loss"]
    assert first == pytest.approx(torch.log(torch.tensor(float(vocab))).item(), abs=0.3)  # random init: ~uniform
    counts = torch.tensor([float(text_file.read_text().count(c)) for c in set(text_file.read_text())])
    unigram_entropy = -(counts / counts.sum() * (counts / counts.sum()).log()).sum().item()
    assert results["final_val_loss"] < unigram_entropy - 0.3  # it uses context, not just character frequencies
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert {"model", "model_config", "tokenizer", "step", "optimizer", "rng", "config"} <= set(ckpt)
    assert ckpt["step"] == 80 and ckpt["tokenizer"]["type"] == "char"
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_metrics(tmp_path, text_file, monkeypatch):
    """Stop after 8 of 12 steps, resume: metrics.jsonl equals the uninterrupted run's (dropout on, so RNG matters)."""
    common = ["--data", text_file, *RUN, "--dropout", "0.1", "--eval_every", "4", "--save_every", "4"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(gpt, monkeypatch, *common, "--out_dir", full, "--max_steps", "12")
    run_main(gpt, monkeypatch, *common, "--out_dir", part, "--max_steps", "8", "--lr_decay_steps", "12")
    assert_ok(run_script("gpt.py", "--resume", "--out_dir", part, "--max_steps", "12"))  # a fresh interpreter
    assert metrics(part) == metrics(full)
    a = torch.load(full / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(part / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_resumed_float16_run_continues_the_loss_scale_of_the_uninterrupted_run(tmp_path, text_file, monkeypatch):
    """With --dtype float16 the GradScaler's state (its loss scale and growth tracker) is part of the checkpoint:
    a run resumed at step 4 ends with the uninterrupted run's scaler state and metrics, instead of restarting at
    scale 65536 and skipping steps the uninterrupted run would not."""
    common = ["--data", text_file, *RUN, "--dtype", "float16", "--device", "cpu", "--eval_every", "6"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(gpt, monkeypatch, *common, "--out_dir", full, "--max_steps", "6")
    run_main(gpt, monkeypatch, *common, "--out_dir", part, "--max_steps", "4", "--lr_decay_steps", "6")
    run_main(gpt, monkeypatch, "--resume", "--out_dir", part, "--max_steps", "6")
    scaler = torch.load(full / "ckpt.pt", weights_only=True)["scaler"]
    assert scaler["_growth_tracker"] == 6  # six finite steps in a row: the scaler is in use on this device
    assert torch.load(part / "ckpt.pt", weights_only=True)["scaler"] == scaler
    assert metrics(part) == metrics(full)


@pytest.mark.slow
def test_the_default_data_ships_with_the_repository_and_runs_offline(tmp_path):
    """gpt.py's default data (char-level tiny Shakespeare) is data/tinyshakespeare.txt beside the script: a copy of
    gpt.py and data/ alone (no ../shared, started from another folder, every download failing through a dead proxy)
    trains a few steps with its default data and writes the run folder."""
    clone = tmp_path / "clone"
    (clone / "data").mkdir(parents=True)
    (clone / "gpt.py").write_text((ROOT / "gpt.py").read_text())
    (clone / "data" / "tinyshakespeare.txt").write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dead = "http://127.0.0.1:9"  # nothing listens: any download fails at once
    env = {"HTTP_PROXY": dead, "HTTPS_PROXY": dead, "http_proxy": dead, "https_proxy": dead, "NO_PROXY": ""}
    proc = subprocess.run(
        [sys.executable, str(clone / "gpt.py"), *TINY, "--max_steps", "3", "--eval_every", "3", "--eval_iters", "1"]
        + ["--num_samples", "1", "--sample_tokens", "8", "--out_dir", "run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=elsewhere,
        env={**os.environ, **env},
    )
    assert_ok(proc)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "ckpt.pt", "samples.txt"):
        assert (elsewhere / "run" / name).is_file(), name
    assert json.loads((elsewhere / "run" / "config.json").read_text())["data"] == "shakespeare_char"
    assert not (elsewhere / "data").exists()  # nothing was downloaded next to the working folder


@pytest.mark.slow
def test_checkpoint_loads_as_init_from_with_the_same_weights(tmp_path, text_file, monkeypatch):
    """ckpt.pt round-trips: load_model gives the saved weights and tokenizer, and --init_from trains from it."""
    out = tmp_path / "run"
    run_main(gpt, monkeypatch, "--data", text_file, "--out_dir", out, *RUN, "--max_steps", "3")
    model, spec, ckpt = gpt.load_model(str(out / "ckpt.pt"))
    assert spec == {"type": "char", "chars": "".join(sorted(set(text_file.read_text())))}
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k
    run_main(
        gpt,
        monkeypatch,
        "--data",
        text_file,
        "--init_from",
        out / "ckpt.pt",
        "--out_dir",
        tmp_path / "ft",
        *RUN,
        "--max_steps",
        "2",
    )
    assert torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=True)["step"] == 2


@needs_bpe
def test_hh_sft_masks_everything_but_assistant_turns():
    """In an HH dialogue only Assistant replies (and the final <|endoftext|>) are SFT targets."""
    tok = gpt.BPETokenizer()
    ids, mask = gpt.hh_dialogue("\n\nHuman: Hi there\n\nAssistant: Hello friend\n\nHuman: Bye\n\nAssistant: Ciao", tok)
    targets = tok.decode([i for i, m in zip(ids, mask) if m and i != tok.eot_id])
    assert targets == " Hello friend Ciao"
    assert ids[-1] == tok.eot_id and mask[-1]
    assert tok.decode(ids[:-1]) == "\n\nHuman: Hi there\n\nAssistant: Hello friend\n\nHuman: Bye\n\nAssistant: Ciao"


def test_arithmetic_problems_have_correct_answers():
    """Every generated problem's answer is the value of its expression, operands within --digits."""
    rng = random.Random(0)
    for _ in range(500):
        prompt, answer = gpt.arithmetic_problem(rng, 3, "+-*")
        a, op, b = prompt[:-1].partition(next(c for c in "+-*" if c in prompt[1:]))
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert answer == f"{expected}\n" and prompt.endswith("=")
        assert len(a) <= 3 and len(b) <= 3


def test_arithmetic_sft_trains_on_no_held_out_problem_and_validates_on_held_out_ones_only():
    """SPEC section 8: a problem is held out iff crc32(prompt) % 10 == 0 (written here again, so the rule itself is
    checked). No training line of --data arithmetic is held out, every validation line is; at --digits 1 the
    validation split covers all 37 held-out problems of the 300."""
    cfg = gpt.Config(data="arithmetic", digits=1, ops="+-*")
    tok = gpt.CharTokenizer(gpt.ARITHMETIC_CHARS)
    (train_ids, _), (val_ids, _) = gpt.load_splits(cfg, tok)
    train = [line.split("=")[0] + "=" for line in tok.decode(train_ids.tolist()).splitlines()]
    val = [line.split("=")[0] + "=" for line in tok.decode(val_ids.tolist()).splitlines()]
    assert len(train) == 20000 and len(val) == 1000
    assert not any(zlib.crc32(prompt.encode()) % 10 == 0 for prompt in train)
    assert all(zlib.crc32(prompt.encode()) % 10 == 0 for prompt in val) and len(set(val)) == 37
    assert all(gpt.held_out(prompt) == (zlib.crc32(prompt.encode()) % 10 == 0) for prompt in train[:500] + val)


@pytest.mark.slow
def test_char_level_arithmetic_uses_the_arithmetic_alphabet(tmp_path, monkeypatch):
    """--data arithmetic --tokenizer char trains on the 15 characters of the problems (grpo.py starts from it)."""
    out = tmp_path / "run"
    args = ["--data", "arithmetic", "--tokenizer", "char", "--digits", "1", *TINY, "--max_steps", "2"]
    run_main(
        gpt, monkeypatch, *args, "--eval_every", "2", "--eval_iters", "1", "--sample_tokens", "4", "--out_dir", out
    )
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["tokenizer"] == {"type": "char", "chars": gpt.ARITHMETIC_CHARS} and len(gpt.ARITHMETIC_CHARS) == 15


def test_read_jsonl_skips_bad_lines_and_rejects_a_file_with_none(tmp_path, capsys):
    """Malformed lines are counted and skipped; a file with no usable line is an error (exit 2)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"chosen": "a"}\nnot json\n{"chosen": ""}\n{"other": "x"}\n\n{"chosen": "b"}\n')
    assert [r["chosen"] for r in gpt.read_jsonl(str(path), ["chosen"])] == ["a", "b"]
    assert "skipped 3 malformed" in capsys.readouterr().err
    path.write_text("nope\n[1, 2]\n")
    with pytest.raises(SystemExit) as e:
        gpt.read_jsonl(str(path), ["chosen"])
    assert e.value.code == 2


def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    """Warm-up rises to lr; the decay ends at min_lr and stays there."""
    lrs = [gpt.cosine_lr(s, 1.0, 0.1, 10, 100) for s in range(120)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert max(lrs) <= 1.0 and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:101]))
    assert lrs[100] == lrs[119] == 0.1


def test_cosine_schedule_without_min_lr_decays_to_a_tenth_of_lr():
    """An unset --min_lr is --lr / 10 (nanoGPT's rule): a small --lr decays instead of climbing to a fixed floor."""
    lrs = [gpt.cosine_lr(s, 3e-5, None, 5, 150) for s in range(160)]
    assert max(lrs) == pytest.approx(3e-5) and lrs[150] == pytest.approx(3e-6)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))


@pytest.mark.parametrize("script", ["gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo"])
def test_every_script_leaves_min_lr_unset_by_default(script):
    """No script carries a fixed --min_lr default, which a smaller --lr would sit below."""
    module = importlib.import_module(script)
    assert module.Config().min_lr is None and module.cosine_lr(10**6, 1e-5, None, 0, 100) == pytest.approx(1e-6)


def test_config_flags_parse_types_booleans_and_help(capsys):
    """Every Config field is a flag: --key value, --key=value, --flag/--no-flag; --help lists them all."""
    cfg = gpt.parse_config(gpt.Config, ["--lr=0.01", "--max_steps", "7", "--compile", "--no-bias"])
    assert (cfg.lr, cfg.max_steps, cfg.compile, cfg.bias) == (0.01, 7, True, False)
    with pytest.raises(SystemExit):
        gpt.parse_config(gpt.Config, ["--help"])
    out = capsys.readouterr().out
    for field in gpt.Config.__dataclass_fields__:
        assert f"--{field}" in out
    assert "peak learning rate" in out


@pytest.mark.slow
@needs_bpe
@pytest.mark.parametrize("data", ["arithmetic", "hh_sft"])
def test_bpe_datasets_train(tmp_path, data, monkeypatch):
    """--data arithmetic and --data hh_sft (local JSONL) train a few steps with GPT-2 BPE."""
    extra = []
    if data == "hh_sft":
        path = tmp_path / "hh.jsonl"
        rows = [
            {"chosen": f"\n\nHuman: Question {i}?\n\nAssistant: Answer number {i}.", "rejected": "x"}
            for i in range(200)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra = ["--data_path", path]
    out = tmp_path / "run"
    run_main(gpt, monkeypatch, "--data", data, *extra, "--out_dir", out, *RUN, "--max_steps", "3")
    assert torch.load(out / "ckpt.pt", weights_only=True)["tokenizer"] == "gpt2"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_distributed_gradients_equal_single_process_gradients(tmp_path, parallel):
    """2 gloo ranks x 2 micro-batches give the same gradients as one process on the whole batch."""
    result = tmp_path / "result.txt"
    proc = torchrun(ROOT / "tests" / "ddp_grad_check.py", 2, parallel, result)
    verdicts = [tmp_path / f"result.txt.rank{rank}" for rank in range(2)]
    assert all(v.exists() for v in verdicts), proc.stderr[-3000:]
    assert [v.read_text() for v in verdicts] == ["ok", "ok"]
    # Rarely, gloo aborts a rank while the processes tear down (std::terminate after both verdicts are written, an
    # upstream race under FSDP2); the gradients are judged by the verdicts, any other failure still fails the test.
    torn_down = "terminate called" in proc.stderr
    assert proc.returncode == 0 or torn_down, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_run_saves_a_checkpoint_that_loads_in_one_process(tmp_path, text_file):
    """torchrun --parallel fsdp trains and saves a full (unsharded) checkpoint loadable without torchrun."""
    out = tmp_path / "run"
    proc = torchrun(
        ROOT / "gpt.py",
        2,
        "--device",
        "cpu",
        "--parallel",
        "fsdp",
        "--data",
        text_file,
        "--out_dir",
        out,
        *RUN,
        "--max_steps",
        "4",
        "--eval_every",
        "2",
    )
    assert_ok(proc)
    model, _, ckpt = gpt.load_model(str(out / "ckpt.pt"))
    assert ckpt["step"] == 4 and len(ckpt["rng_ranks"]) == 2
    assert all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor for v in ckpt["model"].values())
    assert len(metrics(out)) > 0 and (out / "samples.txt").is_file()


def test_no_samples_asked_for_writes_no_samples_file(tmp_path, text_file, monkeypatch):
    """--num_samples 0 finishes the run without samples.txt (it once crashed padding an empty batch of prompts), and a
    negative count is refused."""
    out = tmp_path / "run"
    run_main(gpt, monkeypatch, "--data", text_file, "--out_dir", out, *RUN, "--max_steps", "2", "--num_samples", "0")
    assert (out / "final_results.json").is_file() and (out / "ckpt.pt").is_file()
    assert not (out / "samples.txt").exists()
    with pytest.raises(SystemExit) as stop:
        run_main(gpt, monkeypatch, "--data", text_file, "--out_dir", tmp_path / "bad", *RUN, "--num_samples", "-1")
    assert stop.value.code == 2 and not (tmp_path / "bad").exists()
