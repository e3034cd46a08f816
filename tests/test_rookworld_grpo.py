"""rookworld_grpo.py: the chess environment against python-chess (hypothesis games and hand-made endings), the P:/A:
parsers and the reward ladder on hand-made completions, the tokenization identity of prompts, Stockfish targets
(skipped without Stockfish), the exact vocabulary KL and the EMA baseline, and end-to-end runs (make_data, a tiny
SFT with gpt.py, GRPO on mixed P:/A: batches, exact resume, torchrun, bad input)."""

import json
import os
import random
import shutil
import sys
from types import SimpleNamespace

import chess
import pytest
import torch
from conftest import (
    BPE_AVAILABLE,
    ROOT,
    metrics,
    needs_bpe,
    run_main,
    run_main_in_fixture,
    run_main_until_sigterm,
    run_script,
    torchrun,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt
import rookworld_grpo as rw

STOCKFISH = shutil.which("stockfish") or ("/usr/games/stockfish" if os.path.exists("/usr/games/stockfish") else None)
needs_stockfish = pytest.mark.skipif(STOCKFISH is None, reason="Stockfish is not installed")
VAL_FILE = ROOT.parent / "shared" / "data" / "rookworld_val_500.txt"
START = chess.STARTING_FEN


# --------------------------------------------------------------------------------------- the environment (A:)


def expected_step(board, move):
    """The oracle: python-chess on the board that carries the whole game."""
    if move not in board.legal_moves:
        return board.fen(), -1.0, board.is_game_over(), True
    after = board.copy()
    after.push(move)
    outcome = after.outcome()
    reward = 0.001 if outcome is None else (1.0 if outcome.winner is not None else 0.5)
    return after.fen(), reward, outcome is not None, False


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_env_step_matches_python_chess_on_random_games(seed):
    """A random game from the initial position (to its end or 300 plies); at its last plies and a few random ones,
    env_step with the game's moves as history gives python-chess's new FEN, reward, terminated and truncated, for the
    move played, an illegal UCI move and a malformed one. With only an A: line's 9 earlier moves the result is the
    same unless the game ended by fivefold repetition, which such a window cannot show."""
    rng = random.Random(seed)
    board = chess.Board()
    while not board.is_game_over() and len(board.move_stack) < 300:
        board.push(rng.choice(list(board.legal_moves)))
    game = [m.uci() for m in board.move_stack]
    for ply in [len(game) - 1, len(game) - 2, *rng.sample(range(len(game)), min(3, len(game)))]:
        before, move, history = play(game[:ply]), chess.Move.from_uci(game[ply]), game[:ply]
        got = rw.env_step(before.fen(), move.uci(), history)
        assert got == expected_step(before, move)
        after = before.copy()
        after.push(move)
        outcome = after.outcome()
        if outcome is None or outcome.termination != chess.Termination.FIVEFOLD_REPETITION:
            assert rw.env_step(before.fen(), move.uci(), history[-9:]) == got
        illegal = next(
            f"{a}{b}"
            for a in chess.SQUARE_NAMES
            for b in rng.sample(chess.SQUARE_NAMES, 64)
            if a != b and chess.Move.from_uci(f"{a}{b}") not in before.legal_moves
        )
        for bad in (illegal, rng.choice(["e9e4", "", "xyz", "e7e8k", "0000"])):
            assert rw.env_step(before.fen(), bad, history) == (before.fen(), -1.0, False, True)


def play(moves, fen=START):
    board = chess.Board(fen)
    for m in moves:
        board.push_uci(m)
    return board


@pytest.mark.parametrize(
    "fen, history, move, reward, terminated, why",
    [
        (play(["f2f3", "e7e5", "g2g4"]).fen(), ["f2f3", "e7e5", "g2g4"], "d8h4", 1.0, True, "checkmate"),
        ("k7/8/8/8/8/8/8/1Q5K w - - 0 1", [], "b1b6", 0.5, True, "stalemate"),
        ("k7/8/8/8/8/8/1r6/K6N w - - 0 1", [], "a1b2", 0.5, True, "insufficient material"),
        ("k7/8/8/8/8/8/8/K6R w - - 149 100", [], "h1h2", 0.5, True, "75-move rule"),
        ("k7/8/8/8/8/8/8/K6R w - - 148 100", [], "h1h2", 0.001, False, "one ply before the 75-move rule"),
        (START, [], "e2e4", 0.001, False, "a normal move"),
        (START, [], "e7e8q", -1.0, False, "illegal"),
    ],
)
def test_env_step_reward_table_by_hand(fen, history, move, reward, terminated, why):
    """Mate 1.0, draws 0.5 (stalemate, insufficient material, 75 moves), a normal move 0.001, illegal -1.0."""
    new_fen, got_reward, got_terminated, truncated = rw.env_step(fen, move, history)
    assert (got_reward, got_terminated, truncated) == (reward, terminated, reward == -1.0), why
    board = chess.Board(fen)
    if reward != -1.0:
        board.push_uci(move)
    assert new_fen == board.fen()


def test_env_step_sees_fivefold_repetition_only_with_the_whole_game():
    """Knights out and back four times: the initial position occurs for the fifth time after 16 plies. With every
    move as history that terminates with a draw; from an A: line's 10-move window it cannot be seen."""
    moves = ["g1f3", "g8f6", "f3g1", "f6g8"] * 4
    before = play(moves[:-1])
    after = play(moves)
    assert after.is_fivefold_repetition() and after.board_fen() == chess.Board().board_fen()
    assert rw.env_step(before.fen(), moves[-1], moves[:-1]) == (after.fen(), 0.5, True, False)
    assert rw.env_step(before.fen(), moves[-1], moves[-10:-1]) == (after.fen(), 0.001, False, False)


def test_a_prompt_shows_the_last_ten_moves_with_the_current_one_last():
    history = [f"{f}2{f}3" for f in "abcdefgh"] + ["a7a6", "b7b6", "c7c6"]
    prompt = rw.format_a_prompt(START, "g1f3", history)
    assert prompt == f"A: {START}+g1f3+{' '.join((history + ['g1f3'])[-10:])}+"
    assert rw.format_a_completion("x", 0.001, False, True) == "x+0.001+0+1"
    assert rw.format_a_completion("x", -1.0, False, True) == "x+-1.0+0+1"


# ------------------------------------------------------------------------------- parsers and the reward ladder

P_MOVES, P_EVALS = ["e2e4", "d2d4", "g1f3", "c2c4", "b1c3"], [5.0, 1.0, -3.0, -8.0, -12.0]
P_TARGET = rw.format_p_completion(P_MOVES, P_EVALS, "e2e4")


def p(moves, evals, best):
    return rw.format_p_completion(moves, evals, best)


@pytest.mark.parametrize(
    "completion, level, why",
    [
        # the target's pairs in another order: evals matched by move give 1; by position they would give 0.48 (0.8)
        (p(["g1f3", "e2e4", "b1c3", "d2d4", "c2c4"], [-3.0, 5.0, -12.0, 1.0, -8.0], "e2e4"), 1.0, "all right"),
        (p(P_MOVES, [15.0, 11.0, 7.0, 2.0, -2.0], "e2e4"), 0.8, "(4 + 2 + 1.5 + 0) / 8.5 = 0.88"),
        (p(["a2a3", "h2h3", "g2g4", "f2f3", "b2b4"], [0.0] * 5, "e2e4"), 0.6, "(4 + 2 * 0.75) / 8.5 = 0.65"),
        (p(P_MOVES, P_EVALS, "d2d4"), 0.4, "wrong best: (2 + 1.5 + 1) / 8.5 = 0.53"),
        (p(["a2a3", "h2h3", "g2g4", "f2f3", "b2b4"], [0.0] * 5, "a2a3"), 0.2, "format only: 2 / 8.5 = 0.24"),
        (" e2e4 d2d4      E: 0.3 0.1", -0.3, "no B: part"),
        (" e4 d4      E: 0.3 0.1      B: e4", -0.3, "moves in SAN, not UCI"),
        (" e2e4      E: +inf      B: e2e4", -0.3, "an eval that is not a plain number"),
        ("", -0.3, "empty"),
    ],
)
def test_score_p_ladder_by_hand(completion, level, why):
    assert rw.score_p(completion, P_TARGET) == level, why


def test_score_p_continuous_is_the_raw_score():
    """Best right, 1 of 2 listed moves in the target, format checks 3 of 4 (2 moves, not 5), eval (5.5 - 5)^2 = 0.25:
    raw = (4 + 2 * 0.75 + 1.5 * 0.5 + (1 - 0.25 / 100)) / 8.5."""
    completion = p(["e2e4", "a2a3"], [5.5, 0.0], "e2e4")
    raw = (4 + 1.5 + 0.75 + 0.9975) / 8.5
    assert rw.score_p(completion, P_TARGET, "continuous") == pytest.approx(raw)
    assert rw.score_p(completion, P_TARGET) == 0.8


def test_parse_p_reads_completions_and_lines_of_the_val_layout():
    assert rw.parse_p(P_TARGET) == {"moves": P_MOVES, "evals": P_EVALS, "best": "e2e4"}
    assert rw.parse_p("M: e7e8q      E: 999.99      B: e7e8q") == {
        "moves": ["e7e8q"],
        "evals": [999.99],
        "best": "e7e8q",
    }
    assert rw.parse_p(" e2e4 E: 0.1 B: e2e4 extra") is None
    assert rw.parse_p("      E: 0.1      B: e2e4") is None  # no move


A_BEFORE = START
A_TARGET = rw.format_a_completion(*rw.env_step(START, "e2e4", []))


@pytest.mark.parametrize(
    "completion, level, why",
    [
        (A_TARGET, 1.0, "all right"),
        (A_TARGET.replace("+0.001+", "+1.0+"), 0.8, "(4 + 3 + 2) / 10"),
        (A_TARGET.replace("+0.001+0+0", "+1.0+1+0"), 0.6, "(4 + 3) / 10"),
        ("8/8/8/8/8/8/8/8 w - - 0 1+1.0+1+0", 0.4, "a far FEN: 0.4 + 3 * 0.5 * (1 - d / L) < 0.6"),
        ("hello+1.0+1+0", 0.2, "an unreadable FEN: format 0.5"),
        (A_TARGET.rsplit("+", 1)[0], -0.3, "three fields"),
        (A_TARGET[:-1] + "2", -0.3, "a flag that is not 0/1"),
        ("+0.001+0+0", -0.3, "no FEN"),
    ],
)
def test_score_a_ladder_by_hand(completion, level, why):
    assert rw.score_a(completion, A_TARGET) == level, why


def test_score_a_partial_fen_credit_is_half_one_minus_the_normalised_edit_distance():
    """The start position instead of the position after e2e4, flags and reward right: d = edit distance,
    raw = (4 + 3 * 0.5 * (1 - d / L) + 2 + 1) / 10."""
    want = rw.parse_a(A_TARGET)["fen"]
    d = rw.edit_distance(START, want)
    raw = (4 + 1.5 * (1 - d / max(len(START), len(want))) + 3) / 10
    assert rw.score_a(f"{START}+0.001+0+0", A_TARGET, "continuous") == pytest.approx(raw)
    assert rw.edit_distance("kitten", "sitting") == 3 and rw.edit_distance("", "abc") == 3


def test_parse_a_fields():
    assert rw.parse_a(f"{START}+-1.0+0+1") == {"fen": START, "reward": -1.0, "terminated": False, "truncated": True}
    assert rw.parse_a(f"{START}+0.5+1+0+1") is None and rw.parse_a(f"{START}+x+1+0") is None


def test_completions_end_at_endoftext_or_a_newline():
    assert rw.end_of_completion("abc<|endoftext|>P: more") == "abc"
    assert rw.end_of_completion("abc\nA: more") == "abc"


def test_best_move_rules_on_a_black_to_move_line():
    """The original data's black-to-move rows hold the 5th-best move as B: rookworld keeps it, stockfish takes the
    highest eval (the evals are the side to move's)."""
    fen = play(["e2e4"]).fen()
    line = rw.format_p_prompt(fen) + p(["e7e5", "c7c5", "g8f6", "a7a6", "h7h5"], [-0.3, -0.2, -0.5, -0.6, -1.2], "h7h5")
    assert rw.parse_p(rw.split_line(line, "rookworld")["target"])["best"] == "h7h5"
    assert rw.parse_p(rw.split_line(line, "stockfish")["target"])["best"] == "c7c5"
    assert rw.best_of_analysis(fen, ["c7c5", "e7e5", "h7h5"], "rookworld") == "h7h5"
    assert rw.best_of_analysis(fen, ["c7c5", "e7e5", "h7h5"], "stockfish") == "c7c5"


def test_split_line_refuses_lines_in_neither_format():
    good = rw.format_p_prompt(START) + P_TARGET
    assert rw.split_line(good)["prompt"] + rw.split_line(good)["target"] == good
    for bad in ["", "hello", "P: not a fen M: e2e4 E: 0.1 B: e2e4", good.replace("B: e2e4", ""), "A: a+b+c"]:
        assert rw.split_line(bad) is None


# ------------------------------------------------------------------------------------------- tokenization identity


def bpe():
    import tiktoken

    return tiktoken.get_encoding("gpt2")


@needs_bpe
def test_prompt_and_target_tokenize_like_the_whole_line_on_make_data_lines():
    """ids(prompt) + ids(reference completion) == ids(line) for every --make_data line, and the prompts are
    format_p_prompt / format_a_prompt of the line's position (and move and history)."""
    enc = bpe()
    lines = rw.make_lines(120, random.Random(1), illegal_frac=0.2)
    assert {line[:2] for line in lines} == {"P:", "A:"}
    for line in lines:
        record = rw.split_line(line)
        assert enc.encode_ordinary(record["prompt"]) + enc.encode_ordinary(record["target"]) == enc.encode_ordinary(
            line
        )
        if record["task"] == "P":
            assert record["prompt"] == rw.format_p_prompt(record["fen"])
        else:
            assert record["prompt"] == rw.format_a_prompt(record["fen"], record["move"], record["history"])
            assert rw.score_a(record["target"], record["target"]) == 1.0


@needs_bpe
@pytest.mark.skipif(not VAL_FILE.exists(), reason="../shared/data/rookworld_val_500.txt is not here")
def test_prompt_and_target_tokenize_like_the_whole_line_on_the_shared_val_file():
    enc = bpe()
    for line in VAL_FILE.read_text().splitlines():
        record = rw.split_line(line, "rookworld")
        assert record["prompt"].endswith("M:") and record["target"] == line[len(record["prompt"]) :]
        assert enc.encode_ordinary(record["prompt"]) + enc.encode_ordinary(record["target"]) == enc.encode_ordinary(
            line
        )
        assert rw.score_p(record["target"], record["target"]) == 1.0


# ------------------------------------------------------------------------------------------------------ Stockfish


@needs_stockfish
def test_stockfish_targets_are_deterministic_for_a_fixed_node_limit():
    """Two separate engine pools, positions in another order, the same analysis; moves legal, best first; a mate in
    one scores 1000 - 1/100 for the side to move."""
    mate_in_one = play(["f2f3", "e7e5", "g2g4"]).fen()
    fens = [START, play(["e2e4", "c7c5"]).fen(), "8/8/R7/7p/P2K2k1/7r/8/8 w - - 0 56", mate_in_one]
    first = rw.Stockfish(STOCKFISH, depth=0, nodes=3000, workers=2)
    second = rw.Stockfish(STOCKFISH, depth=0, nodes=3000, workers=1)
    try:
        a = first.analyse(fens)
        b = second.analyse(fens[::-1])[::-1]
    finally:
        first.close()
        second.close()
    assert a == b
    for fen, (moves, evals) in zip(fens, a):
        assert 1 <= len(moves) <= 5 and len(evals) == len(moves)
        assert all(chess.Move.from_uci(m) in chess.Board(fen).legal_moves for m in moves)
    assert a[3][0][0] == "d8h4" and a[3][1][0] == 999.99


@needs_stockfish
def test_stockfish_sets_p_targets_and_annotates_make_data():
    sf = rw.Stockfish(STOCKFISH, depth=0, nodes=2000, workers=1)
    try:
        lines = rw.make_lines(8, random.Random(0), sf)
        record = rw.split_line(rw.format_p_prompt(START) + P_TARGET)
        rw.set_stockfish_targets([record], sf, "stockfish")
    finally:
        sf.close()
    target = rw.parse_p(record["target"])
    assert target["best"] == target["moves"][0] and len(target["moves"]) == 5 and target["evals"] != P_EVALS
    assert all(rw.split_line(line) is not None for line in lines)


# --------------------------------------------------------------------------------------------- algorithm pieces


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 9), st.integers(0, 10_000))
def test_vocab_kl_is_the_exact_kl_of_the_two_softmaxes(V, seed):
    """forward = KL(pi || ref), reverse = KL(ref || pi) as torch.distributions computes them; symmetric is their mean;
    all are >= 0 and 0 when the logits agree up to a constant. A policy truncated to its top tokens (-inf log-probs)
    has a finite forward KL with a finite gradient: its zero-probability tokens add 0, not NaN."""
    gen = torch.Generator().manual_seed(seed)
    logits, ref = torch.randn(3, 4, V, generator=gen), torch.randn(3, 4, V, generator=gen)
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    pi, q = torch.distributions.Categorical(logits=logits), torch.distributions.Categorical(logits=ref)
    fwd, rev = torch.distributions.kl_divergence(pi, q), torch.distributions.kl_divergence(q, pi)
    assert torch.allclose(rw.vocab_kl(logp, ref_logp, "forward"), fwd, atol=1e-5)
    assert torch.allclose(rw.vocab_kl(logp, ref_logp, "reverse"), rev, atol=1e-5)
    assert torch.allclose(rw.vocab_kl(logp, ref_logp, "symmetric"), (fwd + rev) / 2, atol=1e-5)
    assert (rw.vocab_kl(logp, ref_logp) >= -1e-6).all()
    assert rw.vocab_kl(logp, torch.log_softmax(logits + 3.0, -1)).abs().max() < 1e-5
    top = (logits >= logits.topk(2, -1).values[..., -1:]).double()  # two tokens or more (ties) per position
    truncated = logits.masked_fill(top == 0, float("-inf")).requires_grad_(True)
    kl = rw.vocab_kl(torch.log_softmax(truncated, -1), ref_logp, "forward")
    probs = torch.softmax(logits.double(), -1) * top  # torch.distributions: 0 log 0 = 0
    oracle = torch.distributions.kl_divergence(
        torch.distributions.Categorical(probs=probs), torch.distributions.Categorical(logits=ref.double())
    )
    torch.testing.assert_close(kl.double(), oracle, atol=1e-5, rtol=1e-5)
    kl.sum().backward()
    assert torch.isfinite(truncated.grad).all() and (truncated.grad[top == 0] == 0).all()


