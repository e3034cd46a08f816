"""reward_model.py: the Bradley-Terry loss, HH-RLHF parsing, the orm/prm data and their labels, reading the reward
at the last real token, the checkpoint, and end-to-end runs (run folder, resume, grad accumulation,
torchrun, learning, bad input)."""

import gzip
import itertools
import json
import math
import random
import re
import zlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BPE_AVAILABLE,
    ROOT,
    metrics,
    needs_bpe,
    run_main_captured,
    run_main_in_fixture,
    run_script,
    torchrun,
)
from hypothesis import given
from hypothesis import strategies as st

import reward_model as rm

TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "96", "--max_len", "96"]
PREF = [*TINY, "--tokenizer", "char", "--batch_size", "4", "--eval_size", "9", "--eval_every", "3", "--save_every", "3"]


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_main(monkeypatch, *args):
    """reward_model.main() in this process, its output captured: (exit code, 0 when main returns; stdout; stderr
    lines)."""
    return run_main_captured(rm, monkeypatch, *args)


# ------------------------------------------------------------------------------------------ synthetic HH-RLHF data

WORDS = "the a cat dog sat ran on in big small red blue".split()


def words(rng, lo, hi):
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def marker_record(rng):
    """An HH-format pair on which preference is learnable: the chosen response contains "thanks", the rejected one
    does not (the prompt never does); a third of the dialogues have an earlier exchange."""
    prompt = f"\n\nHuman: {words(rng, 3, 7)}?"
    if rng.random() < 0.3:
        prompt += f"\n\nAssistant: {words(rng, 2, 4)}\n\nHuman: {words(rng, 2, 5)}?"
    chosen = words(rng, 3, 7).split()
    chosen.insert(rng.randrange(len(chosen) + 1), "thanks")
    rejected = words(rng, 3, 7)
    return {"chosen": f"{prompt}\n\nAssistant: {' '.join(chosen)}", "rejected": f"{prompt}\n\nAssistant: {rejected}"}


BAD_RECORDS = [
    {"chosen": "\n\nHuman: hi\n\nAssistant: yo"},  # missing field (read_jsonl keeps it: it needs only "chosen")
    {"chosen": "\n\nHuman: hi", "rejected": "\n\nHuman: hi"},  # no Assistant response
    {"chosen": "\n\nHuman: hi\n\nAssistant: same", "rejected": "\n\nHuman: hi\n\nAssistant: same "},  # identical
    {"chosen": "\n\nHuman: hi\n\nAssistant:   ", "rejected": "\n\nHuman: hi\n\nAssistant: no"},  # empty response
]


def write_pairs(path, n, seed=0, bad=()):
    rng = random.Random(seed)
    lines = [json.dumps(marker_record(rng)) for _ in range(n)] + [json.dumps(r) for r in bad] + ["not json"] * bool(bad)
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl.gz", 200, bad=BAD_RECORDS)


@pytest.fixture(scope="module")
def clean_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("data") / "clean.jsonl.gz", 100)


@pytest.fixture(scope="module")
def pref_run(tmp_path_factory, pairs_file):
    """A 6-step preference run on the marker pairs (char-level, 4 pairs per step): (out_dir, stderr lines)."""
    out = tmp_path_factory.mktemp("runs") / "pref"
    with pytest.MonkeyPatch.context() as mp:
        code, _, err = run_main(
            mp, "--data_path", pairs_file, *PREF, "--out_dir", out, "--max_steps", 6, "--device", "cpu"
        )
    assert code == 0, err[-5:]
    return out, err


# ------------------------------------------------------------------------------------------------------ the loss


