"""The fault matrix: every script, run in a subprocess on tiny synthetic data, is killed with SIGKILL at a random
step (gpt.py and grpo.py also in the middle of a checkpoint write), hit by a NaN loss and stopped by a real SIGTERM
or Ctrl-C (gpt.py and grpo.py: both), and each time resumes, ending with exactly the metrics and weights of an
uninterrupted run; its memory stays flat over 30 steps; an --out_dir that cannot be written (read-only, full, not a
folder) is refused before training. With gpt.py and grpo.py: a checkpoint write that fails keeps the previous
checkpoint; under torchrun a rank that raises ends the whole run promptly, naming that rank, and SIGTERM to torchrun
stops every rank at one step with a checkpoint.

The faults come from the scripts' test hooks (environment variables read in gpt.py's train block):
FAULT_SLOW_SAVE_AT_STEP (pause a save between its write and its rename), FAULT_NAN_AT_STEP, FAULT_RAISE_AT_STEP with
FAULT_RAISE_RANK. The signals are real ones, sent to the process."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import BPE_AVAILABLE, ROOT, TINY, char_checkpoint, hh_file, metrics, synthetic_text, torchrun

import char_grpo
import dpo
import gpt
import grpo
import ppo
import reward_model
import rookworld_grpo

STEPS, SAVE = 30, 2  # every run here: 30 steps, a checkpoint every 2
COMMON = ["--max_steps", STEPS, "--save_every", SAVE, "--eval_every", 10, "--log_every", 1, "--device", "cpu"]
RL = ["--context_len", "8", "--horizon", "4", "--batch_size", "4"]
SCRIPTS = ["gpt.py", "char_grpo.py", "grpo.py", "ppo.py", "dpo.py", "reward_model.py", "rookworld_grpo.py"]
MODULES = dict(zip(SCRIPTS, (gpt, char_grpo, grpo, ppo, dpo, reward_model, rookworld_grpo)))
WAIT = 120  # seconds any single wait may take before the test fails (the runs take a few seconds)
RUNNING = []  # processes started by the current test


@pytest.fixture(autouse=True)
def stop_leftover_runs():
    """A test that fails half-way leaves no process behind (one paused in a save would linger for a minute)."""
    yield
    while RUNNING:
        RUNNING.pop().stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Every script's data and starting checkpoints, made here: {script: its data flags}."""
    folder = tmp_path_factory.mktemp("data")
    text = folder / "text.txt"
    text.write_text(synthetic_text())
    hh = hh_file(folder / "hh.jsonl", n=60)
    chars = "".join(sorted(set("".join(r["chosen"] + r["rejected"] for r in map(json.loads, open(hh))))))
    dpo_init = char_checkpoint(folder / "dpo_init.pt", chars, block_size=64)
    flags = {
        "gpt.py": ["--data", text, *TINY, "--dropout", "0.1", "--eval_iters", 2, "--num_samples", 1],
        "char_grpo.py": ["--data", text, *TINY, *RL, "--group_size", 4, "--eval_size", 16],
        "grpo.py": ["--data", text, *TINY, *RL, "--tokenizer", "char", "--group_size", 4, "--eval_size", 16],
        "ppo.py": ["--data", text, *TINY, *RL, "--tokenizer", "char", "--num_minibatches", 2, "--eval_size", 8],
        "dpo.py": ["--data_path", hh, "--init_from", dpo_init, "--max_len", 64, "--batch_size", 4],
        "reward_model.py": ["--data_path", hh, *TINY, "--max_len", 32, "--tokenizer", "char", "--eval_size", 4],
    }
    flags["gpt.py"] += ["--sample_tokens", 8]
    flags["dpo.py"] += ["--eval_size", 8, "--num_samples", 1, "--sample_tokens", 8, "--lr", "1e-3"]
    if BPE_AVAILABLE:  # RookWorld lines from random play, and a random GPT-2-vocabulary model to start from
        lines = rookworld_grpo.make_lines(40, random.Random(0), illegal_frac=0.2)
        (folder / "rookworld.txt").write_text("\n".join(lines) + "\n")
        torch.manual_seed(0)
        config = gpt.GPTConfig(block_size=192, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
        ckpt = {"model": gpt.GPT(config).state_dict(), "model_config": vars(config), "tokenizer": "gpt2", "step": 0}
        torch.save(ckpt, folder / "rookworld_init.pt")
        flags["rookworld_grpo.py"] = ["--data_path", folder / "rookworld.txt", "--init_from"]
        flags["rookworld_grpo.py"] += [folder / "rookworld_init.pt", "--batch_size", 2, "--group_size", 2]
        flags["rookworld_grpo.py"] += ["--horizon", 8, "--eval_size", 2]
    return {script: [*args, *COMMON] for script, args in flags.items()}


def args_of(data, script):
    if script not in data:
        pytest.skip("GPT-2 BPE files unavailable (rookworld_grpo.py needs them)")
    return data[script]


# ------------------------------------------------------------------------------------------------------ helpers


class Run:
    """A script started in the background; stdout and stderr go to files (a pipe nobody reads could fill up and
    stall it), and the test watches its metrics.jsonl and its memory while it runs."""

    def __init__(self, script, args, out_dir, env=None, unbuffered=True, launcher=()):
        self.out = Path(out_dir)
        self.stdout, self.stderr = (self.out.parent / f"{self.out.name}.{s}" for s in ("out", "err"))
        env = {**os.environ, **(env or {})}
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        else:  # as when stdout goes to a log file: Python buffers it
            env.pop("PYTHONUNBUFFERED", None)
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *launcher, str(ROOT / script), *map(str, args), "--out_dir", str(out_dir)],
                stdout=out,
                stderr=err,
                env=env,
                cwd=ROOT,
            )
        self.launcher = launcher
        RUNNING.append(self)
        self.rss = {}  # latest logged training step -> the least resident memory (MiB) seen while it was the latest

    def train_steps(self):
        """Steps of the training lines of metrics.jsonl so far."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        steps = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written right now
                row = json.loads(line)
                if "train/loss" in row:
                    steps.append(row["step"])
        return steps

    def last_step(self):
        return max(self.train_steps(), default=-1)

    def sample_rss(self):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            line = next((line for line in status.splitlines() if line.startswith("VmRSS")), None)
            if line and int(line.split()[1]):  # none or 0 kB around the process's start and exit
                step, mib = self.last_step(), int(line.split()[1]) / 1024
                self.rss[step] = min(self.rss.get(step, mib), mib)

    def wait_until(self, condition, what):
        deadline = time.time() + WAIT
        while not condition():
            assert self.proc.poll() is None, f"the run ended (exit {self.proc.returncode}) before {what}\n{self.err()}"
            assert time.time() < deadline, f"no {what} within {WAIT} s\n{self.err()}"
            time.sleep(0.01)

    def wait_for_step(self, step):
        self.wait_until(lambda: self.last_step() >= step, f"a training line for step {step}")

    def finish(self, timeout=WAIT, watch_memory=False):
        deadline = time.time() + timeout
        while self.proc.poll() is None:
            assert time.time() < deadline, f"the run did not end within {timeout} s\n{self.err()}"
            if watch_memory:
                self.sample_rss()
            time.sleep(0.005)
        return self.proc.returncode

    def kill(self, sig):
        self.proc.send_signal(sig)
        return self.finish()

    def stop(self):
        if self.proc.poll() is None:  # torchrun passes SIGTERM on to its ranks; SIGKILL would orphan them
            self.proc.send_signal(signal.SIGTERM if self.launcher else signal.SIGKILL)
            self.proc.wait(timeout=60)

    def err(self):
        """stderr without tqdm's progress bars."""
        lines = self.stderr.read_text().replace("\r", "\n").splitlines()
        return "\n".join(line for line in lines if line.strip() and not re.match(r"\s*\d+%\|", line))