def test_ema_baseline_by_hand():
    """Starts at the first batch mean of each task, then b = 0.9 b + 0.1 mean; a task absent from a batch keeps b."""
    b = torch.full((2,), float("nan"))
    b = rw.ema_update(b, torch.tensor([0.5, 0.0]), torch.tensor([True, False]), 0.9)
    assert b[0] == 0.5 and torch.isnan(b[1])
    b = rw.ema_update(b, torch.tensor([1.0, -0.3]), torch.tensor([True, True]), 0.9)
    assert torch.allclose(b, torch.tensor([0.55, -0.3]))
    adv = rw.ema_advantages(torch.tensor([1.0, 0.2, -0.3]), torch.tensor([0, 1, 1]), b)
    assert torch.allclose(adv, torch.tensor([0.45, 0.5, 0.0]))


class DigitTokenizer:
    def decode(self, ids):
        return "".join(str(i % 10) for i in ids)


def test_complete_prompts_under_fsdp_samples_the_whole_horizon_and_masks_as_generate_does():
    """Under FSDP every forward pass is collective, so complete_prompts() samples the whole horizon on every rank; its
    mask, cut after the first end token, its real tokens and its texts are those of generate() with the end tokens,
    which stops once every row has ended. Each row's mask ends at its first end token (3 or 5), or runs the horizon."""
    torch.manual_seed(0)
    model = rw.GPT(rw.GPTConfig(block_size=32, vocab_size=11, n_layer=1, n_head=2, n_embd=16)).eval()
    prompts, cfg = [[1, 2, 3, 4], [5], [6, 7]], SimpleNamespace(horizon=12)
    one = rw.Runtime(torch.device("cpu"), torch.float32)
    fsdp = rw.Runtime(torch.device("cpu"), torch.float32, world_size=2, parallel="fsdp")
    for seed in range(5):
        runs = []
        for rt in (one, fsdp):
            torch.manual_seed(seed)
            runs.append(rw.complete_prompts(model, prompts, 1.0, None, cfg, rt, DigitTokenizer(), [3, 5]))
        torch.manual_seed(seed)
        runs.append(rw.generate(model, prompts, 12, 1.0, None, [3, 5]))
        (tokens, mask, texts), (all_tokens, all_mask, all_texts), (gen_tokens, gen_mask) = runs
        assert torch.equal(tokens, gen_tokens) and torch.equal(mask, gen_mask)
        assert all_tokens.size(1) == 12 and texts == all_texts
        n = mask.size(1)
        assert torch.equal(mask, all_mask[:, :n]) and not all_mask[:, n:].any()
        assert torch.equal(tokens[mask > 0], all_tokens[all_mask > 0])
        for row, m in zip(tokens, mask):
            real = row[m > 0].tolist()
            stops = [i for i, x in enumerate(real) if x in (3, 5)]
            assert stops == [len(real) - 1] or (not stops and len(real) == 12)


