"""char_grpo.py's controls: the reward switched off (--reward_mode none) trains on the KL term alone, and the bigram
reference evaluated as a model (--eval_reference) scores what a direct count of the text gives."""

import json
import math
import random
from collections import Counter

import torch
from conftest import metrics
from test_char_grpo import SMALL_RUN, TINY, run_in_process

import char_grpo as cg


def test_reward_off_trains_on_the_kl_term_alone(tmp_path, text_file, monkeypatch):
    """--reward_mode none --beta_kl 0.5 --kl_warmup_tokens 0: every advantage the loss sees is exactly 0, the policy
    term is 0, and the logged train/loss is 0.5 times the mean k3 term of the step's characters."""
    advantages, pg_losses, kl_means = [], [], []
    policy_loss = cg.policy_loss
    kl_penalty = cg.kl_penalty

    def loss_spy(logp, old_logp, adv, *args, **kwargs):
        advantages.append(adv.clone())
        loss, stats = policy_loss(logp, old_logp, adv, *args, **kwargs)
        pg_losses.append(loss.item())
        return loss, stats

    def kl_spy(logp, ref_logp, kind):
        kl = kl_penalty(logp, ref_logp, kind)
        kl_means.append(kl.mean().item())  # a rollout never stops early: every character is real
        return kl

    monkeypatch.setattr(cg, "policy_loss", loss_spy)
    monkeypatch.setattr(cg, "kl_penalty", kl_spy)
    out = tmp_path / "run"
    flags = ["--reward_mode", "none", "--beta_kl", 0.5, "--kl_warmup_tokens", 0, "--max_steps", 1]
    assert run_in_process(["--data", text_file, *SMALL_RUN, *flags, "--out_dir", out], monkeypatch) == 0
    assert len(advantages) == 1
    assert torch.equal(advantages[0], torch.zeros_like(advantages[0]))
    assert pg_losses == [0.0]
    step = next(r for r in metrics(out) if "train/loss" in r)
    assert kl_means[0] > 0
    assert math.isclose(step["train/loss"], 0.5 * kl_means[0], rel_tol=1e-5)
    assert step["rl/reward_mean"] == 0.0


def test_reward_off_without_a_reference_is_refused(tmp_path, text_file, capsys):
    """Nothing would train: exit code 2 and one line naming the flags."""
    code = cg_main_code(["--data", str(text_file), "--reward_mode", "none", "--reference", "none"])
    assert code == 2
    assert "--reward_mode none" in capsys.readouterr().err


def cg_main_code(argv):
    try:
        cg.validate(cg.resolve_clip(cg.parse_config(cg.Config, argv)))
    except SystemExit as e:
        return e.code
    return 0


def direct_bigram_metrics(text, C, H, E):
    """eval/ metrics of the add-one bigram of the first 90% of text, counted with Counter on the same validation
    windows as the script's (sample_windows of the last 10%, seeded 0): the most likely next character (the first
    in sorted order on a tie), its bits per character, greedy rollouts and their spaces."""
    chars = sorted(set(text))
    V = len(chars)
    ids = [chars.index(c) for c in text]
    train = ids[: int(0.9 * len(ids))]
    pairs = Counter(zip(train[:-1], train[1:]))
    firsts = Counter(train[:-1])

    def p(a, b):
        return (pairs[a, b] + 1) / (firsts[a] + V)

    def best(a):
        return max(range(V), key=lambda b: (pairs[a, b], -b))

    torch.manual_seed(0)
    contexts, truth = cg.sample_windows(torch.tensor(ids[int(0.9 * len(ids)) :]), E, C, H)
    windows = torch.cat([contexts, truth], 1).tolist()
    hits, bits, n = 0, 0.0, 0
    greedy_hits, spaces = 0, 0
    for w in windows:
        for a, b in zip(w[:-1], w[1:]):
            hits += best(a) == b
            bits -= math.log2(p(a, b))
            n += 1
        a = w[C - 1]
        for t in range(H):
            a = best(a)
            greedy_hits += a == w[C + t]
            spaces += chars[a] == " "
    return {"next_token_acc": hits / n, "bpc": bits / n, "greedy_match": greedy_hits / (E * H),
            "greedy_space_frac": spaces / (E * H)}  # fmt: skip


def test_bigram_row_is_a_direct_count_of_the_text(tmp_path, monkeypatch):
    """--eval_reference on a small text: its final_results.json holds the direct count's four metrics, at step 0
    with nothing trained."""
    rng = random.Random(3)
    words = ["the", "a", "king", "and", "queen", "of", "to", "thee"]
    text = " ".join(rng.choice(words) for _ in range(900)) + "\n"
    path = tmp_path / "text.txt"
    path.write_text(text)
    out = tmp_path / "bigram"
    argv = ["--data", path, *TINY, "--horizon", 4, "--eval_size", 24, "--eval_reference", "--out_dir", out]
    assert run_in_process(argv, monkeypatch) == 0
    results = json.loads((out / "final_results.json").read_text())
    assert results["mode"] == "bigram" and results["steps"] == 0 and results["tokens"] == 0
    expected = direct_bigram_metrics(text, C=8, H=4, E=24)
    for name, value in expected.items():
        assert math.isclose(results[name], value, rel_tol=1e-5, abs_tol=1e-6), name
    assert 0 < expected["greedy_space_frac"] < 1  # the check would see a wrong space index


def test_the_default_holds_the_kl_from_the_first_step(tmp_path, text_file, monkeypatch):
    """The defaults (a constant beta of 0.5 to the bigram) run end to end: rl/beta is 0.5 from step 0, the KL term is
    in the loss, and the run folder is whole."""
    out = tmp_path / "run"
    assert run_in_process(["--data", text_file, *SMALL_RUN, "--max_steps", 2, "--out_dir", out], monkeypatch) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["beta_kl"] == 0.5 and config["kl_warmup_tokens"] == 0 and config["reference"] == "bigram"
    steps = [r for r in metrics(out) if "rl/beta" in r]
    assert [r["rl/beta"] for r in steps] == [0.5, 0.5]
    assert all(r["rl/kl"] != 0 for r in steps)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "ckpt.pt", "samples.txt"):
        assert (out / name).is_file()
