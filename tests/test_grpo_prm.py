"""GRPO on process rewards from a learned reward model (grpo.py --task arithmetic --reward_model PRM --adv process):
process_advantages with `steps` (the positions that carry a reward) against a hand computation and today's result
without them; the step ends of a completion (its newlines, and the last real token of one cut off before its final
newline); the reward model's reward at each step end; the step accuracies of the greedy held-out answers; a tiny
end-to-end run; and the refusals (exit code 2)."""

import dataclasses
import json
import math
import random

import pytest
import torch
from conftest import char_checkpoint, run_main, run_main_captured
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo

CHARS = grpo.ARITHMETIC_CHARS
TOK = grpo.CharTokenizer(CHARS)
NEWLINE = TOK.encode("\n")[0]


def prm_checkpoint(path, seed=1, task="prm"):
    """A tiny random char reward model of the arithmetic characters, saved as reward_model.py --task prm saves one."""
    char_checkpoint(path, CHARS, block_size=32, seed=seed, reward_head=True)
    ckpt = torch.load(path, weights_only=True)
    ckpt["reward_task"] = task
    torch.save(ckpt, path)
    return path


def todays_process_advantages(token_rewards, mask, group_size, eps=1e-4):
    """process_advantages as it was before `steps`, written out here: every real token carries a reward."""
    N, T = token_rewards.shape
    r = token_rewards.reshape(-1, group_size * T)
    m = mask.reshape(-1, group_size * T).float()
    count = m.sum(1, keepdim=True)
    mean = (r * m).sum(1, keepdim=True) / count.clamp(min=1)
    std = ((((r - mean) * m) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    same = ((r == r.max(1, keepdim=True).values) | (m == 0)).all(1, keepdim=True)
    normed = ((r - mean) / (std + eps) * m).masked_fill(same, 0.0).view(N, T)
    return normed.flip(1).cumsum(1).flip(1) * mask


# ------------------------------------------------------------------------------------------- process_advantages


def test_process_advantages_with_steps_hand_values():
    """Two groups of two completions, T = 4. Only the step positions are normalised (the other positions hold
    rewards of 9 that must count for nothing), by their group's mean and unbiased std, and a token's advantage is
    the sum of the normalised rewards of the steps that end at or after it; padding gets 0.
    Group 0: row 0 steps at t = 1, 3 (0.8, 0.2); row 1 (t = 3 padding) at t = 0, 2 (0.6, 0.4): mean 0.5,
    std sqrt((0.09 + 0.09 + 0.01 + 0.01) / 3). Group 1: row 2 one step at t = 3 (1.0); row 3 at t = 1, 3 (0.5, 0.0):
    mean 0.5, std sqrt((0.25 + 0 + 0.25) / 2) = 0.5."""
    rewards = torch.tensor([[9.0, 0.8, 9.0, 0.2], [0.6, 9.0, 0.4, 9.0], [9.0, 9.0, 9.0, 1.0], [9.0, 0.5, 9.0, 0.0]])
    steps = torch.tensor([[0.0, 1, 0, 1], [1, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 1]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    s0 = math.sqrt(0.2 / 3) + 1e-4
    s1 = 0.5 + 1e-4
    expected = torch.tensor(
        [
            [0.3 / s0 - 0.3 / s0, 0.3 / s0 - 0.3 / s0, -0.3 / s0, -0.3 / s0],
            [0.1 / s0 - 0.1 / s0, -0.1 / s0, -0.1 / s0, 0.0],
            [0.5 / s1, 0.5 / s1, 0.5 / s1, 0.5 / s1],
            [-0.5 / s1, -0.5 / s1, -0.5 / s1, -0.5 / s1],
        ]
    )
    adv = grpo.process_advantages(token_rewards=rewards, mask=mask, group_size=2, steps=steps)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(n_groups=st.integers(1, 3), G=st.integers(2, 4), T=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_process_advantages_without_steps_are_todays(n_groups, G, T, seed):
    """steps=None (and steps=mask) gives exactly today's result: every real token carries a reward (next_token)."""
    gen = torch.Generator().manual_seed(seed)
    N = n_groups * G
    for rewards in (torch.randn(N, T, generator=gen), torch.randint(0, 2, (N, T), generator=gen).float()):
        mask = (torch.rand(N, T, generator=gen) > 0.2).float()
        today = todays_process_advantages(rewards, mask, G)
        assert torch.equal(grpo.process_advantages(token_rewards=rewards, mask=mask, group_size=G), today)
        assert torch.equal(grpo.process_advantages(rewards, mask, G, steps=mask), today)


@settings(max_examples=80, deadline=None)
@given(n_groups=st.integers(1, 3), G=st.integers(2, 4), T=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_process_advantages_are_constant_between_step_ends_and_zero_after_the_last(n_groups, G, T, seed):
    """Completions of random lengths with random step ends among their real tokens: the advantage changes only just
    after a step end (it is the same on every token from one step end's successor to the next step end), it is 0 on
    every token after a row's last step end and on padding, and the normalised step rewards of a group sum to 0."""
    gen = torch.Generator().manual_seed(seed)
    N = n_groups * G
    lengths = torch.randint(1, T + 1, (N, 1), generator=gen)
    mask = (torch.arange(T) < lengths).float()  # (N, T)
    steps = (torch.rand(N, T, generator=gen) < 0.4).float() * mask
    rewards = torch.rand(N, T, generator=gen) * steps + 5 * (1 - steps)  # what is off the steps must not count
    adv = grpo.process_advantages(rewards, mask, G, steps=steps)
    for i in range(N):
        ends = steps[i].nonzero().flatten().tolist()
        last = ends[-1] if ends else -1
        for t in range(T):
            if t > last or mask[i, t] == 0:
                assert adv[i, t] == 0
            elif t < T - 1 and steps[i, t] == 0:
                assert adv[i, t] == adv[i, t + 1]  # no reward at t: the sum from t on is the sum from t + 1 on
    nxt = torch.cat([adv[:, 1:], torch.zeros(N, 1)], 1)
    normed = (adv - nxt) * mask  # the normalised reward at each position
    assert torch.all(normed[steps == 0].abs() < 1e-4)
    assert torch.allclose(normed.view(n_groups, -1).sum(1), torch.zeros(n_groups), atol=1e-4)


# ------------------------------------------------------------------------------------------- step ends, PRM rewards


def completion_of(texts, H):
    """Completions (N, H) of these texts, each padded with newlines that are not real tokens, and their mask."""
    completion = torch.tensor([TOK.encode(t.ljust(H, "\n")) for t in texts])
    mask = torch.tensor([[float(i < len(t)) for i in range(H)] for t in texts])
    return completion, mask


def test_step_ends_are_the_newlines_and_the_last_token_of_a_cut_off_completion():
    """A completion's step ends: each newline among its real tokens; a completion cut off before its final newline
    also ends a (partial) step at its last real token. Newlines in the padding are no step end."""
    texts = ["1+2=3\n3*4=12\n", "1+2=3\n3*4=1", "7", "\n", "12+3=15"]
    completion, mask = completion_of(texts, 14)
    ends = grpo.step_ends(completion, mask, NEWLINE)
    expected = [[5, 12], [5, 10], [0], [0], [6]]
    assert [row.nonzero().flatten().tolist() for row in ends] == expected


@pytest.mark.parametrize("horizon", [12, 14])
def test_the_prm_reward_of_a_step_is_the_sigmoid_of_its_score_at_the_step_newline(tmp_path, horizon):
    """process_rewards: sigmoid(score) at each step's newline, the score recomputed here by the reward model on
    prompt + completion alone (no padding, no batch); a step cut off before its newline (at the horizon, 12, or
    before it) is scored at a newline written after it, where reward_model.py trains it; 0 at every other position."""
    prm = grpo.load_reward_model(str(prm_checkpoint(tmp_path / "prm.pt")))[0]
    prompts = ["1+2*4=", "12-3+5=", "9*9-1="]
    texts = ["1+2=3\n3*4=1", "12-3=9\n9+5=1", "9*9=81\n"]
    completion, mask = completion_of(texts, horizon)
    rewards, ends = grpo.process_rewards(prm, [TOK.encode(p) for p in prompts], completion, mask, NEWLINE)
    assert torch.equal(ends, grpo.step_ends(completion, mask, NEWLINE))
    assert torch.all(rewards[ends == 0] == 0)
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, texts)):
            newline = "" if t.endswith("\n") else "\n"
            scores = prm(torch.tensor([TOK.encode(p + t + newline)]))[0, len(p) :]  # at each completion token
            for j in ends[i].nonzero().flatten().tolist():
                at = j if t[j] == "\n" else j + 1  # the step's own newline, or the one written after it
                assert rewards[i, j].item() == pytest.approx(torch.sigmoid(scores[at]).item(), abs=1e-5)


def arithmetic_task(tmp_path, **overrides):
    """grpo.ArithmeticTask on the char tokenizer, CPU float32, --steps 2 of one-digit numbers."""
    settings = {"task": "arithmetic", "init_from": "init.pt", "steps": 2, "digits": 1, "horizon": 14, **overrides}
    rt = grpo.Runtime(torch.device("cpu"), torch.float32)
    cfg = grpo.Config(**settings)
    return grpo.ArithmeticTask(cfg, TOK, rt, process=grpo.advantage_kind(cfg) == "process"), rt


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return grpo.GPT(grpo.GPTConfig(32, len(CHARS), 1, 2, 16, 0.0, True))


@pytest.mark.parametrize("kind", ["prm", "orm"])
def test_collect_gives_the_reward_at_each_step_end_and_advantages_on_every_real_token(tmp_path, kind):
    """--reward_model RM --adv process: collect's rewards are the reward model's process_rewards (0 off the step
    ends), its reward mask is step_ends of the completions, and the advantages are finite on every real token and 0 on
    padding. An orm is taken too: trained on the outcome label at every answer token, its score at a step's end is
    its estimate that the answer will end right."""
    rm = prm_checkpoint(tmp_path / f"{kind}.pt", task=kind)
    task, rt = arithmetic_task(tmp_path, reward_model=str(rm), adv="process", eval_size=4)
    cfg = dataclasses.replace(task.cfg, group_size=4)
    random.seed(0)
    batch = grpo.collect(task, tiny_policy(), tiny_policy(), cfg, rt, 2)
    completion, mask = batch["completion"], batch["mask"]
    steps = grpo.step_ends(completion, mask, NEWLINE)
    assert torch.equal(batch["reward_mask"], steps)
    expected, _ = grpo.process_rewards(task.rm, batch["prompts"], completion, mask, NEWLINE)
    torch.testing.assert_close(batch["rewards"], expected)
    assert torch.all(batch["rewards"][steps == 0] == 0) and torch.all(batch["rewards"][steps > 0] > 0)
    adv = grpo.compute_advantages(batch["rewards"], batch["reward_mask"], mask, "process", 4, "group", rt)
    assert adv.shape == mask.shape and torch.isfinite(adv).all() and torch.all(adv[mask == 0] == 0)
    assert adv.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ evaluation


def test_step_accuracies_of_the_greedy_answers_split_by_exact_final_answers(tmp_path, monkeypatch):
    """eval/step_accuracy_right: the mean over the exact greedy answers of their share of lines step_correct judges
    right; eval/step_accuracy_wrong: the same over the other answers that have a line. Hand answers: exact with
    both steps right (1), exact through a wrong first step (0: every later step is wrong too), wrong second step
    (1/2), cut off after a right first step (1/2), a wrong one-line answer (0), and empty answers (left out)."""
    task, rt = arithmetic_task(tmp_path, eval_size=60)
    problems = task.eval_problems
    assert len(problems) >= 6
    texts = []
    for i, (_, answer) in enumerate(problems):
        first, second = answer.splitlines()
        x, y = first.split("=")
        if i == 0:
            texts.append(answer)
        elif i == 1:  # a wrong first result, carried on to the right final result
            wrong = int(y) + 1
            rest = second.split("=")[0][len(y) :]  # "op c" of the second step
            texts.append(f"{x}={wrong}\n{wrong}{rest}={second.split('=')[1]}\n")
        elif i == 2:
            texts.append(f"{first}\n{second}1\n")  # the last result with a digit too many
        elif i == 3:
            texts.append(f"{first}\n4")
        elif i == 4:
            texts.append("9\n")
        else:
            texts.append("")
    completion, mask = completion_of(texts, 20)
    answers = [a for _, a in problems]
    exact = task.measures(completion, mask, answers)["rl/accuracy"]
    assert exact.tolist()[:6] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    prompts = [TOK.encode(p) for p, _ in problems]
    asked = []

    def answer(model, rt, n, temperature):  # the greedy answers above, in place of the model's
        asked.append((n, temperature))
        return prompts, completion, mask, exact

    monkeypatch.setattr(task, "answer", answer)
    metrics, _ = task.evaluate(None, None, rt, TOK, 0)
    assert asked == [(1, 0.0)]  # one greedy pass: the step accuracies read the evaluation's own answers
    assert metrics["eval/step_accuracy_right"] == pytest.approx(0.5)
    assert metrics["eval/step_accuracy_wrong"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    exact = torch.zeros_like(exact)  # no exact answer: the mean over none of them is nan
    metrics = grpo.step_metrics(problems, task.texts(completion, mask), exact)
    assert math.isnan(metrics["eval/step_accuracy_right"])
    assert metrics["eval/step_accuracy_wrong"] == pytest.approx((1 + 0 + 0.5 + 0.5 + 0.0) / 5)


# ------------------------------------------------------------------------------------------ end to end, refusals


def test_a_tiny_prm_run_writes_its_run_folder_and_finite_process_advantages(tmp_path, monkeypatch):
    """grpo.py --task arithmetic --steps 2 --digits 1 --reward_model PRM --adv process for 2 steps: the run folder
    holds config.json, metrics.jsonl, final_results.json and ckpt.pt; every advantage is finite, per token (N, H),
    and computed with the step ends; the rewards logged are PRM probabilities; every evaluation logs the step
    accuracies of the greedy answers and the sampled answers' KL."""
    init = char_checkpoint(tmp_path / "init.pt", CHARS, block_size=32)
    prm = prm_checkpoint(tmp_path / "prm.pt")
    seen = []
    real = grpo.process_advantages

    def recording(token_rewards, mask, group_size, eps=1e-4, steps=None):
        adv = real(token_rewards, mask, group_size, eps, steps=steps)
        seen.append((adv, steps))
        return adv

    monkeypatch.setattr(grpo, "process_advantages", recording)
    out = tmp_path / "run"
    args = ["--task", "arithmetic", "--steps", "2", "--digits", "1", "--reward_model", prm, "--adv", "process"]
    args += ["--init_from", init, "--horizon", "14", "--batch_size", "2", "--group_size", "4", "--eval_size", "8"]
    run_main(grpo, monkeypatch, *args, "--max_steps", "2", "--eval_every", "2", "--device", "cpu", "--out_dir", out)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "ckpt.pt"):
        assert (out / name).is_file(), name
    assert len(seen) == 4  # a step's update, and its rl/zero_std_frac (no_signal: are the advantages all 0?)
    for adv, steps in seen:
        assert adv.shape == (8, 14) and torch.isfinite(adv).all() and steps is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rl/reward_mean" in r]
    assert len(train) == 2 and all(0 < r["rl/reward_mean"] < 1 and math.isfinite(r["train/loss"]) for r in train)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(math.isfinite(r["eval/sample_kl"]) and "eval/sample_rm_score" in r for r in evals)
    assert all("eval/step_accuracy_right" in r and "eval/step_accuracy_wrong" in r for r in evals)
    results = json.loads((out / "final_results.json").read_text())
    assert "step_accuracy_right" in results["before"] and "step_accuracy_right" in results["after"]


@pytest.mark.parametrize("case", ["no reward model", "reward_model task"])
def test_process_advantages_without_step_rewards_are_refused(tmp_path, monkeypatch, case):
    """--adv process needs per-token rewards: on arithmetic without a reward model, or on the reward_model task
    (one score per completion), it ends with one line on stderr and exit code 2, and writes nothing."""
    init = char_checkpoint(tmp_path / "init.pt", CHARS, block_size=32)
    args = ["--task", "arithmetic", "--steps", "2", "--horizon", "14", "--init_from", init, "--adv", "process"]
    if case == "reward_model task":
        args = ["--task", "reward_model", "--reward_model", prm_checkpoint(tmp_path / "rm.pt"), "--adv", "process"]
    out = tmp_path / "run"
    code, _, err = run_main_captured(grpo, monkeypatch, *args, "--device", "cpu", "--out_dir", out)
    assert code == 2 and len(err) == 1 and "--adv process" in err[0], err
    assert not out.exists() or not any(out.iterdir())


def test_a_step_is_scored_alike_in_training_best_of_n_and_grpo(tmp_path):
    """One place a step is scored: the same solutions (a cut-off last step, a wrong step and one after it, right
    ones) give the same step probabilities where reward_model.py trains the prm (its labelled positions, encode), in
    best-of-n (solution_scores: their product and the last one) and in grpo.py's process rewards (at step_ends)."""
    import reward_model

    path = str(prm_checkpoint(tmp_path / "prm.pt"))
    verifier = reward_model.load_reward_model(path)[0]
    tok = reward_model.CharTokenizer(CHARS)
    prompts = ["1+2*4=", "12-3+5=", "9*9-1=", "2+2*3="]
    texts = ["1+2=3\n3*4=12\n", "12-3=9\n9+5=1", "9*9=81\n81-1=8", "2+2=5\n5*3=15\n"]
    trained = []  # each solution's step probabilities where training puts the labels
    with torch.no_grad():
        for p, t in zip(prompts, texts):
            ids, labels = reward_model.encode("prm", tok, reward_model.sampled_example("prm", p, "", t), 64)
            probs = torch.sigmoid(verifier(torch.tensor([ids])))[0]
            trained.append(probs[torch.tensor(labels) != -1].tolist())
    assert [len(t) for t in trained] == [2, 2, 2, 2]
    pairs = list(zip(prompts, texts))
    for how, expected in (("prod", [math.prod(t) for t in trained]), ("last", [t[-1] for t in trained])):
        found = reward_model.solution_scores(verifier, tok, "prm", pairs, how)
        assert found == pytest.approx(expected, abs=1e-5)
    prm = grpo.load_reward_model(path)[0]
    completion, mask = completion_of(texts, 14)
    rewards, ends = grpo.process_rewards(prm, [TOK.encode(p) for p in prompts], completion, mask, NEWLINE)
    assert torch.equal(ends, grpo.step_ends(completion, mask, NEWLINE))
    for i, expected in enumerate(trained):
        assert rewards[i][ends[i] > 0].tolist() == pytest.approx(expected, abs=1e-5)