def test_read_records_counts_and_skips_lines_in_neither_format(tmp_path, capsys):
    lines = rw.make_lines(10, random.Random(0))
    path = tmp_path / "data.txt"
    path.write_text("\n".join([lines[0], "garbage", "P: nope", *lines[1:], ""]) + "\n")
    records = rw.read_records(str(path), "stockfish")
    assert len(records) == 10 and "skipped 2 line(s)" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_text("nothing here\n")
    with pytest.raises(SystemExit) as e:
        rw.read_records(str(tmp_path / "bad.txt"), "stockfish")
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------- end-to-end runs

GRPO = ["--batch_size", "2", "--group_size", "2", "--horizon", "40", "--eval_size", "2", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """--make_data lines (random play, no Stockfish) and a tiny gpt.py SFT on them: (data file, ckpt.pt)."""
    if not BPE_AVAILABLE:
        pytest.skip("GPT-2 BPE files unavailable")
    tmp = tmp_path_factory.mktemp("rookworld")
    data = tmp / "data.txt"
    run_main_in_fixture(rw, "--make_data", "60", "--out", data, "--illegal_frac", "0.2")
    args = ["--data", data, "--tokenizer", "gpt2", "--n_layer", "1", "--n_head", "2", "--n_embd", "32"]
    args += ["--block_size", "192", "--batch_size", "4", "--max_steps", "2", "--eval_every", "2", "--eval_iters", "1"]
    run_main_in_fixture(gpt, *args, "--num_samples", "1", "--sample_tokens", "2", "--out_dir", tmp / "sft")
    return data, tmp / "sft" / "ckpt.pt"


@pytest.mark.slow
def test_make_data_writes_distinct_lines_of_both_tasks_and_never_overwrites(sft, monkeypatch, capsys):
    """The fixture's --make_data file: distinct lines that all parse, both tasks, some illegal moves; asking for the
    same file again is refused with one line and leaves it as it was."""
    data, _ = sft
    lines = data.read_text().splitlines()
    assert len(lines) == 60 == len(set(lines)) and {line[:2] for line in lines} == {"P:", "A:"}
    assert all(rw.split_line(line) for line in lines) and any("+-1.0+0+1" in line for line in lines)
    monkeypatch.setattr(sys, "argv", ["rookworld_grpo.py", "--make_data", "5", "--out", str(data)])
    with pytest.raises(SystemExit) as e:
        rw.main()
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    assert data.read_text().splitlines() == lines


@pytest.mark.slow
@pytest.mark.plots
@needs_bpe
def test_grpo_on_mixed_batches_writes_the_run_and_resume_is_exact(tmp_path, sft, monkeypatch):
    """Two steps on batches of one P: and one A: prompt; SIGTERM after step 1 saves and exits 143, and --resume
    continues to exactly the uninterrupted metrics. Both tasks are evaluated and sampled."""
    data, init = sft
    common = ["--init_from", init, "--data_path", data, *GRPO, "--max_steps", "2", "--eval_every", "2"]
    common += ["--save_every", "1", "--entropy_coef", "0.01", "--kl_type", "symmetric", "--device", "cpu"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(rw, monkeypatch, *common, "--out_dir", full)
    proc = run_script("rookworld_grpo.py", *common, "--out_dir", part, env={"FAULT_SIGTERM_AT_STEP": "1"})
    assert proc.returncode == 143, proc.stderr[-2000:]
    proc = run_script("rookworld_grpo.py", "--resume", "--out_dir", part)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert metrics(full) == metrics(part)
    rows = metrics(full)
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 2 and all("rl/reward_p" in r and "rl/reward_a" in r and "rl/exact_kl" in r for r in train)
    evals = [r for r in rows if "eval/p_best_acc" in r]
    assert len(evals) == 2 and all("eval/a_fen_acc" in r and "eval/a_line_acc" in r for r in evals)
    samples = (full / "samples.txt").read_text()
    assert "P: " in samples and "A: " in samples
    ckpt = torch.load(full / "ckpt.pt", weights_only=True)
    assert ckpt["tokenizer"] == "gpt2" and ckpt["step"] == 2 and "lm_head.weight" in ckpt["model"]
    results = json.loads((full / "final_results.json").read_text())
    assert set(results["before"]) == set(results["after"]) >= {"p_reward", "a_reward"}
    for name in ("config.json", "training_curves.png"):
        assert (full / name).exists()


SPY = """
import os, random, sys
import torch
sys.path.insert(0, {root!r})
import rookworld_grpo as rw

calls, path = [], os.path.join({out!r}, f"spy{{os.environ.get('RANK', '0')}}.pt")


def keep(name, **tensors):  # every call's tensors, saved as they come
    calls.append((name, {{k: None if v is None else v.detach().cpu() for k, v in tensors.items()}}))
    torch.save(calls, path)


def spy(name, fn, *keys):  # keeps the positional arguments named in keys and the output(s)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        outs = {{f"out{{i}}": t for i, t in enumerate(out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)}}
        keep(name, **dict(zip(keys, args)), **outs)
        return out
    return wrapper


sample_groups = rw.sample_groups
def spy_sample_groups(*args, **kwargs):
    batch = sample_groups(*args, **kwargs)
    keep("batch", **{{k: batch[k] for k in ("seq", "attn", "mask", "rewards", "old_logp")}})
    return batch


rw.sample_groups = spy_sample_groups
rw.policy_loss = spy("policy_loss", rw.policy_loss, "logp", "old_logp", "adv", "mask")
rw.logprobs_and_kl = spy("logprobs_and_kl", rw.logprobs_and_kl)
if os.environ.get("SPY_RANDOM_REWARDS"):  # rewards with a spread, different on each rank (seeded by rank)
    rw.score_record = lambda record, text, shape="ladder": random.random()
rw.main()
"""


def spy_run(tmp_path, args, nproc=1, env=None, monkeypatch=None):
    """rookworld_grpo.py's main() with its rollouts and its policy_loss and logprobs_and_kl calls
    recorded per rank (spy<rank>.pt: a list of (name, tensors)); returns the run's training metrics and the records
    of each rank. With nproc 1 and a monkeypatch the spy runs in this process (no interpreter start), and the
    functions it replaces are put back after the test."""
    script = tmp_path / "spy.py"
    script.write_text(SPY.format(root=str(ROOT), out=str(tmp_path)))
    out = tmp_path / "run"
    args = [*args, "--device", "cpu", "--out_dir", out]
    if nproc == 1 and monkeypatch is not None:
        for name in ("sample_groups", "policy_loss", "logprobs_and_kl", "score_record"):
            monkeypatch.setattr(rw, name, getattr(rw, name))
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setattr(sys, "argv", ["rookworld_grpo.py", *map(str, args)])
        exec(compile(script.read_text(), str(script), "exec"), {"__name__": "spy"})
    else:
        proc = run_script(script, *args, env=env) if nproc == 1 else torchrun(script, nproc, *args, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    spied = [torch.load(tmp_path / f"spy{rank}.pt", weights_only=True) for rank in range(nproc)]
    return [r for r in metrics(out) if "train/loss" in r], spied


def first(calls, name, after=None):
    """The tensors of the first call of name (after the first call of `after`, when given)."""
    start = 0 if after is None else next(i for i, (n, _) in enumerate(calls) if n == after)
    return next(tensors for n, tensors in calls[start:] if n == name)


@pytest.mark.slow
@needs_bpe
@pytest.mark.parametrize("temperature, top_k, kl_type, iterations", [(0.5, 0, "symmetric", 1), (0.5, 5, "forward", 2)])
def test_every_completion_logprob_is_of_the_sampling_distribution(
    tmp_path, sft, temperature, top_k, kl_type, iterations, monkeypatch
):
    """At --temperature 0.5 (and --top_k 5), in the first update: the log-probs equal float64 log-probs of
    softmax(logits / 0.5) over the top_k tokens (the sampled token kept) of the starting model at the sampled
    positions; the sampling policy's old log-probs are exactly those (ratio exactly 1, also with more updates per
    batch); the entropy is that distribution's, and the KL is the exact forward/symmetric KL to the reference, the
    same model at the same temperature over the whole vocabulary (0 without top_k: the policy is the reference).
    With one update per batch the logged rl/entropy, rl/exact_kl and rl/ratio_mean are those values."""
    data, init = sft
    args = ["--init_from", init, "--data_path", data, *GRPO, "--eval_size", "0", "--max_steps", "1"]
    args += ["--temperature", temperature, "--top_k", top_k, "--kl_type", kl_type, "--num_iterations", iterations]
    train, (calls,) = spy_run(tmp_path, args, monkeypatch=monkeypatch)
    batch, update = first(calls, "batch"), first(calls, "policy_loss")
    update_pass = first(calls, "logprobs_and_kl", after="batch")  # the first update's (not the rollout's)
    entropy, kl = update_pass["out2"], update_pass["out1"]
    seq, attn, mask = batch["seq"], batch["attn"], batch["mask"] > 0
    T = mask.size(1)
    model = rw.load_model(str(init))[0].eval()
    with torch.no_grad():
        logits = model(seq[:, :-1], attention_mask=None if attn is None else attn[:, :-1])[0][:, -T:]  # (N, T, V)
    z = logits.double() / temperature
    top = z >= z.topk(top_k or z.size(-1), -1).values[..., -1:]  # (N, T, V) the tokens the sampler can draw
    logq = torch.log_softmax(z.masked_fill(~top, float("-inf")), -1)
    oracle_entropy = -(logq.exp() * logq.masked_fill(~top, 0)).sum(-1)  # (N, T)
    kept = top.scatter(-1, seq[:, -T:, None], True)  # and the sampled token, for its log-prob and the KL
    logq = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1)
    oracle_logp = logq.gather(-1, seq[:, -T:, None])[..., 0]
    ref_logq = torch.log_softmax(z, -1)
    forward = (logq.exp() * (logq - ref_logq).masked_fill(~kept, 0)).sum(-1)
    oracle_kl = forward if kl_type == "forward" else (forward + (ref_logq.exp() * (ref_logq - logq)).sum(-1)) / 2
    torch.testing.assert_close(update["logp"][mask].double(), oracle_logp[mask], atol=1e-4, rtol=1e-4)
    assert torch.equal(update["old_logp"][mask], update["logp"][mask])
    torch.testing.assert_close(entropy[mask].double(), oracle_entropy[mask], atol=1e-4, rtol=1e-4)
    assert kl.item() == pytest.approx(oracle_kl[mask].sum().item(), rel=1e-4, abs=1e-5)
    if iterations == 1:
        assert train[0]["rl/ratio_mean"] == 1.0 and train[0]["rl/clip_frac"] == 0.0
        assert train[0]["rl/entropy"] == pytest.approx(oracle_entropy[mask].mean().item(), rel=1e-4)
        assert train[0]["rl/exact_kl"] == pytest.approx(oracle_kl[mask].mean().item(), rel=1e-4, abs=1e-5)


@pytest.mark.slow
@needs_bpe
@pytest.mark.distributed
def test_scale_rewards_batch_divides_by_the_std_of_every_ranks_rewards(tmp_path, sft):
    """DDP over 2 gloo ranks, --scale_rewards batch, random rewards that differ between the ranks: each rank's
    advantages are group_advantages of both ranks' rewards together (rank 0's rows first), which differ from those
    of its own rewards alone; the logged reward mean, std and zero-spread share are those of both ranks' rewards."""
    data, init = sft
    args = ["--init_from", init, "--data_path", data, *GRPO, "--eval_size", "0", "--max_steps", "1"]
    args += ["--beta_kl", "0", "--scale_rewards", "batch"]
    train, spied = spy_run(tmp_path, args, nproc=2, env={"SPY_RANDOM_REWARDS": "1"})
    rewards = [first(calls, "batch")["rewards"].sum(1) for calls in spied]  # (N, H) on the last tokens -> (N,)
    everyone = torch.cat(rewards)
    expected = rw.group_advantages(everyone, 2, "batch").view(2, -1)
    for rank, calls in enumerate(spied):
        torch.testing.assert_close(first(calls, "policy_loss")["adv"], expected[rank])
        assert not torch.allclose(rw.group_advantages(rewards[rank], 2, "batch"), expected[rank])
    assert train[0]["rl/reward_mean"] == pytest.approx(everyone.mean().item())
    assert train[0]["rl/reward_std"] == pytest.approx(everyone.std().item())
    assert train[0]["rl/zero_std_frac"] == 0.0


@pytest.mark.slow
@needs_bpe
def test_float16_resume_restores_the_loss_scale(tmp_path, sft, monkeypatch):
    """--dtype float16 (autocast and a GradScaler, here on CPU): the checkpoint holds the scaler's state, and a run
    stopped after step 1 and resumed ends with the uninterrupted run's loss scale, growth tracker and metrics."""
    data, init = sft
    common = ["--init_from", init, "--data_path", data, *GRPO, "--eval_size", "0", "--max_steps", "2"]
    common += ["--save_every", "1", "--beta_kl", "0", "--dtype", "float16", "--device", "cpu"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(rw, monkeypatch, *common, "--out_dir", full)
    run_main_until_sigterm(rw, monkeypatch, 1, *common, "--out_dir", part)
    run_main(rw, monkeypatch, "--resume", "--out_dir", part)
    scalers = [torch.load(run / "ckpt.pt", weights_only=True)["scaler"] for run in (full, part)]
    assert scalers[0] and scalers[0] == scalers[1]
    assert metrics(full) == metrics(part)


@pytest.mark.slow
@needs_bpe
def test_resume_refuses_a_reference_that_changed_since_the_run_started(tmp_path, sft, monkeypatch):
    """The reference is reloaded from --init_from on --resume; when that file now holds other weights the resume
    ends with one line and exit code 2 instead of anchoring the KL to another model."""
    data, _ = sft
    init = tmp_path / "init.pt"
    shutil.copy(sft[1], init)
    out = tmp_path / "run"
    args = ["--init_from", init, "--data_path", data, *GRPO, "--eval_size", "0", "--max_steps", "1", "--device", "cpu"]
    run_main(rw, monkeypatch, *args, "--out_dir", out)
    ckpt = torch.load(init, weights_only=True)
    ckpt["model"]["transformer.ln_f.weight"] += 0.01
    torch.save(ckpt, init)
    proc = run_script("rookworld_grpo.py", "--resume", "--out_dir", out, "--max_steps", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "changed since the run started" in lines[0], proc.stderr


@pytest.mark.slow
@needs_bpe
@pytest.mark.distributed
def test_two_process_torchrun_with_a_value_head_and_adaptive_kl(tmp_path, sft):
    """DDP over 2 gloo ranks with GAE on a value head and the adaptive KL coefficient; the checkpoint holds the
    policy as a plain GPT state dict, the value head apart, and both ranks' RNG states."""
    data, init = sft
    out = tmp_path / "run"
    args = ["--init_from", init, "--data_path", data, *GRPO, "--max_steps", "2", "--eval_every", "2"]
    proc = torchrun(
        ROOT / "rookworld_grpo.py", 2, *args, "--value_head", "--adaptive_kl", "--device", "cpu", "--out_dir", out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert len(ckpt["rng_ranks"]) == 2 and ckpt["step"] == 2 and set(ckpt["value_head"]) == {"weight", "bias"}
    assert not any(k.startswith(("gpt.", "v_head.")) for k in ckpt["model"])
    train = [r for r in metrics(out) if "train/loss" in r]
    assert all("rl/value_loss" in r for r in train) and train[1]["rl/beta"] != 0.02


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--group_size", "1"], "--group_size"),
        (["--task_mix", "1.5"], "--task_mix"),
        (["--kl_type", "k3"], "--kl_type"),
        (["--value_head", "--parallel", "fsdp"], "--value_head"),
        (["--sf_depth", "0"], "--sf_depth"),
        (["--no_such_flag", "1"], "--no_such_flag"),
        (["--top_k", "5", "--kl_type", "reverse"], "--kl_type"),
    ],
)
def test_impossible_settings_exit_2_with_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        rw.validate(rw.resolve_clip(rw.parse_config(rw.Config, args)))
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and needle in lines[0]


def test_a_missing_data_file_or_a_bad_stockfish_is_one_clear_line(tmp_path, capsys):
    """A missing data file, a file that is not executable, a program that is not a UCI engine: exit code 2."""
    not_executable = tmp_path / "stockfish"
    not_executable.write_text("")
    for call, needle in [
        (lambda: rw.read_records(str(tmp_path / "missing.txt"), "stockfish"), "does not exist"),
        (lambda: rw.Stockfish(str(not_executable)), "not an executable file"),
        (lambda: rw.Stockfish(shutil.which("true") or "/bin/true"), "cannot start it as a UCI engine"),
    ]:
        with pytest.raises(SystemExit) as e:
            call()
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and needle in lines[0]


@pytest.mark.slow
def test_an_unreadable_stockfish_path_ends_the_command_with_one_line(tmp_path):
    """Through the command line: exit code 2, one line on stderr, no traceback, no file written."""
    out = tmp_path / "out.txt"
    proc = run_script("rookworld_grpo.py", "--make_data", "5", "--out", out, "--stockfish", "/nonexistent/stockfish")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--stockfish" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()


def sampling_oracle(logits, targets, temperature, top_k):
    """float64 log-probs of the sampling distribution, row by row over the tokens it can draw: the top_k largest of
    logits / temperature (ties kept) and the target (kept when an update has moved it out). Returns, per row, the
    kept indices and their log-probs (differentiable in logits), and the target's log-prob."""
    z = logits.double() / temperature
    rows = []
    for zi, y in zip(z, targets.tolist()):
        kept = torch.arange(zi.numel())
        if top_k:
            kth = zi.detach().sort(descending=True).values[min(top_k, zi.numel()) - 1]
            kept = torch.tensor([v for v in range(zi.numel()) if zi[v] >= kth or v == y])
        lp = zi[kept] - torch.logsumexp(zi[kept], 0)
        rows.append((kept, lp, lp[kept.tolist().index(y)]))
    return rows


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 17),
    st.integers(2, 9),
    st.sampled_from([1, 3, 64]),
    st.sampled_from(["both", "logp", "kl"]),
    st.floats(-2.0, 2.0),
    st.sampled_from([(1.0, None), (0.5, None), (0.7, 2), (2.0, 1)]),
    st.integers(0, 10_000),
)
def test_logprobs_and_kl_have_the_values_and_gradient_of_the_formulas(M, V, rows, used, upstream, sampling, seed):
    """logprobs_and_kl over chunks of 1, 3 or 64 rows gives log p(targets) under the sampling distribution
    (logits / temperature, top_k with the target kept), sum_i w_i KL_i against the reference at the same temperature
    over the whole vocabulary, and the logits gradient of a * logp + upstream * KL (either output alone, or both) of
    a float64 oracle over the drawable tokens, for every kind (reverse and symmetric only without top_k: they are
    infinite with it); zero weights (padding) drop their positions from the KL."""
    temperature, top_k = sampling
    gen = torch.Generator().manual_seed(seed)
    logits, ref = torch.randn(M, V, generator=gen) * 2, torch.randn(M, V, generator=gen) * 2
    weights = torch.rand(M, generator=gen) * (torch.rand(M, generator=gen) > 0.3)
    targets, a = torch.randint(0, V, (M,), generator=gen), torch.randn(M, generator=gen)

    def objective(logp, kl):  # only the outputs in use enter the graph
        return (0 if used == "kl" else (a * logp).sum()) + (0 if used == "logp" else upstream * kl)

    for kind in ("forward", "reverse", "symmetric") if top_k is None else ("forward",):
        x = logits.clone().requires_grad_(True)
        logp, total, _ = rw.logprobs_and_kl(x, targets, ref, weights, kind, temperature, top_k, rows=rows)
        x64 = logits.double().requires_grad_(True)
        lq = torch.log_softmax(ref.double() / temperature, -1)  # the reference: every token, same temperature
        kl, logp64 = [], []
        for (kept, lp, lp_y), lq_i in zip(sampling_oracle(x64, targets, temperature, top_k), lq):
            fwd = (lp.exp() * (lp - lq_i[kept])).sum()
            rev = (lq_i[kept].exp() * (lq_i[kept] - lp)).sum()  # KL(ref || pi) when every token is kept (no top_k)
            kl.append({"forward": fwd, "reverse": rev, "symmetric": (fwd + rev) / 2}[kind])
            logp64.append(lp_y)
        expected, logp64 = (torch.stack(kl) * weights.double()).sum(), torch.stack(logp64)
        objective(logp, total).backward()
        objective(logp64, expected).backward()
        assert total.detach().item() == pytest.approx(expected.item(), abs=1e-4)
        torch.testing.assert_close(logp.double(), logp64.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(2, 9), st.sampled_from([(1.0, None), (0.5, None), (0.7, 3), (2.0, 1)]))
def test_logprobs_and_kl_give_the_entropy_of_the_sampling_distribution(M, V, sampling):
    """Without a reference (KL 0): H = -sum p log p over the tokens the sampler can draw (logits / temperature, top_k,
    the target kept as for its log-prob), value and gradient against float64, over chunks of 4 rows; the tokens
    outside the top_k add 0 to both (no NaN from 0 * log 0)."""
    temperature, top_k = sampling
    logits = (torch.randn(M, V) * 3).requires_grad_(True)
    weights, targets = torch.randn(M), torch.randint(0, V, (M,))
    _, kl, ent = rw.logprobs_and_kl(logits, targets, temperature=temperature, top_k=top_k, rows=4)
    assert kl.item() == 0.0
    (ent * weights).sum().backward()
    x64 = logits.detach().double().requires_grad_(True)
    rows = sampling_oracle(x64, targets, temperature, top_k)
    oracle = torch.stack([-(lp.exp() * lp).sum() for _, lp, _ in rows])
    (oracle * weights.double()).sum().backward()
    torch.testing.assert_close(ent.double(), oracle.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)


def test_logprobs_and_kl_keep_no_float32_tensor_of_the_vocabulary_beyond_their_inputs():
    """With a gradient, what autograd saves in the forward pass is the inputs (views of the logits and reference
    logits, a chunk each) and small tensors: the (positions, V) float32 log-probs, probabilities and differences
    are recomputed chunk by chunk in backward, never held for all positions."""
    logits, ref = torch.randn(64, 500, requires_grad=True), torch.randn(64, 500)
    targets, weights = torch.randint(0, 500, (64,)), torch.ones(64)
    inputs = {logits.untyped_storage().data_ptr(), ref.untyped_storage().data_ptr()}
    new = []  # sizes of saved tensors that are not views of the inputs

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            new.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, total, entropy = rw.logprobs_and_kl(logits, targets, ref, weights, "symmetric", 0.7, rows=8)
    assert max(new, default=0) <= 64
    (logp.sum() + total + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_logprobs_and_kl_from_reference_hidden_states_equal_those_from_its_logits():
    """With ref_weight, ref_logits are the reference's hidden states and each chunk's logits are made from them: the
    same log-probs, KL and gradient as from the whole reference logits."""
    torch.manual_seed(0)
    logits, h, weight = torch.randn(3, 7, 50), torch.randn(3, 7, 16), torch.randn(50, 16)
    targets, weights = torch.randint(0, 50, (3, 7)), torch.rand(3, 7)
    results = []
    for ref, ref_weight in [(h @ weight.T, None), (h, weight)]:
        x = logits.clone().requires_grad_(True)
        logp, kl, _ = rw.logprobs_and_kl(x, targets, ref, weights, "symmetric", 0.8, ref_head=ref_weight, rows=4)
        (logp.sum() + kl).backward()
        results.append((logp, kl, x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