def test_bradley_terry_loss_hand_values_with_margin_and_centering():
    """r_c = (2, 0), r_r = (0, 0): mean(log(1 + e^-2), log 2); margin 1 shifts the difference by 1; centering with
    c = 0.5 adds 0.5 * mean(4, 0) = 1; a per-pair margin tensor works too."""
    r_c, r_r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    plain = (math.log1p(math.exp(-2)) + math.log(2)) / 2
    assert rm.bradley_terry_loss(r_c, r_r).item() == pytest.approx(plain, rel=1e-6)
    shifted = (math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2
    assert rm.bradley_terry_loss(r_c, r_r, margin=1.0).item() == pytest.approx(shifted, rel=1e-6)
    assert rm.bradley_terry_loss(r_c, r_r, center_coef=0.5).item() == pytest.approx(plain + 1.0, rel=1e-6)
    per_pair = (math.log1p(math.exp(-1)) + math.log1p(math.exp(-2))) / 2  # differences 1 and 2
    got = rm.bradley_terry_loss(r_c, r_r, margin=torch.tensor([1.0, -2.0]), center_coef=0.25)
    assert got.item() == pytest.approx(per_pair + 0.25 * 2.0, rel=1e-6)


def test_bradley_terry_loss_is_log2_on_ties_and_its_gradient_is_the_sigmoid():
    """Equal rewards give log 2; d loss / d r_c = -sigmoid(r_r - r_c) / N and d loss / d r_r is its negative."""
    r = torch.randn(5)
    assert rm.bradley_terry_loss(r, r.clone()).item() == pytest.approx(math.log(2), rel=1e-6)
    r_c, r_r = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    rm.bradley_terry_loss(r_c, r_r).backward()
    expected = -torch.sigmoid(r_r - r_c).detach() / 5
    assert torch.allclose(r_c.grad, expected) and torch.allclose(r_r.grad, -expected)


# ------------------------------------------------------------------------------------------------------ HH-RLHF


def test_split_hh_takes_the_last_assistant_turn_as_the_response():
    """Multi-turn: the prompt keeps earlier turns and ends with the last "\\n\\nAssistant:"; none or blank -> None."""
    text = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: How are you?\n\nAssistant: Fine, thanks."
    prompt, response = rm.split_hh(text)
    assert prompt == "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: How are you?\n\nAssistant:"
    assert response == " Fine, thanks." and prompt + response == text
    assert rm.split_hh("\n\nHuman: Hi there") is None
    assert rm.split_hh("\n\nHuman: Hi\n\nAssistant: \n ") is None


def test_hh_pairs_skips_and_counts_each_bad_record():
    """Good pairs come out as (prompt, chosen, rejected); each bad record is counted under its reason."""
    good = {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: q\n\nAssistant: no"}
    differ = {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: p\n\nAssistant: no"}
    pairs, skipped = rm.hh_pairs([good, *BAD_RECORDS, differ, {"chosen": 3, "rejected": "x"}])
    assert pairs == [("\n\nHuman: q\n\nAssistant:", " yes", " no")]
    assert skipped == {"missing field": 2, "no Assistant response": 2, "chosen == rejected": 1, "prompts differ": 1}


def test_encode_pair_cuts_one_prompt_from_the_left_for_both_responses():
    """Too long: the prompt loses its start, by as much as the longer response needs, the same tokens for both rows;
    the responses stay whole; at least one prompt token always stays, and only then does a response lose its end."""
    tok = rm.CharTokenizer("abcdefxyz")
    enc = tok.encode
    assert rm.encode_pair(tok, "abcdef", "xyz", "x", 20) == (enc("abcdefxyz"), enc("abcdefx"), 6)
    assert rm.encode_pair(tok, "abcdef", "xyz", "x", 5) == (enc("efxyz"), enc("efx"), 2)  # per row: "bcdefx"
    assert rm.encode_pair(tok, "abcdef", "x", "xyz", 3) == (enc("fx"), enc("fxy"), 1)


def test_truncate_pair_hand_example():
    """The prompt keeps what fits beside the longer response (6 - 4 = 2 tokens), for both responses."""
    assert rm.truncate_pair([1, 2, 3, 4, 5], [10, 11], [20, 21, 22, 23], 6) == ([4, 5], [10, 11], [20, 21, 22, 23])


# ---------------------------------------------------------------------------------------------------- orm and prm


def parse(step):
    """ "a op b=y" (a possibly negative) as (a, value of a op b, y)."""
    expression, y = step.split("=")
    i = next(i for i in range(1, len(expression)) if expression[i] in "+-*")
    a = int(expression[:i])
    op = expression[i]
    b = int(expression[i + 1 :])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, value, int(y)


def test_orm_examples_are_labelled_by_whether_the_answer_is_right():
    """Label 1 exactly when the answer is the expression's value; about --error_frac of the answers are wrong."""
    rng, labels, cfg = random.Random(0), [], rm.Config(task="orm", digits=2, ops="+-*", error_frac=0.5)
    for _ in range(2000):
        prompt, answer, label = rm.synthetic_example(rng, cfg)
        assert prompt.endswith("=") and answer.endswith("\n") and set(prompt + answer) <= set(rm.ARITHMETIC_CHARS)
        _, truth, given = parse(prompt + answer)
        assert label == int(given == truth)
        labels.append(label)
    assert 0.45 < sum(labels) / len(labels) < 0.55


@pytest.mark.parametrize("steps", [2, 3, 4])
def test_prm_chains_are_labelled_right_up_to_the_first_wrong_step(steps):
    """A chain is the solution of a K-step problem, the prompt before its first step; each step applies the prompt's
    next operation to the previous step's written result; at most one result is wrong; as Lightman et al. label, a
    step up to the first wrong one is labelled 1 (right) or 0 (wrong), and every step after it AFTER_ERROR (none)."""
    rng, with_error = random.Random(0), 0
    cfg = rm.Config(task="prm", digits=2, ops="+-*", steps=steps, error_frac=0.5)
    wrong_at = set()
    for _ in range(2000):
        chain = rm.synthetic_example(rng, cfg)
        prompt, first = chain[0][0].split("=", 1)
        texts = [first] + [text for text, _ in chain[1:]]
        assert len(chain) == steps and prompt.startswith(texts[0].split("=")[0])  # the prompt's first operation
        parsed = [parse(text) for text in texts]
        right = [truth == given for _, truth, given in parsed]
        assert sum(not r for r in right) <= 1
        expected = [int(right[i]) if all(right[:i]) else rm.AFTER_ERROR for i in range(steps)]
        assert [label for _, label in chain] == expected
        assert all(parsed[i + 1][0] == parsed[i][2] for i in range(steps - 1))  # starts from the last result
        operations = "".join(re.sub(r"^-?\d+", "", t.split("=")[0]) for t in texts)  # each step's "op y"
        assert operations == re.sub(r"^\d+", "", prompt)
        with_error += not all(right)
        wrong_at.update(i for i, r in enumerate(right) if not r)
    assert 0.45 < with_error / 2000 < 0.55 and wrong_at == set(range(steps))  # any step can be the wrong one


def test_prm_labels_sit_on_the_newline_after_each_step():
    """'1*2*2-1=1*2=2\\n2*2=4\\n4-1=4\\n', the prompt then one step a line as gpt.py's arithmetic data (so its char
    vocabulary covers it): labels at the three newlines, -1 everywhere else; with GPT-2 BPE too (no end token: a
    policy's solution ends at its last newline)."""
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    steps = (("1*2*2-1=1*2=2", 1), ("2*2=4", 1), ("4-1=4", 0))
    ids, labels = rm.encode("prm", tok, steps, 32)
    assert tok.decode(ids) == "1*2*2-1=1*2=2\n2*2=4\n4-1=4\n"
    assert {i: y for i, y in enumerate(labels) if y >= 0} == {13: 1, 19: 1, 25: 0}
    if BPE_AVAILABLE:
        bpe = rm.BPETokenizer()
        ids, labels = rm.encode("prm", bpe, steps, 32)
        assert bpe.decode(ids) == "1*2*2-1=1*2=2\n2*2=4\n4-1=4\n" and labels[-1] == 0
        assert [ids[i] for i, y in enumerate(labels) if y >= 0] == bpe.encode("\n") * 3


def test_orm_labels_cover_the_answer_tokens_only():
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    ids, labels = rm.encode("orm", tok, ("12+3=", "15\n", 1), 32)
    assert tok.decode(ids) == "12+3=15\n" and labels == [-1] * 5 + [1] * 3


def is_held_out(prompt):
    """SPEC section 8's rule, written here again so that the scripts' copies are checked against it."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def problem(text):
    """The problem "a op b=" of "a op b=y" (a prm chain's: its first step's)."""
    return text.split("=")[0] + "="


@pytest.mark.parametrize("task", ["orm", "prm"])
def test_synthetic_data_is_split_by_problem_so_no_training_example_is_held_out(task):
    """Issue #29: no training example is of a held-out problem (a prm chain counts as its first step's), every
    held-out example is. Splitting by text instead (the old rule) left many problems without a right training
    answer: at --digits 1 the share of right orm answers in training fell from 1 - error_frac = 0.5 to about 0.2."""
    ops = "+" if task == "prm" else "+-*"
    steps = 2 if task == "prm" else 1
    cfg = rm.Config(task=task, digits=1, steps=steps, ops=ops, n_train=3000, n_val=1000, error_frac=0.5)
    train, val, _ = rm.synthetic_data(cfg)
    if task == "orm":
        train_problems = [prompt for prompt, _, _ in train]
        val_problems = [prompt for prompt, _, _ in val]
        assert 0.45 < sum(label for _, _, label in train) / len(train) < 0.55
    else:
        train_problems = [problem(chain[0][0]) for chain in train]
        val_problems = [problem(chain[0][0]) for chain in val]
    assert len(train) == 3000 and len(val) == 1000
    assert not any(is_held_out(p) for p in train_problems) and all(is_held_out(p) for p in val_problems)
    assert [rm.step_problems(task, example)[0] for example in val] == val_problems
    assert all(rm.held_out(p) == is_held_out(p) for p in train_problems[:300] + val_problems[:300])


def test_draw_problem_draws_held_out_problems_or_others_only():
    rng = random.Random(0)
    assert all(is_held_out(rm.draw_problem(rng, 2, "+-*", True)[0]) for _ in range(300))
    assert not any(is_held_out(rm.draw_problem(rng, 2, "+-*", False)[0]) for _ in range(300))


def test_roc_auc_hand_values():
    """Right answers score 0.9 and 0.5, wrong ones 0.1, 0.5 and -1: of the 6 (right, wrong) pairs the right one is
    higher in 5, tied in 1, so the AUC is 5.5 / 6. One class alone has no pair: nan."""
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.5, -1.0])
    labels = torch.tensor([1, 0, 1, 0, 0])
    assert rm.roc_auc(rewards, labels) == pytest.approx(5.5 / 6, abs=1e-7)
    assert rm.roc_auc(-rewards, labels) == pytest.approx(0.5 / 6, abs=1e-7)
    assert rm.roc_auc(torch.ones(5), labels) == 0.5 and rm.roc_auc(rewards[labels == 1], labels[labels == 1]) != 0.5
    assert math.isnan(rm.roc_auc(rewards, torch.ones(5)))


@given(st.lists(st.tuples(st.integers(-5, 5), st.booleans()), min_size=2, max_size=40))
def test_roc_auc_is_the_share_of_pairs_ranked_right(rows):
    """Against the definition, pair by pair in Python; AUC(-r) = 1 - AUC(r)."""
    rewards = torch.tensor([float(r) for r, _ in rows])
    labels = torch.tensor([int(y) for _, y in rows])
    right = [r for r, y in rows if y]
    wrong = [r for r, y in rows if not y]
    if not right or not wrong:
        return
    expected = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))
    assert rm.roc_auc(rewards, labels) == pytest.approx(expected, abs=1e-6)
    assert rm.roc_auc(-rewards, labels) == pytest.approx(1 - expected, abs=1e-6)


def test_per_problem_auc_hand_values():
    """Problem a: right 0.9, wrong 0.5 and 0.95: AUC 1/2. Problem b: only right answers, no pair: skipped. Problem c:
    right 0.1 tied with a wrong 0.1, and a wrong -0.2: AUC (1/2 + 1) / 2 = 3/4. The mean over a and c: 5/8, on 2."""
    rewards = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.7, 0.1, 0.1, -0.2])
    labels = torch.tensor([1, 0, 0, 1, 1, 1, 0, 0])
    problems = ["a", "a", "a", "b", "b", "c", "c", "c"]
    auc, n_problems = rm.per_problem_auc(rewards, labels, problems)
    assert n_problems == 2 and auc == pytest.approx(5 / 8, abs=1e-7)
    auc, n_problems = rm.per_problem_auc(rewards, torch.ones(8, dtype=torch.long), problems)  # no wrong answer
    assert math.isnan(auc) and n_problems == 0


def test_a_perfect_ranking_within_each_problem_gives_1_while_the_pooled_auc_is_below_1():
    """Problem a (easy) scores its right answer 5 and its wrong one 4; problem b (hard) 1 and 0. Within each problem
    the right answer is on top, but pooled the wrong answer of a (4) outscores the right one of b (1): 3/4."""
    rewards = torch.tensor([5.0, 4.0, 1.0, 0.0])
    labels = torch.tensor([1, 0, 1, 0])
    assert rm.roc_auc(rewards, labels) == 0.75
    assert rm.per_problem_auc(rewards, labels, ["a", "a", "b", "b"]) == (1.0, 2)


@given(st.lists(st.tuples(st.integers(-3, 3), st.booleans(), st.integers(0, 3)), min_size=1, max_size=30))
def test_per_problem_auc_is_the_mean_of_each_problems_auc(rows):
    """Against roc_auc on each problem's rows, picked in Python; one problem alone gives the pooled AUC."""
    rewards = torch.tensor([float(r) for r, _, _ in rows])
    labels = torch.tensor([int(y) for _, y, _ in rows])
    problems = [p for _, _, p in rows]
    aucs = []
    for p in sorted(set(problems)):
        index = [i for i, q in enumerate(problems) if q == p]
        if 0 < labels[index].sum() < len(index):
            aucs.append(rm.roc_auc(rewards[index], labels[index]))
    auc, n_problems = rm.per_problem_auc(rewards, labels, problems)
    assert n_problems == len(aucs)
    assert math.isnan(auc) if not aucs else auc == pytest.approx(sum(aucs) / len(aucs), abs=1e-9)
    if 0 < labels.sum() < len(rows):
        assert rm.per_problem_auc(rewards, labels, [0] * len(rows)) == (rm.roc_auc(rewards, labels), 1)


def test_held_out_metrics_log_the_per_problem_auc_beside_the_pooled_one():
    """The orm evaluation on a stand-in model whose reward is the last token's id: two problems ranked perfectly
    within (so eval/auc_per_problem 1.0 on eval/auc_problems 2) but not pooled (eval/auc 4/6), and a problem with
    only right answers that the per-problem mean skips."""

    class LastToken(torch.nn.Module):
        def forward(self, idx):  # (B, T) -> (B, T) scores: each position's token id
            return idx.float()

    rows = [([1, 5], [-1, 1]), ([1, 4], [-1, 0]), ([2, 1], [-1, 1]), ([2, 0], [-1, 0]), ([3, 2], [-1, 1])]
    problems = ["a", "a", "b", "b", "c"]
    cfg = rm.Config(task="orm", batch_size=2)
    rt = rm.Runtime(torch.device("cpu"), torch.float32)
    metrics = rm.held_out_metrics(LastToken(), rows, cfg, rt, problems)
    assert metrics["eval/auc_per_problem"] == 1.0 and metrics["eval/auc_problems"] == 2
    assert metrics["eval/auc"] == pytest.approx(4 / 6)  # right {5, 1, 2} vs wrong {4, 0}: 1 and 2 lose to 4


def test_samples_from_labels_equal_the_exact_answer_checker(tmp_path, monkeypatch):
    """--samples_from: the policy's answers (here a stand-in generate writing the right answer, the right answer then
    more text, no newline, a leading zero or sign, an empty line, the answer plus one) are cut after their first
    newline and labelled as grpo.py's arithmetic_reward labels the same text: 1.0 exactly for the right number
    then a newline. Training problems are never held out, held-out ones always, --samples_per_problem answers each
    (the last problem of a split may be cut short)."""
    from conftest import char_checkpoint

    import grpo

    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)

    def fake_generate(model, prompts, max_new_tokens, generator=None, **kwargs):
        rows = []
        for i, ids in enumerate(prompts):
            _, value, _ = parse(tok.decode(ids) + "0")
            right = f"{value}\n"
            candidates = [right, right + "12", f"{value}", "0" + right, "-" + right, "\n", f"{value + 1}\n"]
            rows.append(tok.encode((candidates[i % len(candidates)] + "=" * max_new_tokens)[:max_new_tokens]))
        return torch.tensor(rows), torch.ones(len(rows), max_new_tokens)

    monkeypatch.setattr(rm, "generate", fake_generate)
    policy = char_checkpoint(tmp_path / "policy.pt", rm.ARITHMETIC_CHARS, block_size=32)
    cfg = rm.Config(task="orm", samples_from=str(policy), digits=2, ops="+-*", n_train=600, n_val=200)
    train, val, _ = rm.sampled_data(cfg, tok, rm.Runtime(torch.device("cpu"), torch.float32))
    assert len(train) == 600 and len(val) == 200
    for prompt, answer, label in train + val:
        _, value, _ = parse(prompt + "0")
        assert label == grpo.arithmetic_reward(answer, str(value)) and answer.count("\n") <= 1
        assert answer.endswith("\n") or len(answer) == 2 * cfg.digits + 2
    assert 0.1 < sum(label for _, _, label in train) / len(train) < 0.5  # both labels occur
    assert not any(is_held_out(prompt) for prompt, _, _ in train) and all(is_held_out(prompt) for prompt, _, _ in val)
    for split in (train, val):  # a problem's answers side by side, 8 of them (16 if drawn twice), but the last's
        prompts = [prompt for prompt, _, _ in split]
        runs = [len(list(run)) for _, run in itertools.groupby(prompts)]
        assert all(n % 8 == 0 for n in runs[:-1]) and len(set(prompts)) == len(runs)


def test_samples_from_prm_labels_equal_the_step_checker_and_orm_sees_the_same_solutions(tmp_path, monkeypatch):
    """--task prm --samples_from --steps 2: a stand-in policy writes right solutions, a wrong first step carried on, a
    right final answer reached through a wrong step, a wrong second step, and a solution cut before its last
    newline. Each step's label is grpo.py's step_correct of the solution (a last line without its newline: 0), the
    last label is 1 only for a right solution, and --task orm at the same seed learns the same solutions, as many,
    labelled by their final answer."""
    from conftest import char_checkpoint

    import grpo

    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)

    def fake_generate(model, prompts, max_new_tokens, generator=None, **kwargs):
        rows = []
        for i, ids in enumerate(prompts):
            prompt = tok.decode(ids)
            x, (op1, y1), (op2, y2) = int(re.match(r"\d+", prompt).group()), *re.findall(r"([-+*])(\d+)", prompt)
            r1 = {"+": x + int(y1), "-": x - int(y1), "*": x * int(y1)}[op1]
            r2 = {"+": r1 + int(y2), "-": r1 - int(y2), "*": r1 * int(y2)}[op2]
            wrong = {"+": r1 + 1 + int(y2), "-": r1 + 1 - int(y2), "*": (r1 + 1) * int(y2)}[op2]
            candidates = [
                f"{x}{op1}{y1}={r1}\n{r1}{op2}{y2}={r2}\n",  # right
                f"{x}{op1}{y1}={r1 + 1}\n{r1 + 1}{op2}{y2}={wrong}\n",  # a wrong first step, carried on
                f"{x}{op1}{y1}={r1 + 1}\n{r1 + 1}{op2}{y2}={r2}\n",  # the right answer through a wrong step
                f"{x}{op1}{y1}={r1}\n{r1}{op2}{y2}={r2 + 1}\n",  # a wrong second step
                f"{x}{op1}{y1}={r1}\n{r1}{op2}{y2}={r2}",  # cut before its last newline
            ]
            text = candidates[i % len(candidates)]
            rows.append(tok.encode((text + "=" * max_new_tokens)[:max_new_tokens]))
        return torch.tensor(rows), torch.ones(len(rows), max_new_tokens)

    monkeypatch.setattr(rm, "generate", fake_generate)
    policy = char_checkpoint(tmp_path / "policy.pt", rm.ARITHMETIC_CHARS, block_size=64)
    rt = rm.Runtime(torch.device("cpu"), torch.float32)
    common = dict(samples_from=str(policy), digits=2, ops="+-*", steps=2, n_train=300, n_val=100, seed=3)
    prm_train, prm_val, _ = rm.sampled_data(rm.Config(task="prm", **common), tok, rt)
    orm_train, orm_val, _ = rm.sampled_data(rm.Config(task="orm", **common), tok, rt)
    assert len(prm_train) == len(orm_train) == 300 and len(prm_val) == len(orm_val) == 100
    kinds = Counter()
    for chain, (prompt, solution, outcome) in zip(prm_train + prm_val, orm_train + orm_val):
        assert chain[0][0].startswith(prompt) and "".join(text + "\n" for text, _ in chain) == prompt + solution + (
            "" if solution.endswith("\n") else "\n"
        )
        checked = grpo.step_correct(prompt, solution)
        checked[-1] = checked[-1] and solution.endswith("\n")
        labels = [label for _, label in chain]
        first_wrong = checked.index(False) + 1 if False in checked else len(checked)  # labelled up to it, none after
        assert labels == [int(c) for c in checked[:first_wrong]] + [rm.AFTER_ERROR] * (len(checked) - first_wrong)
        value = int(re.match(r"\d+", prompt).group())
        for op, y in re.findall(r"([-+*])(\d+)", prompt):  # left to right
            value = {"+": value + int(y), "-": value - int(y), "*": value * int(y)}[op]
        assert outcome == int(solution.endswith("\n") and solution.split("=")[-1] == f"{value}\n")
        assert labels[-1] <= outcome  # every step right: the final answer is right
        kinds[tuple(labels), outcome] += 1
    after = rm.AFTER_ERROR
    assert kinds[(1, 1), 1] and kinds[(0, after), 0] and kinds[(0, after), 1] and kinds[(1, 0), 0]  # each kind occurs
    assert not any(is_held_out(prompt) for prompt, _, _ in orm_train) and all(is_held_out(p) for p, _, _ in orm_val)


# ------------------------------------------------------------------------------------------- the model and reward


def tiny_reward_model(vocab_size=20, block_size=16):
    torch.manual_seed(0)
    return rm.RewardModel(rm.GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=16))


