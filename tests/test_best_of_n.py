"""reward_model.py's best-of-n: the exact KL of best-of-n sampling (best_of_n_kl) against its bound and a brute-force
enumeration, the unbiased best-of-n estimate from N samples (best_of_n_weights), the answers' log-probs, and
`--best_of` end to end (best_of_n.json, the printed table, refusals)."""

import itertools
import json
import math
import random
import re

import pytest
import torch
from conftest import char_checkpoint, run_main_captured
from hypothesis import given, settings
from hypothesis import strategies as st

import reward_model as rm


def bound(n):
    return math.log(n) - (n - 1) / n


def brute_force_kl(p, scores, n):
    """KL(pi_bon || pi) by enumerating every n-tuple of answers: index K is the rest of the probability, ranked below
    every answer; among answers the higher score wins, ties to the higher index (the lower index ranks lower)."""
    K = len(p)
    q = p + [1 - sum(p)]
    rank = [(scores[i], i) for i in range(K)] + [(-math.inf, -1)]
    pi_bon = [0.0] * (K + 1)
    for draw in itertools.product(range(K + 1), repeat=n):
        best = max(draw, key=lambda i: rank[i])
        pi_bon[best] += math.prod(q[i] for i in draw)
    return sum(b * math.log(b / q[i]) for i, b in enumerate(pi_bon) if b > 0)


# a policy: K answers' probabilities (the rest: the leftover bucket) and their scores, ties likely
policies = st.integers(1, 8).flatmap(
    lambda K: st.tuples(
        st.lists(st.floats(0.0, 1.0), min_size=K, max_size=K),
        st.floats(0.0, 1.0),
        st.lists(st.integers(-2, 2), min_size=K, max_size=K),
    )
)


def normalized(weights, rest):
    """Probabilities of the answers whose sum is 1 - rest' with rest' = rest when the weights allow it."""
    total = sum(weights)
    if total == 0:
        return [0.0] * len(weights)
    return [w / total * (1 - rest) for w in weights]


@settings(max_examples=200, deadline=None)
@given(policy=policies)
def test_best_of_n_kl_is_0_at_n_1(policy):
    """Best-of-1 is the policy itself."""
    weights, rest, scores = policy
    p = torch.tensor(normalized(weights, rest))
    assert rm.best_of_n_kl(p, torch.tensor(scores, dtype=torch.float), 1) == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(policy=policies, n=st.integers(1, 200))
def test_best_of_n_kl_never_exceeds_log_n_minus_n_minus_1_over_n(policy, n):
    """Beirami et al. 2024: KL(pi_bon || pi) <= log n - (n - 1)/n for every discrete policy, ties and leftover too."""
    weights, rest, scores = policy
    p = torch.tensor(normalized(weights, rest))
    kl = rm.best_of_n_kl(p, torch.tensor(scores, dtype=torch.float), n)
    assert -1e-12 <= kl <= bound(n) + 1e-9


def test_best_of_n_kl_nears_the_bound_for_many_equally_likely_answers():
    """10,000 answers of probability 1e-4 each, distinct scores: within 1e-3 of log 16 - 15/16 at n = 16."""
    K = 10_000
    scores = torch.randperm(K, generator=torch.Generator().manual_seed(0)).float()
    kl = rm.best_of_n_kl(torch.full((K,), 1 / K), scores, 16)
    assert kl <= bound(16) and bound(16) - kl < 1e-3


def test_best_of_n_kl_of_a_right_answer_among_ten_wrong_ones_hand_values():
    """The right answer at 0.23 scored above ten wrong ones at 0.077: 1.40 nats at n = 16, 1.47 at n = 32, where
    the bound says 1.84 and 2.50."""
    p = torch.tensor([0.23] + [0.077] * 10)
    scores = torch.tensor([1.0] + [0.0] * 10)
    assert rm.best_of_n_kl(p, scores, 16) == pytest.approx(1.3987, abs=1e-4)
    assert rm.best_of_n_kl(p, scores, 32) == pytest.approx(1.4677, abs=1e-4)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "p, scores",
    [
        ([0.5, 0.3, 0.2], [0.1, -1.0, 2.0]),  # distinct scores, no leftover
        ([0.5, 0.3, 0.2], [1.0, 1.0, 0.0]),  # a tie: index 0 ranks below index 1
        ([0.2, 0.3, 0.1], [0.0, 2.0, 0.0]),  # a tie and a leftover of 0.4 ranked lowest
        ([0.6, 0.05, 0.05], [3.0, 3.0, 3.0]),  # all tied, a leftover of 0.3
    ],
)
def test_best_of_n_kl_equals_brute_force_enumeration_of_all_n_tuples(p, scores, n):
    """K = 3 answers (and the leftover bucket): the formula F(y)^n - F(y-)^n equals counting every n-tuple."""
    kl = rm.best_of_n_kl(torch.tensor(p, dtype=torch.float64), torch.tensor(scores), n)
    assert kl == pytest.approx(brute_force_kl(p, scores, n), abs=1e-9)