def ckpt_step(path):
    return torch.load(path, map_location="cpu", weights_only=True)["step"]


def loads_as_step(path, step):
    """Whether path holds a complete checkpoint of that step (False while it is still being written)."""
    try:
        return ckpt_step(path) == step
    except Exception:
        return False


def resume(script, part, **kw):
    return Run(script, ["--resume"], part, **kw)


# --------------------------------------------------------------------------------------- uninterrupted reference


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """One uninterrupted run per script, made on first use: {script: (out_dir, Run)}. Its memory is sampled all the
    way; glibc's mmap threshold is fixed so that freed tensors go back to the system at once and the resident size
    follows the memory in use (with the default, adaptive threshold it drifts by tens of MiB from step to step)."""
    folder, runs = tmp_path_factory.mktemp("reference"), {}

    def get(script):
        if script not in runs:
            out = folder / script.removesuffix(".py")
            run = Run(script, args_of(data, script), out, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
            assert run.finish(watch_memory=True) == 0, run.err()
            runs[script] = out, run
        return runs[script]

    return get


# ---------------------------------------------------------------------------------- killed, signalled, NaN, resumed

# The kill in the middle of a checkpoint write and both signals, for gpt.py and grpo.py; the other scripts get one
# signal each (alternately SIGTERM and SIGINT) and no kill mid-save. What those trimmed cases test is shared code
# (save_checkpoint, the signal handler and the exit in gpt.py's train block); every script still goes through
# its own loop's kill, NaN, signal and resume, and each process costs ~4 s of CI (torch import and start-up).
FULL_CHAIN = ("gpt.py", "grpo.py")


def signals_for(script):
    both = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]
    return both if script in FULL_CHAIN else [both[SCRIPTS.index(script) % 2]]