def test_reward_is_the_last_real_token_score_whatever_the_padding():
    """A row's reward, right-padded in a batch with longer rows, equals its last score when run alone."""
    model = tiny_reward_model().eval()
    seqs = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [3]]
    idx, lengths = rm.pad_right(seqs)
    batched = rm.last_token_rewards(model(idx), lengths)
    alone = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
    assert idx.shape == (3, 6) and lengths.tolist() == [3, 6, 1]
    assert torch.allclose(batched, alone, atol=1e-6)
    masked = rm.last_token_rewards(model(idx, attention_mask=torch.arange(6) < lengths[:, None]), lengths)
    assert torch.allclose(masked, alone, atol=1e-6)


def test_score_texts_truncates_from_the_left_and_batches():
    """score() gives each text's last-token reward; too long texts keep their last max_len tokens."""
    tok = rm.CharTokenizer("abcdefgh")
    model = tiny_reward_model(vocab_size=8).eval()
    texts = ["abc", "hgfedcbahgfedcbahg", "d"]
    got = rm.score(model, tok, texts, "cpu", max_len=10, batch_size=2)
    alone = [model(torch.tensor([tok.encode(t)[-10:]]))[0, -1].item() for t in texts]
    assert got == pytest.approx(alone, abs=1e-6)


@needs_bpe
def test_score_appends_endoftext_with_gpt2_bpe():
    """With GPT-2 BPE the reward is read at <|endoftext|> after the text, as in training."""
    tok = rm.BPETokenizer()
    model = tiny_reward_model(vocab_size=tok.vocab_size, block_size=32).eval()
    text = "\n\nHuman: Hi\n\nAssistant: Hello"
    (got,) = rm.score(model, tok, [text], "cpu")
    prompt, response = rm.split_hh(text)
    ids, _, n_prompt = rm.encode_pair(tok, prompt, response, response, 32)
    assert ids[-1] == tok.eot_id and ids[:-1] == tok.encode(text)
    assert n_prompt == len(tok.encode("\n\nHuman: Hi\n\nAssistant:"))
    assert got == pytest.approx(model(torch.tensor([ids]))[0, -1].item(), abs=1e-6)


