"""The bad-input matrix: every script, every kind of bad input that applies to it, must end with exit code 2 and
exactly one line on stderr naming the setting or file, no traceback, and no file of an existing run folder written
over (SPEC section 5).

Most cases fail while the flags, data and checkpoints are checked, so they run main() in this process (an
interpreter and torch start-up per case would cost seconds); a few run as real processes to show that the process
itself prints no traceback and exits 2. NOT_APPLICABLE lists, per kind, the scripts it does not apply to and why;
test_every_kind_is_tried_or_explained_for_every_script keeps the table complete."""

import dataclasses
import importlib
import json
import os
import random
import shutil
import signal
import sys

import pytest
from conftest import BPE_AVAILABLE, bpe_checkpoint, char_checkpoint, hh_file, run_script, synthetic_text

SCRIPTS = ("gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo")

# ------------------------------------------------------------------------------------------------ data and models


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    """Every file the cases need, made once: good and bad data, good and foreign checkpoints."""
    import rookworld_grpo

    d = tmp_path_factory.mktemp("inputs")
    ns = {}
    ns["text"] = d / "text.txt"
    ns["text"].write_text(synthetic_text(4000))
    ns["empty"] = d / "empty.txt"
    ns["empty"].write_text("")
    ns["empty_jsonl"] = d / "empty.jsonl"
    ns["empty_jsonl"].write_text("")
    ns["hh"] = hh_file(d / "hh.jsonl")
    ns["bad_jsonl"] = d / "bad.jsonl"
    ns["bad_jsonl"].write_text('not json\n{"rejected": "no chosen field"}\n[1, 2]\n{"chosen": ""}\n')
    ns["same"] = d / "same.jsonl"
    turn = "\n\nHuman: hi\n\nAssistant: the same answer"
    ns["same"].write_text("".join(json.dumps({"chosen": turn, "rejected": turn}) + "\n" for _ in range(20)))
    ns["rook"] = d / "rook.txt"
    ns["rook"].write_text("\n".join(rookworld_grpo.make_lines(40, random.Random(0))) + "\n")
    ns["rook_bad"] = d / "rook_bad.txt"
    ns["rook_bad"].write_text("garbage\nP: not a fen\nA: neither\n")
    text_chars = "".join(sorted(set(ns["text"].read_text())))
    hh_chars = "".join(sorted(set(ns["hh"].read_text()) | set(turn)))
    ns["text_ckpt"] = char_checkpoint(d / "text_ckpt.pt", text_chars, block_size=32)
    ns["hh_ckpt"] = char_checkpoint(d / "hh_ckpt.pt", hh_chars, block_size=64)
    ns["hh_rm"] = char_checkpoint(d / "hh_rm.pt", hh_chars, block_size=64, reward_head=True)
    ns["abc_ckpt"] = char_checkpoint(d / "abc_ckpt.pt", "abc", block_size=64)  # covers none of the data
    ns["bpe_ckpt"] = bpe_checkpoint(d / "bpe_ckpt.pt", block_size=192)
    ns["bpe_rm"] = bpe_checkpoint(d / "bpe_rm.pt", block_size=64, reward_head=True)
    ns["truncated"] = d / "truncated.pt"
    ns["truncated"].write_bytes(ns["hh_ckpt"].read_bytes()[:3000])
    return type("Files", (), ns)


# Tiny valid runs: each case adds its bad flags after these (argparse keeps the last value of a repeated flag).
CPU = ["--device", "cpu"]
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", *CPU]


