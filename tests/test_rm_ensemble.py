"""Reward-model ensembles in grpo.py and ppo.py: --reward_model A,B,C with --rm_ensemble mean|min|uwo (Coste et al.
2023). ensemble_scores' hand values, one member scoring exactly as the single reward model did, tiny runs with three
members, and the refusals."""

import pytest
import torch
from conftest import char_checkpoint, metrics, run_main

import grpo
import ppo

SCORES = torch.tensor([[1.0, 2.0], [3.0, 2.0], [2.0, 5.0]])  # (K=3 members, N=2 completions)


@pytest.mark.parametrize("module", [grpo, ppo])
def test_ensemble_scores_hand_values(module):
    """mean: (1+3+2)/3 = 2, (2+2+5)/3 = 3; min: 1, 2; uwo at lambda 0.5: the population variances are 2/3 and 2
    (divided by K = 3), so 2 - 1/3 and 3 - 1."""
    f = module.ensemble_scores
    torch.testing.assert_close(f(SCORES, "mean", 0.5), torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(f(SCORES, "min", 0.5), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(f(SCORES, "uwo", 0.5), torch.tensor([2.0 - 1 / 3, 2.0]))
    torch.testing.assert_close(f(SCORES, "uwo", 0.0), f(SCORES, "mean", 0.0))
    for kind in ("mean", "min", "uwo"):  # one member, or identical members: its scores, bit for bit
        assert torch.equal(f(SCORES[:1], kind, 0.5), SCORES[0])
        assert torch.equal(f(SCORES[:1].expand(3, 2), kind, 0.5), SCORES[0])


def orm(path, seed, chars=grpo.ARITHMETIC_CHARS, task="orm"):
    char_checkpoint(path, chars, block_size=32, seed=seed, reward_head=True)
    ckpt = torch.load(path, weights_only=True)
    ckpt["reward_task"] = task
    torch.save(ckpt, path)
    return str(path)


def arithmetic_args(tmp_path, module, out):
    init = char_checkpoint(tmp_path / "init.pt", grpo.ARITHMETIC_CHARS)
    args = ["--task", "arithmetic", "--init_from", init, "--horizon", "4", "--batch_size", "4", "--max_steps", "2"]
    args += ["--eval_size", "4", "--eval_every", "2", "--seed", "3", "--out_dir", out]
    return [*args, "--group_size", "4"] if module is grpo else [*args, "--num_minibatches", "2"]


def old_frozen_reward_model(cfg, tok, rt, longest):
    """frozen_reward_model before ensembles: one path."""
    rm, rm_tok, task = grpo.load_reward_model(cfg.reward_model)
    assert rm_tok == tok.spec and longest <= rm.body.config.block_size
    return rm.to(rt.device), task


@pytest.mark.parametrize("module", [grpo, ppo])
def test_one_member_trains_exactly_as_the_single_reward_model(tmp_path, monkeypatch, module):
    """A fixed-seed run with --reward_model A logs the same metrics as the code before ensembles. A,A,A with min
    scores the step-0 evaluation the same (identical members agree, so every kind returns their score unchanged); its
    training differs, as building two more models draws from the random stream that sampling then uses."""
    a = orm(tmp_path / "a.pt", 1)
    rows = {}
    for name, rm_args in (("new", [a]), ("same", [f"{a},{a},{a}", "--rm_ensemble", "min"]), ("old", [a])):
        if name == "old":
            monkeypatch.setattr(module, "frozen_reward_model", old_frozen_reward_model)
        out = tmp_path / name
        run_main(module, monkeypatch, *arithmetic_args(tmp_path, module, out), "--reward_model", *rm_args)
        rows[name] = metrics(out)
    assert rows["new"] == rows["old"] and rows["same"][0] == rows["old"][0]
    assert any("eval/sample_rm_score" in r for r in rows["new"])


@pytest.mark.parametrize("module", [grpo, ppo])
@pytest.mark.parametrize("kind", ["mean", "min", "uwo"])
def test_three_members_train_on_the_ensemble_score(tmp_path, monkeypatch, module, kind):
    """Three members: the run trains and reports eval/sample_rm_score; at step 0 (the initial policy's answers, sampled
    with the evaluation's fixed seed, so the same in every run) it is the ensemble of the three members' own scores;
    the checkpoint's checksum covers every member."""
    paths = [orm(tmp_path / f"rm{i}.pt", i) for i in range(3)]
    single = []
    for i, path in enumerate(paths):
        out = tmp_path / f"single{i}"
        run_main(module, monkeypatch, *arithmetic_args(tmp_path, module, out), "--reward_model", path)
        single.append(metrics(out)[0]["eval/sample_rm_score"])
    out = tmp_path / "ens"
    args = [*arithmetic_args(tmp_path, module, out), "--reward_model", ",".join(paths), "--rm_ensemble", kind]
    run_main(module, monkeypatch, *args)
    rows = metrics(out)
    assert any("rl/reward_mean" in r for r in rows)
    if kind == "mean":  # a mean of means: the mean of the members' eval/sample_rm_score
        assert rows[0]["eval/sample_rm_score"] == pytest.approx(sum(single) / 3, abs=1e-5)
    elif kind == "min":  # the min of each answer's scores is at most each member's mean
        assert rows[0]["eval/sample_rm_score"] <= min(single) + 1e-6
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    # the ensemble's fingerprint: every member's weights, summed over the members as the state dicts are read
    members = sum(module.weights_checksum(module.load_reward_model(path)[0]) for path in paths)
    assert ckpt["rm_checksum"] == pytest.approx(members, rel=1e-12)


@pytest.mark.parametrize("module", [grpo, ppo])
@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--rm_ensemble", "min"], "--rm_ensemble min needs --reward_model A,B,.."),
        (["--rm_ensemble", "uwo"], "--rm_ensemble uwo needs --reward_model A,B,.."),
        (["--reward_model", "{a},{a}", "--rm_ensemble", "max"], "--rm_ensemble"),
        (["--reward_model", "{a},{a}", "--rm_ensemble", "uwo", "--uwo_lambda", "-1"], "--uwo_lambda must be >= 0"),
        (["--reward_model", "{a},{pref}"], "trained for different tasks"),
        (["--reward_model", "{a},{other}"], "uses another tokenizer than the policy"),
    ],
)
def test_refusals_exit_2_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, module, extra, needle):
    a = orm(tmp_path / "a.pt", 1)
    pref = orm(tmp_path / "pref.pt", 2, task="preference")
    other = orm(tmp_path / "other.pt", 3, chars=grpo.ARITHMETIC_CHARS + " ")
    extra = [e.format(a=a, pref=pref, other=other) for e in extra]
    if "--reward_model" not in extra:
        extra += ["--reward_model", a]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_main(module, monkeypatch, *arithmetic_args(tmp_path, module, out), *extra)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not out.exists() or not any(out.iterdir())