def test_batch_indices_read_each_epoch_once_in_disjoint_rank_slices():
    """Ranks get disjoint slices of one global batch; over an epoch every example comes once; the global batch of a
    step does not depend on how it is split over ranks."""
    n, seen = 12, []
    for step in range(3):
        slices = [rm.batch_indices(n, step, 2, rank, 2, seed=0) for rank in range(2)]
        assert sum(slices, []) == rm.batch_indices(n, step, 4, 0, 1, seed=0)
        seen += sum(slices, [])
    assert sorted(seen) == list(range(n))
    assert rm.batch_indices(n, 3, 4, 0, 1, seed=0) != rm.batch_indices(n, 0, 4, 0, 1, seed=0)  # a new order


def test_load_reward_model_refuses_a_policy_checkpoint(tmp_path, capsys):
    """A gpt.py-style checkpoint (no reward head) is a clear error: exit 2, one line naming the problem."""
    model = rm.GPT(rm.GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=8))
    torch.save(
        {"model": model.state_dict(), "model_config": vars(model.config), "tokenizer": "gpt2"}, tmp_path / "p.pt"
    )
    with pytest.raises(SystemExit) as e:
        rm.load_reward_model(str(tmp_path / "p.pt"))
    assert e.value.code == 2 and "no reward head" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_preference_run_writes_the_run_folder_and_a_loadable_checkpoint(pref_run):
    """SPEC section 4's files; bad records counted in one summary line; the body loads as a plain GPT policy and
    load_reward_model gives the same rewards as training's forward."""
    out, err = pref_run
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt"):
        assert (out / name).is_file(), name
    summary = [line for line in err if "pair(s)" in line]
    assert len(summary) == 1, err
    for part in ("skipped 4 pair(s)", "1 chosen == rejected", "1 missing field", "2 no Assistant response"):
        assert part in summary[0]
    assert any("skipped 1 malformed line" in line for line in err)  # the line that is not JSON
    n_train, n_val = map(int, re.search(r"kept (\d+) train and (\d+) held-out", summary[0]).groups())
    results = json.loads((out / "final_results.json").read_text())
    assert n_train + n_val == 200 and results["train_examples"] == n_train and results["eval_examples"] == 9
    assert 0 <= results["reward_acc"] <= 1
    rows = metrics(out)
    keys = {"train/loss", "train/reward_acc", "train/margin", "train/chosen_mean", "train/rejected_mean", "train/epoch"}
    assert all(keys <= set(r) for r in rows if "train/loss" in r)
    assert {r["step"] for r in rows if "eval/reward_acc" in r} == {0, 3, 6}
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["reward_task"] == "preference" and set(ckpt["reward_head"]) == {"weight", "bias"}
    policy = rm.GPT(rm.GPTConfig(**ckpt["model_config"]))
    policy.load_state_dict(ckpt["model"])  # plain GPT keys: any script takes it as --init_from
    model, spec, task = rm.load_reward_model(str(out / "ckpt.pt"))
    assert task == "preference" and spec["type"] == "char" and not model.training
    assert results["margin"] == pytest.approx(eval_margin(model, rm.get_tokenizer(spec), out), abs=1e-4)