def base_args(script, f):
    return {
        "gpt": ["--data", f.text, *TINY, "--block_size", "32", "--batch_size", "2", "--max_steps", "1"],
        "char_grpo": ["--data", f.text, *TINY, "--block_size", "32", "--context_len", "8", "--horizon", "4"],
        "grpo": ["--data", f.text, *TINY, "--block_size", "32", "--tokenizer", "char", "--context_len", "8"],
        "ppo": ["--data", f.text, *TINY, "--block_size", "32", "--tokenizer", "char", "--context_len", "8"],
        "dpo": ["--data_path", f.hh, "--init_from", f.hh_ckpt, "--max_len", "64", "--sample_tokens", "8", *CPU],
        "reward_model": ["--data_path", f.hh, *TINY, "--block_size", "64", "--tokenizer", "char"],
        "rookworld_grpo": ["--data_path", f.rook, "--init_from", f.bpe_ckpt, "--horizon", "40", *CPU],
    }[script]


# ---------------------------------------------------------------------------------------------------- the matrix

# kind -> script -> (flags added to the tiny valid run, or a function of the files giving them; the text, or texts,
# the error line must hold). Each case runs with --out_dir a folder holding a previous run's files (previous_run).
CASES = {
    "unknown_flag": {s: (["--no_such_flag", "1"], "--no_such_flag") for s in SCRIPTS},
    "wrong_type": {s: (["--max_steps", "ten"], ("--max_steps", "invalid int value")) for s in SCRIPTS},
    "zero_size": {s: (["--batch_size", "0"], "--batch_size") for s in SCRIPTS},
    "negative_size": {
        "gpt": (["--block_size", "-8"], "--block_size"),
        "char_grpo": (["--horizon", "-1"], "--horizon"),
        "grpo": (["--horizon", "-1"], "--horizon"),
        "ppo": (["--ppo_epochs", "-1"], "--ppo_epochs"),
        "dpo": (["--max_len", "-5"], "--max_len"),
        "reward_model": (["--max_len", "-5"], "--max_len"),
        "rookworld_grpo": (["--horizon", "-1"], "--horizon"),
    },
    "group_size_1": {
        "char_grpo": (["--group_size", "1"], "--group_size"),
        "grpo": (["--group_size", "1"], "--group_size"),
        "rookworld_grpo": (["--group_size", "1"], "--group_size"),
    },
    "horizon_beyond_block_size": {
        "gpt": (lambda f: ["--init_from", f.text_ckpt, "--block_size", "64"], "--block_size"),
        "char_grpo": (["--context_len", "30", "--horizon", "10"], "block_size"),
        "grpo": (["--context_len", "30", "--horizon", "10"], "block_size"),
        "ppo": (["--context_len", "30", "--horizon", "10"], "block_size"),
        "dpo": (["--max_len", "65"], "--max_len"),
        "reward_model": (["--max_len", "65"], "--max_len"),
        "rookworld_grpo": (["--horizon", "190"], "--horizon"),
    },
    "missing_data_file": {
        **{
            s: (["--data", "/nonexistent/data.txt"], "/nonexistent/data.txt")
            for s in ("gpt", "char_grpo", "grpo", "ppo")
        },
        **{s: (["--data_path", "/nonexistent/d.jsonl"], "/nonexistent/d.jsonl") for s in ("dpo", "reward_model")},
        "rookworld_grpo": (["--data_path", "/nonexistent/rook.txt"], "/nonexistent/rook.txt"),
    },
    "empty_data_file": {
        **{s: (lambda f: ["--data", f.empty], "empty.txt") for s in ("gpt", "char_grpo", "grpo", "ppo")},
        **{s: (lambda f: ["--data_path", f.empty_jsonl], "empty.jsonl") for s in ("dpo", "reward_model")},
        "rookworld_grpo": (lambda f: ["--data_path", f.empty], "empty.txt"),
    },
    "all_lines_malformed": {
        "gpt": (lambda f: ["--data", "hh_sft", "--tokenizer", "gpt2", "--data_path", f.bad_jsonl], "bad.jsonl"),
        **{
            s: (
                lambda f: (
                    ["--task", "reward_model", "--init_from", f.hh_ckpt, "--reward_model", f.hh_rm]
                    + ["--data_path", f.bad_jsonl, "--max_prompt_len", "40", "--horizon", "8"]
                ),
                "bad.jsonl",
            )
            for s in ("grpo", "ppo")
        },
        **{s: (lambda f: ["--data_path", f.bad_jsonl], "bad.jsonl") for s in ("dpo", "reward_model")},
        "rookworld_grpo": (lambda f: ["--data_path", f.rook_bad], "rook_bad.txt"),
    },
    "identical_chosen_rejected": {
        s: (lambda f: ["--data_path", f.same], "chosen == rejected") for s in ("dpo", "reward_model")
    },
    "checkpoint_of_another_tokenizer": {
        "gpt": (lambda f: ["--init_from", f.bpe_ckpt, "--tokenizer", "char"], "--tokenizer"),
        "char_grpo": (lambda f: ["--init_from", f.bpe_ckpt], "bpe_ckpt.pt"),
        **{
            s: (
                lambda f: (
                    ["--task", "reward_model", "--init_from", f.hh_ckpt, "--reward_model", f.bpe_rm]
                    + ["--data_path", f.hh, "--max_prompt_len", "40", "--horizon", "8"]
                ),
                "bpe_rm.pt",
            )
            for s in ("grpo", "ppo")
        },
        "dpo": (lambda f: ["--reference", f.bpe_ckpt], "bpe_ckpt.pt"),
        "reward_model": (lambda f: ["--init_from", f.bpe_ckpt, "--tokenizer", "char"], "--tokenizer"),
        "rookworld_grpo": (lambda f: ["--init_from", f.hh_ckpt], "hh_ckpt.pt"),
    },
    "checkpoint_of_another_vocabulary": {
        s: (lambda f: ["--init_from", f.abc_ckpt], "vocabulary")
        for s in ("gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model")
    },
    "truncated_checkpoint": {
        s: (lambda f: ["--init_from", f.truncated], ("truncated.pt", "truncated or not a checkpoint")) for s in SCRIPTS
    },
    "resume_truncated_checkpoint": {s: (["--resume"], ("ckpt.pt", "truncated or not a checkpoint")) for s in SCRIPTS},
    "resume_without_checkpoint": {s: (["--resume"], ("ckpt.pt", "without --resume")) for s in SCRIPTS},
    "resume_without_run": {s: (["--resume", "--out_dir", "/nonexistent/run"], "--resume") for s in SCRIPTS},
    "resume_corrupt_config": {s: (["--resume"], "config.json") for s in SCRIPTS},
    "resume_run_of_another_script": {s: (["--resume"], "another script") for s in SCRIPTS},
    "unreachable_hub_id_offline": {
        s: (["--init_from", "nobody/no-such-model"], ("nobody/no-such-model", "Hugging Face hub")) for s in SCRIPTS
    },
    "folder_holds_a_run": {s: ([], "already holds a run") for s in SCRIPTS},
    # the cosine schedule would climb from --lr to a floor above it
    "min_lr_above_lr": {s: (["--lr", "1e-4", "--min_lr", "1e-3"], "--min_lr") for s in SCRIPTS},
}