@pytest.mark.parametrize("N, n", [(1, 1), (5, 1), (5, 2), (6, 3), (6, 6)])
def test_best_of_n_weights_give_the_mean_best_over_all_n_subsets(N, n):
    """Samples in ascending score order: the weighted sum is the mean over all C(N, n) subsets of the subset's best
    (the highest-ranked) value."""
    values = torch.randn(N, generator=torch.Generator().manual_seed(N + n), dtype=torch.float64)
    subsets = list(itertools.combinations(range(N), n))
    brute = sum(values[max(s)].item() for s in subsets) / len(subsets)
    w = rm.best_of_n_weights(N, n)
    assert (w * values).sum().item() == pytest.approx(brute, abs=1e-12) and w.sum().item() == pytest.approx(1.0)


def test_answer_logprobs_is_the_sum_of_next_token_log_probs(tmp_path):
    """log p(answer | prompt): each answer token's log-softmax given everything before it, newline included,
    computed one prefix at a time; batches of different lengths do not change it."""
    policy, _, _ = rm.load_model(str(char_checkpoint(tmp_path / "p.pt", rm.ARITHMETIC_CHARS, block_size=32)))
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    pairs = [("12+3=", "15\n"), ("7*8=", "56\n"), ("1-2=", "-1\n"), ("99*99=", "9801\n")]
    got = rm.answer_logprobs(policy, tok, pairs, "cpu", batch_size=3)
    for (prompt, answer), value in zip(pairs, got):
        ids = tok.encode(prompt + answer)
        want = 0.0
        for t in range(len(prompt), len(ids)):
            logits, _ = policy(torch.tensor([ids[:t]]))
            want += torch.log_softmax(logits[0, -1], -1)[ids[t]].item()
        assert value == pytest.approx(want, abs=1e-4)


# ------------------------------------------------------------------------------------------------ end to end


def run_main(monkeypatch, *args):
    """reward_model.main() in this process, its output captured: (exit code, 0 when main returns; stdout; stderr
    lines)."""
    return run_main_captured(rm, monkeypatch, *args)


@pytest.fixture
def checkpoints(tmp_path):
    """(an orm verifier, a policy, a preference reward model, a prm verifier): tiny random char models of the
    arithmetic vocabulary."""
    paths = []
    for name, task in (("verifier", "orm"), ("policy", None), ("preference", "preference"), ("prm", "prm")):
        path = char_checkpoint(tmp_path / f"{name}.pt", rm.ARITHMETIC_CHARS, block_size=32, reward_head=bool(task))
        if task:
            ckpt = torch.load(path, weights_only=True)
            ckpt["reward_task"] = task
            torch.save(ckpt, path)
        paths.append(path)
    return paths


