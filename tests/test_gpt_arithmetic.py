"""gpt.py --data arithmetic: its evaluation logs eval/accuracy (greedy exact answers) and eval/n_problems on the
held-out problems grpo.py evaluates, puts the final accuracy in final_results.json, and writes the held-out problems
with the model's greedy answers to samples.txt, one a line."""

import json
import random
import zlib

import torch
from conftest import metrics, run_main

import gpt
import grpo

CHARS = gpt.ARITHMETIC_CHARS
FLAGS = ["--data", "arithmetic", "--tokenizer", "char", "--digits", "1", "--ops", "+-"]
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "16"]


def held(prompt):
    """The held-out rule, written out here: crc32 of the prompt is 0 mod 10."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def naive_greedy(model, prompt, n_new):
    """The argmax continuation of prompt, the whole sequence recomputed at every token (no cache, no batch), up to
    and without the first newline; None when no newline comes within n_new tokens."""
    ids = [CHARS.index(c) for c in prompt]
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = model(torch.tensor([ids + out]))
            nxt = int(logits[0, -1].argmax())
            if CHARS[nxt] == "\n":
                return "".join(CHARS[i] for i in out)
            out.append(nxt)
    return None


def test_arithmetic_sft_logs_greedy_exact_accuracy_on_held_out_problems_and_writes_them_as_samples(
    tmp_path, monkeypatch
):
    """A tiny SFT run: every evaluation logs eval/accuracy in [0, 1] and eval/n_problems, the distinct held-out
    problems of grpo.py's evaluation draw; the final accuracy (final_results.json) equals greedy decoding + exact
    match recomputed here on ckpt.pt, and samples.txt holds each problem with the model's greedy answer, a wrong one
    marked."""
    out = tmp_path / "run"
    args = [*FLAGS, *TINY, "--max_steps", "60", "--eval_every", "30", "--eval_iters", "2", "--lr", "1e-2"]
    run_main(gpt, monkeypatch, *args, "--warmup_steps", "5", "--out_dir", out)

    rng = random.Random(1234)  # grpo.py's evaluation problems at --eval_size 1000: 1000 draws, repeats dropped
    problems = sorted({grpo.draw_problem(rng, 1, "+-", True) for _ in range(1000)})
    assert problems and all(held(p) for p, _ in problems)
    evals = [r for r in metrics(out) if "eval/val_loss" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/n_problems"] == len(problems) for r in evals)

    model, _, _ = gpt.load_model(str(out / "ckpt.pt"))
    model.eval()
    answers = [naive_greedy(model, p, 4) for p, _ in problems]
    exact = [a is not None and a == answer.strip() for a, (_, answer) in zip(answers, problems)]
    results = json.loads((out / "final_results.json").read_text())
    assert results["final_accuracy"] == evals[-1]["eval/accuracy"] == sum(exact) / len(problems)
    assert results["n_problems"] == len(problems)

    header, *lines = (out / "samples.txt").read_text().splitlines()
    assert header == f"# greedy answers to the {len(problems)} held-out problems, sorted; {sum(exact)} right"
    assert len(lines) == len(problems)
    for line, (prompt, right), answer, ok in zip(lines, problems, answers, exact):
        written, _, wrong = line.partition("  # wrong: ")
        assert line.startswith(prompt) and held(prompt)
        assert wrong == ("" if ok else right.strip())  # a wrong answer is marked, with the right one
        if answer is not None:  # an answer that ended within the horizon is written whole
            assert written == prompt + answer


def test_eval_problems_are_grpo_step0_evaluation_problems():
    """gpt.py's evaluation problems (1000 held-out draws) are exactly grpo.py's ArithmeticTask's at --eval_size 1000."""
    for digits, ops in ((1, "+"), (2, "+-*"), (3, "*")):
        cfg = gpt.Config(data="arithmetic", digits=digits, ops=ops)
        rl_cfg = grpo.Config(task="arithmetic", init_from="init.pt", digits=digits, ops=ops, eval_size=1000)
        rt = grpo.Runtime(torch.device("cpu"), torch.float32)
        task = grpo.ArithmeticTask(rl_cfg, grpo.CharTokenizer(CHARS), rt)
        assert gpt.held_out_problems(cfg.digits, cfg.ops, 1000) == task.eval_problems