NOT_APPLICABLE = {
    "group_size_1": {
        "gpt": "supervised training has no groups",
        "ppo": "one completion per prompt, a learned value baseline: no groups",
        "dpo": "pairs, not groups of samples",
        "reward_model": "pairs or labelled sequences, not groups of samples",
    },
    "all_lines_malformed": {"char_grpo": "reads plain text only, where no line can be malformed"},
    "identical_chosen_rejected": {
        s: "reads no preference pairs" for s in ("gpt", "char_grpo", "grpo", "ppo", "rookworld_grpo")
    },
    "checkpoint_of_another_vocabulary": {
        "rookworld_grpo": "GPT-2 BPE only: any char checkpoint is another tokenizer (the case above)"
    },
}

# Settings of one script that the kinds above do not cover (folded in from the scripts' own test files).
EXTRA = {
    "gpt": [
        (["--lr", "-0.1"], "--lr"),
        (["--steps", "2"], "--steps"),  # a text file has no steps
        (["--n_embd", "30", "--n_head", "4"], "--n_embd"),
        (["--data", "hh_sft", "--tokenizer", "char"], "--tokenizer gpt2"),
        (["--init_from", "/nonexistent/ckpt.pt"], "--init_from /nonexistent/ckpt.pt: no such file"),
    ],
    "char_grpo": [
        (["--horizon", "0"], "--horizon"),
        (["--context_len", "100000", "--block_size", "200000"], "--context_len"),
        (["--loss_type", "ppo"], "--loss_type"),
        (["--temperature", "0"], "--temperature"),
        (["--batch_size", "3", "--grad_accum", "2"], "--grad_accum"),
    ],
    "dpo": [
        (["--loss_type", "dpo2"], "--loss_type"),
        (["--beta", "0"], "--beta"),
        (["--steps", "2"], "--steps"),  # HH-RLHF pairs have no steps
        (["--data", "arithmetic", "--reward_model", "rm.pt", "--ref_sync_steps", "5"], "--ref_sync_steps"),
    ],
    "grpo": [
        (["--scale_rewards", "none"], "--scale_rewards"),  # next_token: process advantages
        (["--task", "arithmetic", "--adv", "rloo", "--scale_rewards", "batch"], "--scale_rewards"),
        (["--uwo_lambda", "1.0"], "--uwo_lambda"),  # no ensemble
        (["--rm_sigmoid"], "--rm_sigmoid"),  # no reward model
    ],
    "ppo": [(["--uwo_lambda", "1.0"], "--uwo_lambda"), (["--rm_sigmoid"], "--rm_sigmoid")],
    "reward_model": [(["--steps", "2"], "--steps"), (["--task", "prm", "--data_path", ""], "--task prm needs --steps")],
}