def eval_margin(model, tok, out):
    """Mean r_c - r_r over the held-out pairs of the run, recomputed with score() on the texts of training's rows (a
    pair too long for --max_len loses the same prompt characters in both)."""
    cfg = rm.Config(**json.loads((out / "config.json").read_text()))
    _, val, _ = rm.load_preference_data(cfg, rm.Runtime(torch.device("cpu"), torch.float32))
    rows = [rm.encode_pair(tok, *pair, cfg.max_len) for pair in val[: cfg.eval_size]]
    r_c = rm.score(model, tok, [tok.decode(c) for c, _, _ in rows], "cpu", cfg.max_len)
    r_r = rm.score(model, tok, [tok.decode(r) for _, r, _ in rows], "cpu", cfg.max_len)
    return sum(c - r for c, r in zip(r_c, r_r)) / len(rows)


@pytest.mark.slow
def test_init_from_a_policy_checkpoint_keeps_its_body_and_tokenizer(tmp_path, clean_file, pref_run, monkeypatch):
    """--init_from a gpt.py-style checkpoint (no head): the run starts from its weights and vocabulary, adds a new
    head, and writes a reward model with the same architecture and tokenizer."""
    ckpt = torch.load(pref_run[0] / "ckpt.pt", weights_only=True)
    policy = {k: ckpt[k] for k in ("model", "model_config", "tokenizer")}
    torch.save(policy, tmp_path / "policy.pt")
    out = tmp_path / "run"
    args = [
        "--init_from",
        tmp_path / "policy.pt",
        "--max_steps",
        1,
        "--lr",
        1e-9,
        "--warmup_steps",
        0,
        "--out_dir",
        out,
    ]
    code, _, err = run_main(monkeypatch, "--data_path", clean_file, *args, "--device", "cpu")
    assert code == 0, err[-5:]
    new = torch.load(out / "ckpt.pt", weights_only=True)
    assert new["tokenizer"] == policy["tokenizer"] and new["model_config"] == policy["model_config"]
    assert all(torch.allclose(new["model"][k], policy["model"][k], atol=1e-6) for k in policy["model"])
    assert not torch.equal(new["reward_head"]["weight"], ckpt["reward_head"]["weight"])  # a new head