def kill_at_a_random_step(script, args, part, rng):
    """SIGKILL a new run once it has logged a random step: metrics.jsonl and the stdout log (a file, not a
    terminal, so Python buffers it) keep every step so far, and ckpt.pt is a complete checkpoint."""
    k = rng.randint(3, 6)
    run = Run(script, args, part, unbuffered=False)
    run.wait_for_step(k)
    assert run.kill(signal.SIGKILL) == -signal.SIGKILL
    steps = run.train_steps()
    assert steps == list(range(len(steps))) and len(steps) > k, steps
    log = run.stdout.read_text()  # the last step's line may have been killed between the two writes
    assert all(f"step {s}: " in log for s in steps[:-1]), f"stdout lost logged steps {steps}:\n{log[-1000:]}"
    c1 = ckpt_step(part / "ckpt.pt")
    assert c1 % SAVE == 0 and k // SAVE * SAVE <= c1 <= steps[-1] + 1, (c1, steps)


def kill_during_a_save(script, part, rng):
    """SIGKILL while the resumed run writes a checkpoint (after one save of its own, so that its training lines and
    ckpt.pt.tmp are its own, not the previous run's): ckpt.pt is still the previous complete checkpoint and the new
    one sits complete in ckpt.pt.tmp. That file is then cut in half, as a kill inside torch.save leaves it."""
    ckpt, tmp = part / "ckpt.pt", part / "ckpt.pt.tmp"
    step = ckpt_step(ckpt) + SAVE * rng.randint(2, 3)
    run = resume(script, part, env={"FAULT_SLOW_SAVE_AT_STEP": str(step)})
    run.wait_until(lambda: run.last_step() >= step - 1 and loads_as_step(tmp, step), f"the paused save of {step}")
    assert run.kill(signal.SIGKILL) == -signal.SIGKILL
    assert ckpt_step(ckpt) == step - SAVE, "ckpt.pt is not the previous complete checkpoint"
    tmp.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])