# Cases that reach the GPT-2 BPE files before their error (they skip where tiktoken has no files).
NEEDS_BPE = {("gpt", "all_lines_malformed"), ("rookworld_grpo", "horizon_beyond_block_size")}

# One case per script (two for gpt.py) as a real process: the process itself prints no traceback and exits 2.
REAL_PROCESS = [
    ("gpt", "wrong_type"),
    ("gpt", "truncated_checkpoint"),
    ("char_grpo", "checkpoint_of_another_tokenizer"),
    ("grpo", "group_size_1"),
    ("ppo", "missing_data_file"),
    ("dpo", "identical_chosen_rejected"),
    ("reward_model", "all_lines_malformed"),
    ("rookworld_grpo", "resume_truncated_checkpoint"),
]


def matrix():
    for kind, per_script in CASES.items():
        for script in per_script:
            yield pytest.param(script, kind, id=f"{script}-{kind}")
    for script, cases in EXTRA.items():
        for i in range(len(cases)):
            yield pytest.param(script, f"extra{i}", id=f"{script}-{'_'.join(cases[i][0][::2])}")


def test_every_kind_is_tried_or_explained_for_every_script():
    """The matrix is complete: each script either has a case of each kind or a reason why the kind does not apply."""
    for kind in CASES:
        for script in SCRIPTS:
            tried, explained = script in CASES[kind], script in NOT_APPLICABLE.get(kind, {})
            assert tried != explained, (kind, script)
    assert len(CASES) >= 12


def case(script, kind, f):
    """The flags of a case (the script's tiny valid run, then the bad ones) and the texts its error line must hold."""
    extra, needle = EXTRA[script][int(kind[5:])] if kind.startswith("extra") else CASES[kind][script]
    extra = extra(f) if callable(extra) else extra
    return [*base_args(script, f), *extra], (needle,) if isinstance(needle, str) else needle


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_cases_start_from_settings_that_pass_validation(script, f):
    """Each case changes one thing of a valid command line, so its error is about that one thing."""
    mod = importlib.import_module(script)
    cfg = mod.parse_config(mod.Config, list(map(str, base_args(script, f))))
    mod.validate(getattr(mod, "resolve_clip", lambda c: c)(cfg))  # grpo and char_grpo resolve unset clip ranges first


