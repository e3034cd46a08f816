"""grpo.py --task reasoning (R1-Zero in miniature): the answer reader, the all-steps-right check, the reward (the same
for a right direct answer and for right steps), the held-out split shared with gpt.py --data reasoning, the
evaluation's metrics, the gate's forced prompts, and a tiny base + RL run end to end."""

import json
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import metrics, run_main
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt
import grpo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import r1_zero  # noqa: E402

CHARS = gpt.REASONING_CHARS


def held(prompt):
    """The held-out rule, written out here: crc32 of the arithmetic prompt is 0 mod 10."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def evaluate_left_to_right(expr):
    """The value of an expression evaluated left to right, and the worked steps written out by hand: each
    operation's result followed by the operations not yet done."""
    numbers = [int(n) for n in expr.replace("-", " ").replace("+", " ").replace("*", " ").split()]
    ops = [c for c in expr if c in "+-*"]
    x = numbers[0]
    steps = []
    for i, (op, y) in enumerate(zip(ops, numbers[1:])):
        result = {"+": x + y, "-": x - y, "*": x * y}[op]
        rest = "".join(f"{o}{n}" for o, n in zip(ops[i + 1 :], numbers[i + 2 :]))
        steps.append(f"{x}{op}{y}={result}{rest}")
        x = result
    return x, ";".join(steps)


expressions = st.builds(
    lambda first, rest: str(first) + "".join(f"{op}{n}" for op, n in rest),
    st.integers(0, 99),
    st.lists(st.tuples(st.sampled_from("+-*"), st.integers(0, 99)), min_size=1, max_size=5),
)


@settings(max_examples=200, deadline=None)
@given(expressions, st.integers(-999, 999))
def test_read_answer_reads_direct_stepped_and_bridge_completions_and_refuses_unfinished_ones(expr, other):
    """A direct answer, worked steps and steps followed by an answer are read as their value; the last A: wins over
    a step's result; every prefix of a completion without its newline (truncated by the horizon) reads None."""
    value, steps = evaluate_left_to_right(expr)
    assert grpo.worked_steps(f"Q:{expr};") == steps
    assert grpo.read_answer(f"A:{value}\n") == value
    assert grpo.read_answer(f"{steps}\n") == value
    assert grpo.read_answer(f"{steps};A:{value}\n") == value
    assert grpo.read_answer(f"{steps};A:{other}\n") == other  # the answer given last
    completion = f"{steps};A:{value}\n"
    for cut in range(len(completion)):
        assert grpo.read_answer(completion[:cut]) is None


@pytest.mark.parametrize(
    "text",
    ["A:\n", "A:x\n", "\n", "7+2\n", "Q:7+2;\n", "", "A:12", "3+4=7;7-1=6"],  # malformed, or truncated (no newline)
)
def test_read_answer_gives_none_to_malformed_and_truncated_completions(text):
    assert grpo.read_answer(text) is None


def test_worked_steps_are_what_gpt_py_writes_in_its_worked_and_bridge_documents():
    """The check of every step and the base's corpus agree: for each kind of document, the steps that gpt.py writes
    are worked_steps of the question."""
    cfg = gpt.Config(data="reasoning", digits=2, ops="+-*", steps=5, worked_frac=0.5, bridge_frac=0.5)
    rng = random.Random(3)
    seen = set()
    for _ in range(300):
        context, target = gpt.reasoning_document(rng, cfg, False)
        expr = context.removeprefix("Q:")[:-1]
        if not target.startswith("A:"):  # worked or bridge
            seen.add(context.startswith("Q:"))
            assert target.split(";A:")[0].rstrip("\n") == grpo.worked_steps(f"Q:{expr};")
    assert seen == {True, False}  # both kinds were checked


def reasoning_cfg(**kw):
    return grpo.Config(task="reasoning", init_from="base.pt", digits=1, ops="+-", steps=4, min_steps=2, **kw)