def nan_loss(script, part, rng):
    """A NaN loss a few steps into the resumed run: exit code 1, one error line naming the step and the checkpoint
    kept, ckpt.pt is the last one saved before that step, metrics.jsonl is valid JSON lines without that step."""
    ckpt = part / "ckpt.pt"
    step = ckpt_step(ckpt) + rng.randint(1, 3)
    run = resume(script, part, env={"FAULT_NAN_AT_STEP": str(step)})
    assert run.finish() == 1, run.err()
    errors = [line for line in run.err().splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and f"loss is nan at step {step};" in errors[0] and str(ckpt) in errors[0], errors
    assert ckpt_step(ckpt) == step // SAVE * SAVE
    assert max(r["step"] for r in metrics(part) if "train/loss" in r) == step - 1


def stop_by_signal(script, part, sig, code):
    """The signal, sent once the resumed run has trained a step: a checkpoint at the next step boundary, exactly
    one line on stderr saying how to continue, and the exit code."""
    ckpt = part / "ckpt.pt"
    start, first = ckpt_step(ckpt), max(r["step"] for r in metrics(part) if "train/loss" in r) + 1
    run = resume(script, part)  # it trains from start; lines up to first - 1 may be the previous run's
    run.wait_for_step(max(start, first))
    assert run.kill(sig) == code, run.err()
    stopped = ckpt_step(ckpt)
    messages = run.err().splitlines()
    assert messages == [f"stopped by {sig.name} at step {stopped}; checkpoint saved. Continue with: --resume "
                        f"--out_dir {part}"], messages  # fmt: skip
    assert start < stopped < STEPS and max(run.train_steps()) == stopped - 1


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_interrupted_run_always_resumes_to_the_uninterrupted_metrics(script, data, references, tmp_path):
    """One run of the script goes through interruptions in turn, each followed by --resume: SIGKILL at a random
    step, SIGKILL in the middle of a checkpoint write (FULL_CHAIN), a NaN loss, SIGTERM and/or Ctrl-C. The last
    --resume runs to the end: metrics.jsonl and the weights equal those of the uninterrupted run."""
    rng = random.Random(script)  # a different, reproducible choice of steps per script
    part = tmp_path / "part"
    kill_at_a_random_step(script, args_of(data, script), part, rng)
    if script in FULL_CHAIN:
        kill_during_a_save(script, part, rng)
    nan_loss(script, part, rng)
    for sig, code in signals_for(script):
        stop_by_signal(script, part, sig, code)
    run = resume(script, part)
    assert run.finish() == 0, run.err()
    full, _ = references(script)
    assert metrics(part) == metrics(full)
    a, b = (torch.load(d / "ckpt.pt", weights_only=True) for d in (full, part))
    assert a["step"] == b["step"] == STEPS and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert not (part / "ckpt.pt.tmp").exists()


# --------------------------------------------------------------------------------------------- memory over steps


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_memory_does_not_grow_across_steps(script, references):
    """The uninterrupted run's resident memory between steps 5-10 and 20-29: the least seen in each window (the
    memory a step starts from, without its passing tensors) may differ by allocator noise only, not by a leak
    that keeps something of every step (a tensor holding its graph, a growing list of rollouts)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("resident memory is read from /proc (Linux)")
    _, run = references(script)
    early = [mib for step, mib in run.rss.items() if 5 <= step <= 10]
    late = [mib for step, mib in run.rss.items() if 20 <= step < STEPS]
    assert len(early) >= 3 and len(late) >= 5, run.rss
    assert min(late) - min(early) < 1.5, run.rss


# ------------------------------------------------------------------------------------ an --out_dir it cannot write


def mount_tmpfs(path, options):
    """A tmpfs at path (root only); False when it cannot be mounted here."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True).returncode == 0


@pytest.fixture
def unwritable(tmp_path):
    """make(kind) -> an --out_dir that cannot be written: "read_only" (an existing folder on a read-only file
    system, or without write permission when not root: root ignores permissions), "full" (a folder on a file system
    with no space left), "not_a_folder" (a path under a regular file)."""
    mounts = []

    def make(kind):
        if kind == "not_a_folder":
            (tmp_path / "file").write_text("")
            return tmp_path / "file" / "run"
        folder = tmp_path / kind
        if kind == "read_only":
            if os.geteuid() != 0:
                folder.mkdir()
                folder.chmod(0o555)
                mounts.append(lambda: folder.chmod(0o755))
                return folder
            if not mount_tmpfs(folder, "ro,size=64k"):
                pytest.skip("running as root, where permissions do not stop writes, and mount is not allowed")
        elif not mount_tmpfs(folder, "size=64k"):
            pytest.skip("a full disk is simulated with a tiny tmpfs, which needs root and mount")
        mounts.append(lambda: subprocess.run(["umount", folder]))
        if kind == "full":
            with contextlib.suppress(OSError), open(folder / "filler", "wb") as f:
                while True:
                    f.write(b"0" * 4096)
                    f.flush()
        return folder / "run" if kind == "full" else folder

    yield make
    for undo in reversed(mounts):
        undo()


def run_main(monkeypatch, capsys, script, args):
    """script's main() in this process (no interpreter start-up) with these flags: (exit code, stdout, stderr)."""
    module = MODULES[script]
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    monkeypatch.setattr(module.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    try:
        module.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


REASONS = {"read_only": "Read-only file system|Permission denied", "full": "No space left", "not_a_folder": "Not a dir"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", REASONS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unwritable_out_dir_is_refused_before_training(script, kind, data, unwritable, monkeypatch, capsys):
    """--out_dir read-only, on a full disk, or under a file: exit code 2 and one line naming the folder and the
    reason, before anything is loaded or trained (nothing on stdout, no config.json)."""
    out_dir = unwritable(kind)
    args = [*data.get(script, ["--device", "cpu"]), "--out_dir", out_dir]
    code, out, err = run_main(monkeypatch, capsys, script, args)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --out_dir {out_dir} is not writable"), err
    assert re.search(REASONS[kind], err), err
    assert not (out_dir / "config.json").exists()


@pytest.mark.slow
def test_a_checkpoint_that_no_longer_fits_on_the_disk_keeps_the_previous_one(tmp_path, data, references):
    """A disk with room for one checkpoint but not for a second beside it (the atomic write needs both at once):
    the second save fails, the run ends with exit code 1 and one line, ckpt.pt is still the first checkpoint and no
    partial ckpt.pt.tmp is left behind."""
    size = (references("gpt.py")[0] / "ckpt.pt").stat().st_size
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, f"size={size * 3 // 2}"):
        pytest.skip("a small disk is simulated with a tmpfs, which needs root and mount")
    try:
        run = Run("gpt.py", data["gpt.py"], disk / "run")
        assert run.finish() == 1, run.err()
        errors = run.err().splitlines()
        assert len(errors) == 1 and errors[0].startswith(f"error: cannot write the checkpoint {disk}/run/ckpt.pt.tmp")
        assert ckpt_step(disk / "run" / "ckpt.pt") == SAVE and not (disk / "run" / "ckpt.pt.tmp").exists()
        assert all(json.loads(line) for line in (disk / "run" / "metrics.jsonl").read_text().splitlines())
    finally:
        subprocess.run(["umount", disk])


# ------------------------------------------------------------------------------------------- a rank that crashes


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("script, rank", [("gpt.py", 1), ("grpo.py", 0)])
def test_a_rank_that_raises_ends_the_torchrun_run_promptly_and_is_named(script, rank, data, tmp_path):
    """Two CPU processes (gloo); one raises after step 2 while the other waits in a collective. The other rank and
    torchrun end within seconds (no hang until a timeout), with a nonzero exit code and the failing rank's error in
    the output."""
    env = {"FAULT_RAISE_AT_STEP": "2", "FAULT_RAISE_RANK": str(rank)}
    t0 = time.time()
    proc = torchrun(script, 2, *data[script], "--out_dir", tmp_path / "run", env=env, timeout=WAIT)
    elapsed = time.time() - t0
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    output = proc.stdout + proc.stderr
    assert f"[rank{rank}]: RuntimeError: FAULT_RAISE_AT_STEP: injected error on rank {rank}" in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(data, tmp_path):
    """SIGTERM to the launcher, as a scheduler's preemption sends it: torchrun passes it to both ranks, which agree
    on the step to stop at, save and print the one line, well within torchrun's 30 s before it kills them."""
    out = tmp_path / "run"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = Run("gpt.py", [*data["gpt.py"], "--max_steps", 100_000], out, env={"OMP_NUM_THREADS": "1"}, launcher=launcher)
    run.wait_for_step(3)
    t0 = time.time()
    run.kill(signal.SIGTERM)
    assert time.time() - t0 < 20, "the ranks did not stop by themselves (torchrun killed them after 30 s)"
    stopped = ckpt_step(out / "ckpt.pt")
    assert max(run.train_steps()) == stopped - 1 > 3
    assert f"stopped by SIGTERM at step {stopped}; checkpoint saved" in run.err()