@pytest.mark.slow
def test_resume_after_sigterm_reproduces_the_uninterrupted_metrics(tmp_path, pairs_file, pref_run, monkeypatch):
    """Stopped by SIGTERM after 3 of 6 steps and resumed in a new process with its own settings: the same
    metrics.jsonl and weights as the uninterrupted run (model, optimizer, data order and schedule all continue)."""
    full, part = pref_run[0], tmp_path / "part"
    monkeypatch.setenv("FAULT_SIGTERM_AT_STEP", "3")
    args = ["--data_path", pairs_file, *PREF, "--max_steps", 6, "--out_dir", part, "--device", "cpu"]
    code, _, err = run_main(monkeypatch, *args)
    assert code == 143 and any("Continue with: --resume" in line for line in err), err[-3:]
    assert torch.load(part / "ckpt.pt", weights_only=True)["step"] == 3
    monkeypatch.delenv("FAULT_SIGTERM_AT_STEP")
    assert_ok(run_script("reward_model.py", "--resume", "--out_dir", part))
    assert metrics(part) == metrics(full)
    a, b = (torch.load(run / "ckpt.pt", weights_only=True) for run in (full, part))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["reward_head"][k], b["reward_head"][k]) for k in a["reward_head"])


@pytest.mark.slow
def test_preference_rows_of_a_pair_share_their_prompt_tokens(tmp_path, clean_file, monkeypatch):
    """At --max_len 40 most dialogues lose prompt tokens: the chosen and rejected rows of every training and held-out
    pair (the rows that go to pad_right) still carry the same prompt, also where the responses differ in length.
    The prompt is what runs through the last ':' (of "Assistant:"; the responses have none)."""
    toks, batches = [], []
    make_tokenizer, pad_right = rm.make_tokenizer, rm.pad_right
    monkeypatch.setattr(rm, "make_tokenizer", lambda *a: toks.append(make_tokenizer(*a)) or toks[-1])
    monkeypatch.setattr(rm, "pad_right", lambda seqs, *a, **kw: batches.append(seqs) or pad_right(seqs, *a, **kw))
    args = ["--max_len", 40, "--max_steps", 1, "--out_dir", tmp_path / "run", "--device", "cpu"]
    code, _, err = run_main(monkeypatch, "--data_path", clean_file, *PREF, *args)
    assert code == 0, err[-5:]
    colon = toks[0].encode(":")[0]

    def prompt_end(row):
        return max(i for i, t in enumerate(row) if t == colon) + 1

    cut_and_unequal = False
    for seqs in batches:
        half = len(seqs) // 2
        for c, r in zip(seqs[:half], seqs[half:]):
            assert c[: prompt_end(c)] == r[: prompt_end(r)] and max(len(c), len(r)) <= 40
            cut_and_unequal |= max(len(c), len(r)) == 40 and len(c) != len(r)
    assert cut_and_unequal  # the case that matters did occur