def encode(tok, texts, horizon):
    """Completions as the rollouts hold them: (N, H) ids padded with the newline, and their mask."""
    completion = torch.full((len(texts), horizon), tok.encode("\n")[0])
    mask = torch.zeros(len(texts), horizon)
    for i, text in enumerate(texts):
        ids = tok.encode(text)[:horizon]
        completion[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1.0
    return completion, mask


def test_reward_is_one_for_a_right_direct_answer_and_for_right_steps_alike_and_sits_on_the_last_token():
    """The outcome reward reads only the answer: right direct, right steps and right steps with an answer score 1.0;
    a right answer through a wrong step scores 1.0 too (no process reward); a wrong answer, a malformed one and one
    cut by the horizon score 0.0. Each reward sits on the completion's last real token."""
    tok = grpo.CharTokenizer(CHARS)
    task = grpo.ReasoningTask(reasoning_cfg(horizon=24), tok, grpo.Runtime(torch.device("cpu"), torch.float32))
    assert task.n_ends == 1 and task.eos_id == tok.encode("\n")[0]
    prompt = "Q:7+2-5;"
    texts = {
        "7+2=9-5;9-5=4\n": 1.0,  # right steps
        "A:4\n": 1.0,  # right direct answer
        "7+2=9-5;9-5=4;A:4\n": 1.0,  # steps, then the answer
        "7+2=8-5;8-5=4\n": 1.0,  # a wrong step, a right result: outcome reward only
        "A:5\n": 0.0,
        "7+2=9-5;9-5=3\n": 0.0,
        "A:\n": 0.0,
        "7+2=9-5;9-5=4;A:4;7+2=9-5;9-5=4": 0.0,  # no newline within the horizon
    }
    completion, mask = encode(tok, list(texts), 24)
    rewards, reward_mask = task.rewards([tok.encode(prompt)] * len(texts), completion, mask, [4] * len(texts))
    last = mask.sum(1).long() - 1
    assert torch.equal(reward_mask, torch.nn.functional.one_hot(last, 24).float())
    assert rewards[torch.arange(len(texts)), last].tolist() == list(texts.values())
    assert task.measures(completion, mask, [4] * len(texts))["rl/accuracy"].tolist() == list(texts.values())


def test_the_task_trains_on_no_held_out_problem_and_evaluates_only_held_out_ones():
    """Training prompts are of min_steps..steps operations and never held out; the evaluation problems are
    distinct held-out ones of each count of operations, with their value."""
    tok = grpo.CharTokenizer(CHARS)
    task = grpo.ReasoningTask(reasoning_cfg(eval_size=40), tok, grpo.Runtime(torch.device("cpu"), torch.float32))
    random.seed(0)
    prompts, answers = task.sample(300)
    counts = set()
    for ids, answer in zip(prompts, answers):
        prompt = tok.decode(ids)
        expr = prompt[2:-1]
        assert prompt.startswith("Q:") and prompt.endswith(";") and not held(f"{expr}=")
        assert answer == evaluate_left_to_right(expr)[0]
        counts.add(sum(c in "+-" for c in expr))
    assert counts == {2, 3, 4}
    exprs = [p[2:-1] for p, _ in task.eval_problems]
    assert len(set(exprs)) == len(exprs) and all(held(f"{e}=") for e in exprs)
    assert all(a == evaluate_left_to_right(e)[0] for e, (_, a) in zip(exprs, task.eval_problems))
    assert {sum(c in "+-" for c in e) for e in exprs} == {2, 3, 4}


def test_evaluation_measures_modes_steps_and_lengths_of_the_answers_it_is_given(monkeypatch):
    """evaluate's metrics on answers set here (task.answer replaced): the accuracy, the share that write steps, the
    share whose every step is right (a right answer through a wrong step does not count), the accuracy in each mode
    and the mean lengths of right and wrong answers, each computed here by hand."""
    tok = grpo.CharTokenizer(CHARS)
    task = grpo.ReasoningTask(reasoning_cfg(horizon=24), tok, grpo.Runtime(torch.device("cpu"), torch.float32))
    task.eval_problems = [("Q:7+2-5;", 4), ("Q:3-8;", -5)]
    answers = {  # per problem: (greedy answer, four sampled answers)
        "Q:7+2-5;": ("7+2=9-5;9-5=4\n", ["A:4\n", "7+2=8-5;8-5=4\n", "A:3\n", "7+2=9-5;9-5=4;A:4\n"]),
        "Q:3-8;": ("A:-5\n", ["3-8=-5\n", "3-8=-4\n", "A:-5\n", "3-8=-5"]),
    }

    def answer(model, rt, n, temperature):
        rows = [t for p, _ in task.eval_problems for t in ([answers[p][0]] if n == 1 else answers[p][1])]
        completion, mask = encode(tok, rows, 24)
        values = [a for _, a in task.eval_problems for _ in range(n)]
        return None, completion, mask, task.gold(completion, mask, values)

    monkeypatch.setattr(task, "answer", answer)
    got, _ = task.evaluate(None, None, None, tok, 0)
    assert got["eval/n_problems"] == 2
    assert got["eval/accuracy"] == 1.0 and got["eval/step_share"] == 0.5 and got["eval/steps_right"] == 0.5
    assert got["eval/length_right"] == (14 + 5) / 2 and got["eval/length"] == (14 + 5) / 2
    sampled = answers["Q:7+2-5;"][1] + answers["Q:3-8;"][1]
    right = [1, 1, 0, 1, 1, 0, 1, 0]
    steps = [0, 1, 0, 1, 1, 1, 0, 1]
    every_step = [0, 0, 0, 1, 1, 0, 0, 0]  # "7+2=8-5;8-5=4" is right only in its result; "3-8=-5" never ended
    lengths = [len(t) for t in sampled]
    assert got["eval/sample_accuracy"] == pytest.approx(sum(right) / 8)
    assert got["eval/sample_step_share"] == pytest.approx(sum(steps) / 8)
    assert got["eval/sample_steps_right"] == pytest.approx(sum(every_step) / 8)
    assert got["eval/sample_accuracy_steps"] == pytest.approx(3 / 5)
    assert got["eval/sample_accuracy_direct"] == pytest.approx(2 / 3)
    assert got["eval/sample_length_right"] == pytest.approx(sum(n for n, r in zip(lengths, right) if r) / 5)
    assert got["eval/sample_length_wrong"] == pytest.approx(sum(n for n, r in zip(lengths, right) if not r) / 3)
    assert got["eval/accuracy_direct"] == 1.0 and got["eval/accuracy_steps"] == 1.0


def test_the_gate_forces_each_mode_by_its_prompt():
    """Forced direct ends with "A:"; forced steps ends with the expression's first number, so that the worked steps
    continue it; both read back the value with the part the prompt wrote."""
    for expr in ["7+2-5", "12-3+40", "0-9"]:
        value, steps = evaluate_left_to_right(expr)
        prompts = r1_zero.forced_prompts(expr)
        assert prompts["natural"] == f"Q:{expr};"
        assert prompts["direct"] == f"Q:{expr};A:"
        first = expr.split("+")[0].split("-")[0]
        assert prompts["steps"] == f"Q:{expr};{first}" and steps.startswith(first)
        assert grpo.read_answer(prompts["steps"].split(";", 1)[1] + steps[len(first) :] + "\n") == value
        assert grpo.read_answer(prompts["direct"].split(";", 1)[1] + f"{value}\n") == value


def test_the_gate_problems_are_held_out_and_distinct():
    problems = r1_zero.gate_problems(50)
    assert len({e for e, _ in problems}) == 50
    for expr, answer in problems:
        assert held(f"{expr}=") and answer == evaluate_left_to_right(expr)[0]
        assert r1_zero.GATE_OPS[0] <= sum(c in "+-*" for c in expr) <= r1_zero.GATE_OPS[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--init_from", "scratch"], "warm start"),
        (["--init_from", "x.pt", "--min_steps", "5"], "--min_steps"),
        (["--init_from", "x.pt", "--reward_model", "rm.pt"], "--reward_model"),
    ],
)
def test_bad_reasoning_flags_exit_2_with_one_line(flags, message, monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_main(grpo, monkeypatch, "--task", "reasoning", "--steps", "4", *flags, "--out_dir", tmp_path / "r")
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_reasoning_base_and_rl_run_log_every_reasoning_metric(tmp_path, monkeypatch):
    base = tmp_path / "base"
    tiny = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--batch_size", "8"]
    task = ["--digits", "1", "--ops", "+-", "--steps", "3"]
    run_main(gpt, monkeypatch, "--data", "reasoning", *task, *tiny, "--max_steps", "3", "--eval_every", "3",
             "--eval_iters", "1", "--out_dir", base)  # fmt: skip
    out = tmp_path / "rl"
    run_main(grpo, monkeypatch, "--task", "reasoning", "--init_from", base / "ckpt.pt", *task, "--min_steps", "2",
             "--horizon", "30", "--batch_size", "2", "--group_size", "2", "--max_steps", "2", "--eval_every", "2",
             "--eval_size", "3", "--loss_type", "dr_grpo", "--scale_rewards", "none", "--beta_kl", "0",
             "--reference", "none", "--out_dir", out)  # fmt: skip
    evals = [r for r in metrics(out) if "eval/accuracy" in r]
    names = ["accuracy", "length", "step_share", "steps_right", "accuracy_steps", "accuracy_direct", "length_right",
             "length_wrong"]  # fmt: skip
    for r in evals:
        for name in names:
            assert f"eval/{name}" in r and f"eval/sample_{name}" in r
        assert 0 <= r["eval/sample_accuracy"] <= 1 and r["eval/n_problems"] >= 3
    results = json.loads((out / "final_results.json").read_text())
    assert results["task"] == "reasoning" and "step_share" in results["after"]
