"""Shared fixtures: offline environment, small synthetic data (no downloads), runs of the scripts in this process
(run_main: no interpreter start, no training_curves.png) and in a subprocess (run_script, torchrun: where the test is
about exit codes, signals, stderr, torchrun or a fresh interpreter). The suite runs in parallel (pytest -n auto), so
every run writes under its test's tmp_path."""

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Offline by default. The GPT-2 BPE files come from ../shared/tiktoken_cache when that folder exists (this
# project's CI); elsewhere tiktoken downloads them once, and tests that need them skip when it cannot.
os.environ.setdefault("WANDB_MODE", "disabled")
# One thread per process, in this one and in every subprocess, unless OMP_NUM_THREADS says otherwise: tiny models
# gain nothing from more, a thread that competes with another process for the cores can slow a run down tenfold,
# and runs compared bit for bit (resume tests) must use the same number of threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_shared_cache = ROOT.parent / "shared" / "tiktoken_cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _shared_cache.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_shared_cache)


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """A script's main() run in this process installs GracefulExit's SIGTERM and SIGINT handlers, which would stay
    after the test: the pytest process would then ignore `timeout`'s SIGTERM and Ctrl-C. Put back what was there."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


SCRIPTS = ("gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo")


@pytest.fixture(autouse=True)
def no_training_curves_in_process(request, monkeypatch):
    """A script's main() run in this process skips drawing training_curves.png: a figure of up to twenty panels is
    most of a tiny run's time. Runs in a subprocess draw it, and so does a test marked @pytest.mark.plots (one that
    checks the picture is written)."""
    if request.node.get_closest_marker("plots"):
        return
    for name in SCRIPTS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "plot_curves"):
            monkeypatch.setattr(module, "plot_curves", lambda *args: None)


def _run_folders():
    """The default run folders (out/<script>-<timestamp>) in the repository and in the working folder."""
    return {p for folder in {ROOT / "out", Path.cwd() / "out"} if folder.is_dir() for p in folder.iterdir()}


@pytest.fixture(autouse=True)
def no_run_in_the_default_out_dir():
    """Every run a test starts passes --out_dir under tmp_path. A run in the default out/<script>-<timestamp> would
    leave a folder in the repository, and under pytest-xdist (-n auto) two runs started in the same second by
    different workers would meet in the same folder."""
    before = _run_folders()
    yield
    new = sorted(str(p) for p in _run_folders() - before)
    assert not new, f"a run wrote to the default out_dir {new}: pass --out_dir under tmp_path"


def _bpe_available():
    try:
        import tiktoken

        tiktoken.get_encoding("gpt2")
        return True
    except Exception:
        return False


BPE_AVAILABLE = _bpe_available()
needs_bpe = pytest.mark.skipif(not BPE_AVAILABLE, reason="GPT-2 BPE files unavailable (offline, no TIKTOKEN_CACHE_DIR)")


def synthetic_text(n_chars=20000, seed=0):
    """Shakespeare-like lines from a small vocabulary: structured enough to learn, made here, no download."""
    rng = random.Random(seed)
    names = ["ROMEO", "JULIET", "NURSE", "FRIAR"]
    words = "the a my thou art love night day fair sweet doth not and to be of in what light".split()
    lines = []
    while sum(len(line) for line in lines) < n_chars:
        speech = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        lines.append(f"{rng.choice(names)}:\n{speech.capitalize()}.\n\n")
    return "".join(lines)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(synthetic_text())
    return path


TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "4"]


def metrics(out_dir):
    """The rows of a run's metrics.jsonl without their perf/ keys (timings differ between runs that match)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def run_main(module, monkeypatch, *args):
    """module.main() with these flags in this process (no interpreter start; its functions can be wrapped). The
    autouse restore_signal_handlers fixture puts back the signal handlers main() installs."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *map(str, args)])
    module.main()


def run_main_in_fixture(module, *args):
    """run_main for a module- or session-scoped fixture (which has no monkeypatch of its own): sys.argv and the signal
    handlers are put back afterwards, and training_curves.png is not drawn."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.MonkeyPatch.context() as mp:
            if hasattr(module, "plot_curves"):
                mp.setattr(module, "plot_curves", lambda *a: None)
            run_main(module, mp, *args)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def run_main_captured(module, monkeypatch, *args):
    """run_main with the output captured: (exit code, 0 when main returns; stdout; stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(module, monkeypatch, *args)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue().strip().splitlines()


def run_main_until_sigterm(module, monkeypatch, step, *args):
    """run_main stopped as by a SIGTERM after `step` steps (FAULT_SIGTERM_AT_STEP): it must exit with 143, its
    checkpoint saved."""
    monkeypatch.setenv("FAULT_SIGTERM_AT_STEP", str(step))
    with pytest.raises(SystemExit) as exit_info:
        run_main(module, monkeypatch, *args)
    assert exit_info.value.code == 143
    monkeypatch.delenv("FAULT_SIGTERM_AT_STEP")


def run_script(script, *args, timeout=300, env=None, cwd=None):
    """Run a top-level script in a subprocess; returns the CompletedProcess (text output captured)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
    )


def torchrun(script, nproc, *args, timeout=300, env=None, cwd=None):
    """Run a script under torchrun on CPU processes (gloo)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*cmd, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
    )


def char_checkpoint(path, chars, block_size=32, seed=0, reward_head=False):
    """A tiny random char-level GPT (or reward model) saved as a checkpoint of this project."""
    return tiny_checkpoint(path, {"type": "char", "chars": chars}, len(chars), block_size, seed, reward_head)


def bpe_checkpoint(path, block_size=32, seed=0, reward_head=False):
    """The same with the GPT-2 BPE vocabulary (made without tiktoken)."""
    return tiny_checkpoint(path, "gpt2", 50257, block_size, seed, reward_head)


def tiny_checkpoint(path, tokenizer, vocab_size, block_size, seed, reward_head):
    from gpt import GPT, GPTConfig
    from reward_model import RewardModel

    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16)
    model = RewardModel(config) if reward_head else GPT(config)
    body = model.body if reward_head else model
    ckpt = {"model": body.state_dict(), "model_config": vars(config), "tokenizer": tokenizer}
    if reward_head:
        ckpt.update(reward_head=model.head.state_dict(), reward_task="preference")
    torch.save({**ckpt, "step": 0}, path)
    return path


def hh_file(path, n=40):
    """HH-RLHF-shaped records, one "chosen" dialogue per line."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            turns = "".join(
                f"\n\nHuman: say {rng.choice('abc')}\n\nAssistant: ok {i % 3}" for _ in range(rng.randint(1, 2))
            )
            f.write(json.dumps({"chosen": turns, "rejected": turns + "x"}) + "\n")
    return path