def test_best_of_writes_best_of_n_json_and_prints_its_table(tmp_path, monkeypatch, checkpoints):
    """A tiny run: a row per n with every field, 0 <= kl <= kl_bound, kl 0 at n = 1, the problems those of grpo.py's
    held-out draw (--eval_size draws from random.Random(1234), distinct ones), and the table printed."""
    verifier, policy, _, _ = checkpoints
    out = tmp_path / "bon"
    args = ["--init_from", verifier, "--policy", policy, "--best_of", "1,2,4,8", "--eval_size", 12, "--digits", 1]
    code, stdout, err = run_main(monkeypatch, *args, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    rows = json.loads((out / "best_of_n.json").read_text())
    rng = random.Random(1234)
    problems = {rm.draw_problem(rng, 1, "+-*", True) for _ in range(12)}
    assert [r["n"] for r in rows] == [1, 2, 4, 8]
    for r in rows:
        fields = {"n", "gold", "gold_se", "proxy", "kl", "kl_bound", "n_problems", "uncovered", "samples_per_problem"}
        fields |= {"gold_a", "gold_b", "majority", "majority_se", "weighted_majority", "weighted_majority_se"}
        assert fields <= set(r)
        assert r["n_problems"] == len(problems) and r["samples_per_problem"] == 8
        assert r["kl_bound"] == pytest.approx(bound(r["n"]))
        assert -1e-9 <= r["kl"] <= r["kl_bound"] + 1e-9 and 0 <= r["gold"] <= 1 and 0 <= r["uncovered"] <= 1
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert rows[-1]["proxy"] >= rows[0]["proxy"]  # the mean best over n-subsets never falls as n grows
    lines = stdout.splitlines()
    assert "1 x cpu, best-of-1,2,4,8" in lines[0] and lines[0].endswith(f"run folder {out}")
    assert f"on {len(problems)} held-out problems, 8 answers each" in lines[-1]
    assert [json.loads(line) for line in lines[1:-1]] == rows  # the table: a row per n, as best_of_n.json holds it
    assert not (out / "ckpt.pt").exists()


def test_best_of_a_policy_that_always_answers_right_has_gold_1(tmp_path, monkeypatch, checkpoints):
    """A stand-in generate writes the right answer every time: gold 1 +- 0 at every n, one distinct answer a
    problem, so its probability under the policy is all that is covered."""
    verifier, policy, _, _ = checkpoints
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)

    def always_right(model, prompts, max_new_tokens, generator=None, **kwargs):
        texts = [f"{eval(tok.decode(ids)[:-1])}\n".ljust(max_new_tokens, "=") for ids in prompts]
        return torch.tensor([tok.encode(t) for t in texts]), torch.ones(len(texts), max_new_tokens)

    monkeypatch.setattr(rm, "generate", always_right)
    out = tmp_path / "bon"
    args = ["--init_from", verifier, "--policy", policy, "--best_of", "1,3", "--eval_size", 8, "--digits", 1]
    code, _, err = run_main(monkeypatch, *args, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    rows = json.loads((out / "best_of_n.json").read_text())
    assert all(r["gold"] == 1.0 and r["gold_se"] == 0.0 for r in rows)
    assert 0 < rows[0]["uncovered"] < 1 and rows[1]["kl"] <= bound(3)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--best_of", "1,2"], "--policy"),  # no --policy
        (["--policy", "POLICY"], "--policy"),  # no --best_of
        (["--best_of", "0,2", "--policy", "POLICY"], "--best_of"),
        (["--best_of", "1,,2", "--policy", "POLICY"], "--best_of"),
        (["--best_of", "2.5", "--policy", "POLICY"], "--best_of"),
        (["--best_of", "-1", "--policy", "POLICY"], "--best_of"),
        (["--best_of", "1,2", "--policy", "POLICY", "--init_from", "PREFERENCE"], "arithmetic verifier"),
        (["--best_of", "1,2", "--policy", "OTHER"], "tokenizer"),
    ],
)
def test_best_of_refusals_exit_2_with_one_line_and_write_nothing(tmp_path, monkeypatch, checkpoints, extra, needle):
    """No --policy (or no --best_of), n values that are not positive integers, a preference model as the verifier,
    a policy with another tokenizer: exit 2, one line, no run folder."""
    verifier, policy, preference, _ = checkpoints
    other = char_checkpoint(tmp_path / "other.pt", rm.ARITHMETIC_CHARS + " ", block_size=32)  # another vocabulary
    swap = {"POLICY": policy, "PREFERENCE": preference, "OTHER": other}
    args = ["--init_from", verifier, *[swap.get(a, a) for a in extra], "--out_dir", tmp_path / "bon"]
    code, _, err = run_main(monkeypatch, *args, "--device", "cpu")
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "bon").exists()