def test_ppo_value_init_from_an_ensemble_is_refused(tmp_path, monkeypatch, capsys):
    a = orm(tmp_path / "a.pt", 1)
    args = [*arithmetic_args(tmp_path, ppo, tmp_path / "run"), "--reward_model", f"{a},{a}"]
    with pytest.raises(SystemExit) as exit_info:
        run_main(ppo, monkeypatch, *args, "--value_init", "reward_model")
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and "--value_init reward_model takes one" in lines[0], lines


@pytest.mark.parametrize("module", [grpo, ppo])
def test_resume_checks_every_members_checksum(tmp_path, monkeypatch, capsys, module):
    """--resume with one member swapped for another model is refused (exit 2, one line); with the same members it
    goes on."""
    a, b, c, d = (orm(tmp_path / f"{name}.pt", seed) for seed, name in enumerate("abcd"))
    out = tmp_path / "run"
    run_main(module, monkeypatch, *arithmetic_args(tmp_path, module, out), "--reward_model", f"{a},{b},{c}")
    capsys.readouterr()
    resume = ["--resume", "--out_dir", out, "--max_steps", "3", "--reward_model"]
    with pytest.raises(SystemExit) as exit_info:
        run_main(module, monkeypatch, *resume, f"{a},{b},{d}")
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and "--resume: --reward_model" in lines[0], lines
    run_main(module, monkeypatch, *resume, f"{a},{b},{c}")
    assert max(r["step"] for r in metrics(out)) >= 2