def previous_run(script, f, out, kind):
    """A run folder as a run leaves it: config.json, metrics.jsonl and samples.txt, and what the kind needs (a ckpt.pt
    that is whole or truncated, a config.json that is not JSON). Every file gets an old modification time."""
    mod = importlib.import_module(script)
    out.mkdir()
    cfg = mod.parse_config(mod.Config, [*map(str, base_args(script, f)), "--out_dir", str(out)])
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    (out / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    (out / "samples.txt").write_text("--- step 0\nsample\n")
    if kind == "resume_truncated_checkpoint":
        shutil.copy(f.truncated, out / "ckpt.pt")
    elif kind == "folder_holds_a_run":
        shutil.copy(f.hh_ckpt, out / "ckpt.pt")
    elif kind == "resume_run_of_another_script":  # its config.json and ckpt.pt are those of another script's run
        other = importlib.import_module("char_grpo" if script == "gpt" else "gpt")
        cfg = other.parse_config(other.Config, ["--out_dir", str(out)])
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        shutil.copy(f.hh_ckpt, out / "ckpt.pt")
    elif kind == "resume_corrupt_config":
        shutil.copy(f.hh_ckpt, out / "ckpt.pt")
        (out / "config.json").write_text('{"out_dir": "run", "max_st')  # cut off mid-write
    past = 1_600_000_000 * 10**9
    for p in out.iterdir():
        os.utime(p, ns=(past, past))


def snapshot(folder):
    """Every file under folder with its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def run_main(script, argv, monkeypatch):
    """main() of a script in this process with these flags; its exit code (0 when it returns)."""
    mod = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *map(str, argv)])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # GracefulExit's handlers stay out of pytest
    try:
        mod.main()
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("script, kind", list(matrix()))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(script, kind, f, tmp_path, monkeypatch, capsys):
    """Exit code 2, one stderr line holding the case's needle, no exception, and the run folder that was there before
    (config.json, metrics.jsonl, samples.txt, maybe ckpt.pt) unchanged to the byte and the modification time."""
    if (script, kind) in NEEDS_BPE and not BPE_AVAILABLE:
        pytest.skip("GPT-2 BPE files unavailable")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # a default out/ or data/ folder would land here
    out = tmp_path / "run"
    previous_run(script, f, out, kind)
    before = snapshot(out)
    args, needles = case(script, kind, f)
    code = run_main(script, args if "--out_dir" in args else [*args, "--out_dir", out], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and all(n in err[0] for n in needles), (code, err)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
@pytest.mark.parametrize("script, kind", REAL_PROCESS)
def test_bad_input_in_a_real_process_exits_2_without_a_traceback(script, kind, f, tmp_path):
    out = tmp_path / "run"
    previous_run(script, f, out, kind)
    before = snapshot(out)
    args, needles = case(script, kind, f)
    proc = run_script(f"{script}.py", *args, "--out_dir", out, env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in needles), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(out) == before


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_with_a_new_out_dir_leaves_no_folder(script, f, tmp_path, monkeypatch, capsys):
    """The --out_dir write probe creates the folder and its missing parents, then removes them: a run stopped by bad
    input found after the probe (its data file is missing) leaves nothing behind."""
    monkeypatch.chdir(tmp_path)
    args, _ = case(script, "missing_data_file", f)
    assert run_main(script, [*args, "--out_dir", tmp_path / "new" / "run"], monkeypatch) == 2
    assert "nonexistent" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_hub_id_with_the_hub_unreachable_ends_at_once_with_one_line(script, tmp_path):
    """Not offline mode, but no hub to reach (a closed local port stands in for a machine without network): one
    request, then one line and exit code 2, without huggingface_hub's minute of "Retrying in ..." lines (the model's
    download, or for reward_model.py the HH-RLHF data set's, which it loads first)."""
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    proc = run_script(f"{script}.py", "--init_from", "nobody/no-such-model", env=env, cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "hub" in lines[0], proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr + proc.stdout