def test_best_of_gold_on_each_half_of_the_problems(tmp_path, monkeypatch, checkpoints):
    """A stand-in generate answers right exactly the problems at even places of the sorted held-out list: gold_a is 1
    and gold_b 0 at every n (a peak picked on one half is reported on the other), gold the share of even places."""
    verifier, policy, _, _ = checkpoints
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    problems = rm.held_out_problems(1, "+-*", 20)
    even = {prompt for prompt, _ in problems[0::2]}

    def right_on_even_places(model, prompts, max_new_tokens, generator=None, **kwargs):
        texts = []
        for ids in prompts:
            prompt = tok.decode(ids)
            value = eval(prompt[:-1]) + (0 if prompt in even else 1)
            texts.append(f"{value}\n".ljust(max_new_tokens, "="))
        return torch.tensor([tok.encode(t) for t in texts]), torch.ones(len(texts), max_new_tokens)

    monkeypatch.setattr(rm, "generate", right_on_even_places)
    out = tmp_path / "bon"
    args = ["--init_from", verifier, "--policy", policy, "--best_of", "1,2", "--eval_size", 20, "--digits", 1]
    code, _, err = run_main(monkeypatch, *args, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    rows = json.loads((out / "best_of_n.json").read_text())
    assert all(r["gold_a"] == 1.0 and r["gold_b"] == 0.0 for r in rows)
    assert all(r["gold"] == pytest.approx(len(even) / len(problems)) for r in rows)


# ------------------------------------------------------------------------------- process verifiers and majority


def test_aggregate_steps_prod_min_last_hand_values():
    """Steps at the labelled positions (labels >= 0) only, p = sigmoid(score): prod multiplies them, min takes the
    smallest, last the last step's; scores off the steps change nothing."""
    logit = math.log(0.8 / 0.2)  # sigmoid: 0.8
    scores = torch.tensor([[9.0, logit, -9.0, 0.0, 5.0], [0.0, -9.0, 9.0, logit, 3.0]])
    labels = torch.tensor([[-1, 1, -1, 0, -1], [1, -1, -1, 1, -1]])  # row 0: p 0.8, 0.5; row 1: p 0.5, 0.8
    assert rm.aggregate_steps(scores, labels, "prod").tolist() == pytest.approx([0.4, 0.4])
    assert rm.aggregate_steps(scores, labels, "min").tolist() == pytest.approx([0.5, 0.5])
    assert rm.aggregate_steps(scores, labels, "last").tolist() == pytest.approx([0.5, 0.8])
    one_step = torch.tensor([[-1, -1, 1, -1, -1]])
    for how in ("prod", "min", "last"):
        assert rm.aggregate_steps(scores[:1], one_step, how).item() == pytest.approx(1 / (1 + math.exp(9)))


@given(st.lists(st.tuples(st.floats(-6, 6), st.booleans()), min_size=1, max_size=12))
@settings(max_examples=60, deadline=None)
def test_aggregate_steps_prod_is_at_most_min_which_is_at_most_last(steps):
    """prod <= min <= last for probabilities in (0, 1), on any rows with at least one step."""
    scores = torch.tensor([[s for s, _ in steps]])
    labels = torch.tensor([[1 if is_step else -1 for _, is_step in steps]])
    labels[0, -1] = 0  # the last position is a step
    prod, low, last = (rm.aggregate_steps(scores, labels, how).item() for how in ("prod", "min", "last"))
    assert prod <= low * (1 + 1e-6) and low <= last * (1 + 1e-6)


def test_majority_vote_hand_cases():
    """The most frequent final result wins; a tie splits the credit; answers that are not well formed do not vote."""
    assert rm.majority_vote(["7", "7", "8"], "7") == 1.0
    assert rm.majority_vote(["7", "8", "8"], "7") == 0.0
    assert rm.majority_vote(["7", "8", None, None, None], "7") == 0.5  # a tie of 7 and 8; None never wins
    assert rm.majority_vote(["7", "8", "9"], "9") == pytest.approx(1 / 3)
    assert rm.majority_vote([None, None], "7") == 0.0 and rm.majority_vote([], "7") == 0.0
    assert rm.majority_vote(["-3", "-3", "3"], "-3") == 1.0


def test_weighted_majority_vote_sums_each_final_results_weights():
    """Verifier-weighted voting: a final result's votes are the weights of its answers; the heaviest wins, ties split,
    answers that are not well formed still do not vote."""
    assert rm.majority_vote(["7", "8", "8"], "7", [0.9, 0.2, 0.3]) == 1.0  # 0.9 against 0.5
    assert rm.majority_vote(["7", "7", "8"], "7", [0.1, 0.1, 0.5]) == 0.0
    assert rm.majority_vote(["7", "8", None], "7", [0.5, 0.5, 9.0]) == 0.5  # a tie; None's weight counts for nothing
    assert rm.majority_vote(["7", "8"], "8", [1, 1]) == rm.majority_vote(["7", "8"], "8")


def test_best_of_with_a_prm_scores_by_the_aggregate_and_votes_by_majority(tmp_path, monkeypatch, checkpoints):
    """--task prm verifier, --prm_aggregate min, --steps 2: a stand-in generate writes each problem's right solution
    five times in eight and one with a wrong final result three times: majority voting's gold is 1 at n = N (five
    votes against three) and about 5/8 at n = 1, as gold is; every row carries the majority fields."""
    _, policy, _, prm = checkpoints
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    calls = []

    def five_right_three_wrong(model, prompts, max_new_tokens, generator=None, **kwargs):
        texts = []
        for i, ids in enumerate(prompts):
            prompt = tok.decode(ids)
            solution = "".join(f"{line}\n" for line in right_solution(prompt))
            if i % 8 >= 5:  # three of eight: the final result off by one
                head, _, result = solution[:-1].rpartition("=")
                solution = f"{head}={int(result) + 1}\n"
            texts.append(solution.ljust(max_new_tokens, "=")[:max_new_tokens])
        calls.append(len(prompts))
        return torch.tensor([tok.encode(t) for t in texts]), torch.ones(len(texts), max_new_tokens)

    monkeypatch.setattr(rm, "generate", five_right_three_wrong)
    out = tmp_path / "bon"
    args = ["--init_from", prm, "--policy", policy, "--best_of", "1,8", "--eval_size", 10, "--digits", 1]
    args += ["--steps", 2, "--prm_aggregate", "min"]
    code, _, err = run_main(monkeypatch, *args, "--out_dir", out, "--device", "cpu")
    assert code == 0, err[-5:]
    rows = json.loads((out / "best_of_n.json").read_text())
    assert rows[1]["majority"] == 1.0 and rows[1]["majority_se"] == 0.0
    assert rows[0]["majority"] == pytest.approx(5 / 8, abs=0.1) and rows[0]["gold"] == pytest.approx(5 / 8)
    assert json.loads((out / "config.json").read_text())["prm_aggregate"] == "min"

    # a stand-in verifier sure of the wrong solutions (0.99) and not of the right ones (0.01): weighted by its
    # probabilities the three wrong votes (2.97) outweigh the five right ones (0.05) at n = 8; plain voting is unmoved
    def sure_of_the_wrong(verifier, tok, task, pairs, aggregate="prod", device="cpu"):
        return [0.01 if y.splitlines() == right_solution(prompt) else 0.99 for prompt, y in pairs]

    monkeypatch.setattr(rm, "solution_scores", sure_of_the_wrong)
    code, _, err = run_main(monkeypatch, *args, "--out_dir", tmp_path / "weighted", "--device", "cpu")
    assert code == 0, err[-5:]
    rows = json.loads((tmp_path / "weighted" / "best_of_n.json").read_text())
    assert rows[1]["majority"] == 1.0 and rows[1]["weighted_majority"] == 0.0 and rows[1]["gold"] == 0.0
    assert rows[0]["weighted_majority"] == pytest.approx(rows[0]["majority"])  # one vote: its weight cannot matter


def right_solution(prompt):
    """The lines of a K-step prompt's right solution, left to right: "1+2*3=" -> ["1+2=3", "3*3=9"]."""
    x = int(re.match(r"\d+", prompt).group())
    lines = []
    for op, y in re.findall(r"([-+*])(\d+)", prompt):
        result = {"+": x + int(y), "-": x - int(y), "*": x * int(y)}[op]
        lines.append(f"{x}{op}{y}={result}")
        x = result
    return lines


def test_solution_scores_of_a_prm_read_each_step_at_its_newline(tmp_path):
    """solution_scores with a prm: the verifier's score at each step's newline, as it trains (encode), aggregated;
    a stand-in prm whose score is +9 after a right step and -9 after a wrong one gives prod ~1 for a right solution
    and ~0 when any step is wrong; orm: the last token's score."""
    tok = rm.CharTokenizer(rm.ARITHMETIC_CHARS)
    newline = tok.encode("\n")[0]

    class StepChecker(torch.nn.Module):
        body = type("Body", (), {"config": type("C", (), {"block_size": 64})})()

        def forward(self, idx):  # +9 at a newline after "=3" (the right first result below), else -9
            out = torch.full(idx.shape, -9.0)
            for b, row in enumerate(idx.tolist()):
                text = tok.decode(row)
                for t, token in enumerate(row):
                    if token == newline and text[: t + 1].rstrip("\n").split("\n")[-1].endswith(("=3", "=9")):
                        out[b, t] = 9.0
            return out

    pairs = [("1+2*3=", "1+2=3\n3*3=9\n"), ("1+2*3=", "1+2=4\n4*3=12\n"), ("1+2*3=", "1+2=3\n3*3=10\n")]
    got = rm.solution_scores(StepChecker(), tok, "prm", pairs, "prod", "cpu")
    assert got[0] > 0.99 and got[1] < 0.01 and got[2] < 0.01