# ------------------------------------------------------------------------------------------- --data reasoning


def left_to_right(expr):
    """The value of an expression of one-digit operands, evaluated left to right, and each operation's result."""
    x = int(expr[0])
    results = []
    for op, y in zip(expr[1::2], expr[2::2]):
        x = {"+": x + int(y), "-": x - int(y), "*": x * int(y)}[op]
        results.append(x)
    return x, results


def test_reasoning_documents_hold_their_problems_out_and_write_each_kind_as_said():
    """--data reasoning with one-digit operands: a document's problem is held out exactly when asked (the crc32 rule of
    its arithmetic prompt); direct documents answer after the Q, worked ones write every step (its result, then the
    rest of the expression copied) and no Q, bridge documents (all Q documents at --bridge_frac 1, none at 0) write
    the steps and then the answer; about half the documents are worked."""
    for bridge, held_flag in ((0.0, False), (1.0, True), (0.0, True)):
        cfg = gpt.Config(data="reasoning", digits=1, ops="+-*", steps=4, bridge_frac=bridge)
        rng = random.Random(0)
        kinds = {"direct": 0, "worked": 0, "bridge": 0}
        for _ in range(400):
            context, target = gpt.reasoning_document(rng, cfg, held_flag)
            expr = context.removeprefix("Q:")[:-1]
            assert held(f"{expr}=") == held_flag and context.endswith(";") and target.endswith("\n")
            value, results = left_to_right(expr)
            assert 1 <= len(results) <= 4
            ops = [expr[i : i + 2] for i in range(1, len(expr), 2)]  # "+2", "-5", ...
            steps = [f"{x}{op}={r}" for x, op, r in zip([expr[0], *map(str, results)], ops, results)]
            written = [s + "".join(ops[i + 1 :]) for i, s in enumerate(steps)]  # each with the rest copied after it
            if not context.startswith("Q:"):
                kinds["worked"] += 1
                assert target == ";".join(written) + "\n"
            elif target.startswith("A:"):
                kinds["direct"] += 1
                assert target == f"A:{value}\n"
            else:
                kinds["bridge"] += 1
                assert target == ";".join(written) + f";A:{value}\n"
        assert 150 < kinds["worked"] < 250
        assert (kinds["bridge"] > 0) == (bridge > 0) and (kinds["direct"] > 0) == (bridge < 1)


def test_reasoning_trains_on_the_targets_of_its_own_characters(tmp_path, monkeypatch):
    """A tiny --data reasoning run: the char vocabulary is the reasoning characters, and the loss reads only targets
    (what follows each document's "Q:<expr>;" or "<expr>;")."""
    tok = gpt.CharTokenizer(gpt.REASONING_CHARS)
    cfg = gpt.Config(data="reasoning", digits=1, ops="+-", steps=3)
    (train_ids, train_mask), (val_ids, val_mask) = gpt.load_splits(cfg, tok)
    text = tok.decode(train_ids[:400].tolist())
    targets = tok.decode(train_ids[:400][train_mask[:400]].tolist())
    documents = text.split("\n")[:-1]
    assert targets.count("\n") == len(documents) and "Q" not in targets and set(text) <= set(gpt.REASONING_CHARS)
    for doc in documents:
        assert not held(doc.removeprefix("Q:").split(";")[0] + "=")  # training holds no held-out problem
    val_documents = tok.decode(val_ids[:400].tolist()).split("\n")[:-1]
    assert val_documents and all(held(doc.removeprefix("Q:").split(";")[0] + "=") for doc in val_documents)
    out = tmp_path / "run"
    run_main(
        gpt,
        monkeypatch,
        "--data",
        "reasoning",
        "--digits",
        "1",
        "--ops",
        "+-",
        "--steps",
        "3",
        *TINY,
        "--max_steps",
        "2",
        "--eval_every",
        "2",
        "--eval_iters",
        "1",
        "--out_dir",
        out,
    )
    assert (out / "ckpt.pt").exists() and json.loads((out / "config.json").read_text())["data"] == "reasoning"