@pytest.mark.slow
def test_resume_restores_the_float16_loss_scale(tmp_path, clean_file, monkeypatch):
    """--dtype float16 trains with a GradScaler: its state is saved in ckpt.pt and a resumed run continues from it
    (here a scale of 1024, as after overflows), not from the initial 65536."""
    out = tmp_path / "run"
    args = ["--dtype", "float16", "--max_steps", 2, "--out_dir", out, "--device", "cpu"]
    code, _, err = run_main(monkeypatch, "--data_path", clean_file, *PREF, *args)
    assert code == 0, err[-5:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["scaler"]["scale"] > 1024.0  # 65536, halved at each step whose gradients overflowed
    ckpt["scaler"]["scale"] = 1024.0
    torch.save(ckpt, out / "ckpt.pt")
    code, _, err = run_main(monkeypatch, "--resume", "--out_dir", out, "--max_steps", 3)
    assert code == 0, err[-5:]
    assert torch.load(out / "ckpt.pt", weights_only=True)["scaler"]["scale"] == 1024.0


def assert_same_metrics(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5) for k in x), (x, y)


@pytest.mark.slow
def test_gradient_accumulation_gives_the_same_steps(tmp_path, pairs_file, pref_run, monkeypatch):
    """2 micro-batches of 2 pairs take the same optimizer steps as 1 batch of 4: the loss is normalised globally."""
    out = tmp_path / "accum"
    args = ["--batch_size", "2", "--grad_accum", "2", "--max_steps", "6", "--out_dir", out, "--device", "cpu"]
    code, _, err = run_main(monkeypatch, "--data_path", pairs_file, *PREF, *args)
    assert code == 0, err[-5:]
    assert_same_metrics(metrics(out), metrics(pref_run[0]))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_gloo_fsdp_run_matches_one_process(tmp_path, pairs_file, pref_run):
    """torchrun with 2 CPU ranks of 2 pairs each takes the same steps as one process with 4 pairs, and saves one
    full checkpoint with both ranks' RNG states. FSDP, the reward model's own wrapping (DDP is gpt.py's wrap_model,
    tested there); 9 held-out pairs on 2 ranks make one rank run a weightless batch at evaluation."""
    out = tmp_path / "fsdp"
    args = ["--device", "cpu", "--parallel", "fsdp", "--batch_size", "2", "--max_steps", "6", "--out_dir", out]
    proc = torchrun(ROOT / "reward_model.py", 2, "--data_path", pairs_file, *PREF, *args)
    assert_ok(proc)
    assert_same_metrics(metrics(out), metrics(pref_run[0]))
    assert len(torch.load(out / "ckpt.pt", weights_only=True)["rng_ranks"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("task", ["orm", "prm"])
def test_orm_and_prm_runs(tmp_path, monkeypatch, task):
    """A few steps of each synthetic task: held-out metrics in range, the checkpoint names its task."""
    out = tmp_path / task
    args = [*TINY, "--n_train", "400", "--n_val", "40", "--max_steps", "4", "--eval_every", "2", "--out_dir", out]
    steps = ["--steps", "2"] if task == "prm" else []  # a prm judges the steps of a solution of several
    code, _, err = run_main(monkeypatch, "--task", task, *args, *steps, "--device", "cpu")
    assert code == 0, err[-5:]
    results = json.loads((out / "final_results.json").read_text())
    keys = ("step_accuracy", "auc")
    if task == "orm":
        keys = ("label_acc", "reward_correct", "reward_wrong", "accuracy_correct", "accuracy_wrong", "auc")
    assert all(k in results for k in keys) and 0 <= results[keys[0]] <= 1 and results["eval_examples"] == 40
    assert 0 < results["eval_problems"] <= 40 and 0 <= results["auc"] <= 1
    assert torch.load(out / "ckpt.pt", weights_only=True)["reward_task"] == task
    # issue #29: from scratch the run says in one line that it cannot do arithmetic, names the warm start, goes on
    hints = [line for line in err if "from scratch cannot do arithmetic" in line]
    assert len(hints) == 1 and "gpt.py --data arithmetic" in hints[0]


@pytest.fixture(scope="module")
def arithmetic_sft(tmp_path_factory):
    """A tiny `gpt.py --data arithmetic --tokenizer char` SFT checkpoint: a char vocabulary of the 15 characters of
    gpt.py's arithmetic problems (no ' ' or ',')."""
    out = tmp_path_factory.mktemp("sft") / "arith"
    model = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "64", "--batch_size", "4"]
    run = ["--max_steps", "2", "--eval_every", "2", "--eval_iters", "1", "--sample_tokens", "4", "--device", "cpu"]
    import gpt

    run_main_in_fixture(gpt, "--data", "arithmetic", "--tokenizer", "char", *model, *run, "--out_dir", out)
    return out / "ckpt.pt"


@pytest.mark.slow
@pytest.mark.plots
@pytest.mark.parametrize("task", ["orm", "prm"])
def test_orm_and_prm_train_from_a_gpt_py_char_arithmetic_checkpoint(tmp_path, monkeypatch, arithmetic_sft, task):
    """Issue #21: --init_from a gpt.py arithmetic SFT model with its char tokenizer trains (the data stays inside its
    vocabulary) and writes the run folder; the reward model keeps the SFT model's tokenizer and shape, so it scores
    that policy's text. A new orm/prm model takes the same vocabulary."""
    import gpt

    out = tmp_path / task
    args = ["--task", task, "--init_from", arithmetic_sft, "--n_train", 200, "--n_val", 20, "--max_steps", 2]
    args += ["--steps", 2] if task == "prm" else []
    code, _, err = run_main(monkeypatch, *args, "--batch_size", 4, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    assert not any("cannot do arithmetic" in line for line in err)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt"):
        assert (out / name).is_file(), name
    sft, new = (torch.load(path, weights_only=True) for path in (arithmetic_sft, out / "ckpt.pt"))
    assert new["tokenizer"] == sft["tokenizer"] == {"type": "char", "chars": gpt.ARITHMETIC_CHARS}
    assert new["model_config"] == sft["model_config"] and new["reward_task"] == task
    assert rm.ARITHMETIC_CHARS == gpt.ARITHMETIC_CHARS


@pytest.mark.slow
def test_samples_from_trains_a_verifier_of_the_policy_on_its_own_answers(tmp_path, monkeypatch, arithmetic_sft):
    """--samples_from CKPT: the reward model starts from that policy (no warm-start hint), trains on its sampled
    answers and reports accuracy on right and on wrong answers and the AUC on held-out problems' answers, 8 answers
    a problem, and how many distinct problems they hold; an orm-only flag refused elsewhere."""
    out = tmp_path / "verifier"
    args = ["--task", "orm", "--samples_from", arithmetic_sft, "--n_train", 96, "--n_val", 80, "--max_steps", 2]
    code, stdout, err = run_main(monkeypatch, *args, "--batch_size", 8, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    assert not any("cannot do arithmetic" in line for line in err)
    results = json.loads((out / "final_results.json").read_text())
    assert results["eval_examples"] == 80 and results["train_examples"] == 96
    assert 1 <= results["eval_problems"] <= 10 and f"({results['eval_problems']} distinct problems)" in stdout
    assert all(k in results for k in ("accuracy_correct", "accuracy_wrong", "auc", "reward_correct"))
    # the AUC within each problem, on the problems with both right and wrong answers (none: nan)
    assert 0 <= results["auc_problems"] <= results["eval_problems"]
    assert math.isnan(results["auc_per_problem"]) == (results["auc_problems"] == 0)
    evals = [row for row in metrics(out) if "eval/auc" in row]
    assert all("eval/auc_per_problem" in row and "eval/auc_problems" in row for row in evals)
    sft, new = (torch.load(path, weights_only=True) for path in (arithmetic_sft, out / "ckpt.pt"))
    assert new["model_config"] == sft["model_config"] and new["config"]["init_from"] == str(arithmetic_sft)
    code, _, err = run_main(monkeypatch, "--samples_from", arithmetic_sft, "--out_dir", tmp_path / "x")
    assert code == 2 and err == ["error: --samples_from is for --task orm or prm"]


@pytest.mark.slow
@pytest.mark.learning
def test_preference_model_learns_the_marker_to_over_90_percent_held_out(tmp_path, monkeypatch):
    """Chosen responses contain "thanks": a tiny char-level model from scratch ranks > 90% of held-out pairs right
    within 80 steps."""
    path = write_pairs(tmp_path / "pairs.jsonl.gz", 2000, seed=1)
    out = tmp_path / "run"
    args = [*TINY, "--tokenizer", "char", "--max_steps", "80", "--eval_every", "40", "--lr", "3e-3", "--device", "cpu"]
    code, _, err = run_main(monkeypatch, "--data_path", path, *args, "--warmup_steps", "10", "--out_dir", out)
    assert code == 0, err[-5:]
    results = json.loads((out / "final_results.json").read_text())
    assert results["eval_examples"] == 100 and results["reward_acc"] > 0.9 and results["margin"] > 1, results


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--task", "ranking"], "--task"),
        (["--max_len", "200"], "block_size"),
        (["--ops", "+/"], "--ops"),
        (["--pos_weight", "2"], "--pos_weight is for --task orm or prm"),
        (["--pos_weight", "0"], "--pos_weight must be positive"),
        (["--pos_weight", "-1"], "--pos_weight must be positive"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, clean_file, monkeypatch, args, needle):
    """Impossible settings end with exit code 2 and one line naming the setting; nothing is trained."""
    code, _, err = run_main(monkeypatch, "--data_path", clean_file, *PREF, "--out_dir", tmp_path / "run", *args)
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_file_without_a_usable_pair_is_an_error(tmp_path, monkeypatch):
    """Every record is bad: exit 2, the last line says there is no usable pair and counts the reasons."""
    path = write_pairs(tmp_path / "bad.jsonl.gz", 0, bad=BAD_RECORDS)
    code, _, err = run_main(monkeypatch, "--data_path", path, *PREF, "--out_dir", tmp_path / "run")
    assert code == 2 and "no usable preference pair (4 skipped" in err[-1], err


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path, clean_file, monkeypatch):
    """A centering weight that overflows float32 makes the first loss inf: exit 1, the step named, no checkpoint."""
    args = ["--center_coef", "1e39", "--out_dir", tmp_path / "run", "--device", "cpu"]
    code, _, err = run_main(monkeypatch, "--data_path", clean_file, *PREF, *args)
    assert code == 1 and any("loss is inf at step 0; stopping" in line for line in err), err[-3:]
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_bce_sum_ignores_unlabelled_positions():
    scores, labels = torch.tensor([[0.3, -2.0, 1.0]]), torch.tensor([[-1, 0, 1]])
    expected = F.softplus(torch.tensor(-2.0)) + F.softplus(torch.tensor(-1.0))
    assert rm.token_bce_sum(scores, labels).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("pos_weight", [0.5, 2.0, 3.0])
def test_pos_weight_is_torchs_bce_with_logits_pos_weight_on_the_labelled_positions(pos_weight):
    """By hand: -(w y log sigmoid(s) + (1 - y) log(1 - sigmoid(s))) summed over the labelled positions, and the same
    as torch.nn.BCEWithLogitsLoss(pos_weight=w) on them; unset (None), every term counts once, exactly as before."""
    torch.manual_seed(0)
    scores = torch.randn(4, 6)  # float32, as the model's
    labels = torch.randint(-1, 2, (4, 6))
    labelled = labels >= 0
    s, y = scores[labelled], labels[labelled].float()
    by_hand = -(pos_weight * y * F.logsigmoid(s) + (1 - y) * F.logsigmoid(-s)).sum()
    torch_loss = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight), reduction="sum")
    loss = rm.token_bce_sum(scores, labels, pos_weight)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert loss.item() == pytest.approx(torch_loss(s, y).item(), rel=1e-6)
    plain = torch.nn.BCEWithLogitsLoss(reduction="sum")(s, y)
    assert torch.equal(rm.token_bce_sum(scores, labels), rm.token_bce_sum(scores, labels, 1.0))
    assert rm.token_bce_sum(scores, labels).item() == pytest.approx(plain.item(), rel=1e-6)
