"""grpo.py, issue 30 (the variants of 2025-26): SAPO and LUSPO against hand-derived values, two-sided clipping
(--clip_delta), the high-entropy token mask (--top_entropy_quantile), off-policy sequence masking (--off_policy_mask)
and TR-DPO's reference sync (--ref_sync_steps, --ref_mixup): each function by hand and by its properties, each flag
end to end (in this process: no interpreter start), its bad values, and an exact resume with a synced reference."""

import json
import math

import pytest
import torch
from conftest import ROOT, char_checkpoint, metrics, run_main, run_main_until_sigterm, torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

import dpo
import grpo

FAST = settings(max_examples=40, deadline=None)
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32"]
NEXT = [*TINY, "--tokenizer", "char", "--context_len", "8", "--horizon", "4", "--batch_size", "4", "--group_size", "4"]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def hand_batch():
    """Sequence 0: 3 tokens, ratios 2, 1, 1, A = +2. Sequence 1: 1 token, ratio 0.5, A = -1 (then padding, whose
    ratios must not matter)."""
    old = torch.log(torch.tensor([[0.2, 0.5, 0.4, 0.3], [0.6, 0.3, 0.2, 0.1]]))
    ratio = torch.tensor([[2.0, 1.0, 1.0, 9.0], [0.5, 5.0, 0.1, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    return old + ratio.log(), old, torch.tensor([2.0, -1.0]), mask


# ------------------------------------------------------------------------------------------- policy_loss by hand


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_hand_values(tau_pos, tau_neg):
    """Per token -(4 / tau) sigmoid(tau (r - 1)) A, tau_pos where A > 0, tau_neg otherwise, then grpo's aggregation:
    sequence 0 (A = +2): (4/tp) (sigmoid(tp) 2 + sigmoid(0) 2 + sigmoid(0) 2) / 3; sequence 1 (A = -1, r = 0.5):
    -(4/tn) sigmoid(-tn/2); the mean of the two, negated. No clip: clip_frac 0."""
    logp, old, adv, mask = hand_batch()
    kw = dict(sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    loss, stats = grpo.policy_loss(logp, old, adv, mask, "sapo", **kw)
    seq0 = 4 / tau_pos * (sigmoid(tau_pos) * 2 + 0.5 * 2 + 0.5 * 2) / 3
    seq1 = 4 / tau_neg * sigmoid(-tau_neg / 2) * -1
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, rel=1e-5)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx((2 + 1 + 1 + 0.5) / 4)


def test_luspo_is_gspo_times_each_sequence_length_then_the_mean():
    """clip [0.8, 1.28]: sequence 0's ratio 2^(1/3) = 1.26 is inside, min(1.26 * 2, ...) = 2.52, times |o_0| = 3;
    sequence 1: min(0.5 * -1, 0.8 * -1) = -0.8, times |o_1| = 1. The mean over the 2 sequences, negated (gspo's would
    leave out the lengths). clip_frac counts sequences: 1 of 2."""
    logp, old, adv, mask = hand_batch()
    loss, stats = grpo.policy_loss(logp, old, adv, mask, "luspo", clip_eps=0.2, clip_eps_high=0.28)
    s0 = 2 ** (1 / 3)
    assert loss.item() == pytest.approx(-(3 * s0 * 2 + 1 * -0.8) / 2, rel=1e-5)
    gspo, _ = grpo.policy_loss(logp, old, adv, mask, "gspo", clip_eps=0.2, clip_eps_high=0.28)
    assert gspo.item() == pytest.approx(-(s0 * 2 - 0.8) / 2, rel=1e-5)
    assert stats["clip_frac"].item() == 0.5 and stats["ratio_mean"].item() == pytest.approx((s0 + 0.5) / 2)


def test_luspo_and_gspo_default_to_gspos_clip_range():
    """A length-normalised sequence ratio: luspo takes gspo's [1 - 3e-4, 1 + 4e-4], a given --clip_eps both ends."""
    for loss_type in ("gspo", "luspo"):
        cfg = grpo.resolve_clip(grpo.parse_config(grpo.Config, ["--loss_type", loss_type]))
        assert (cfg.clip_eps, cfg.clip_eps_high) == (3e-4, 4e-4)
    cfg = grpo.resolve_clip(grpo.parse_config(grpo.Config, ["--loss_type", "luspo", "--clip_eps", "0.1"]))
    assert (cfg.clip_eps, cfg.clip_eps_high) == (0.1, 0.1)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_clip_delta_caps_the_unclipped_ratio_of_a_negative_advantage(loss_type):
    """Sequence 0: ratios 5 and 1, A = -1; sequence 1: ratio 2, A = +1; clip 0.2, max_len 2. Without a cap the token
    of ratio 5 takes the unclipped branch, min(-5, -1.2) = -5, with its gradient; with clip_delta 3 it is
    min(min(5, 3) * -1, -1.2) = -3, held by the cap: no gradient, and clip_frac counts it. The other tokens: -1, and
    min(2, 1.2) = 1.2 (clipped either way). A cap of 0 or None is no cap."""
    old = torch.log(torch.tensor([[0.1, 0.3], [0.2, 0.4]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([-1.0, 1.0])
    total = {
        "grpo": lambda t: -((t[0] + t[1]) / 2 + t[2]) / 2,
        "dapo": lambda t: -sum(t) / 3,
        "dr_grpo": lambda t: -sum(t) / (2 * 2),
    }[loss_type]
    results = {}
    for delta in (None, 0, 3.0):
        logp = (old + torch.log(torch.tensor([[5.0, 1.0], [2.0, 1.0]]))).requires_grad_()
        loss, stats = grpo.policy_loss(logp, old, adv, mask, loss_type, clip_eps=0.2, max_len=2, clip_delta=delta)
        loss.backward()
        results[delta] = (loss.item(), stats["clip_frac"].item(), logp.grad[0, 0].item())
    assert results[None] == results[0]
    loss, clip_frac, grad = results[None]
    assert loss == pytest.approx(total([-5.0, -1.0, 1.2]), rel=1e-5) and clip_frac == pytest.approx(1 / 3)
    assert grad != 0
    loss, clip_frac, grad = results[3.0]
    assert loss == pytest.approx(total([-3.0, -1.0, 1.2]), rel=1e-5) and clip_frac == pytest.approx(2 / 3)
    assert grad == 0


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_sapo_gradient_at_ratio_one_is_the_plain_policy_gradient(N, T, seed):
    """At r = 1 the gate's slope is (4/tau) tau sigmoid'(0) = 1, whatever tau: d loss / d logp_it = -A_i / (N |o_i|),
    the policy gradient of grpo's aggregation, on every real token (0 on padding)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    x = logp.clone().requires_grad_()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, T, generator=g) < 0.7).double()
    mask[:, 0] = 1.0  # every sequence has a token
    tau_neg = 0.5 + 2 * torch.rand((), generator=g).item()
    loss, _ = grpo.policy_loss(x, logp.clone(), adv, mask, "sapo", sapo_tau_neg=tau_neg)
    loss.backward()
    expected = -adv[:, None] * mask / mask.sum(1, keepdim=True) / N
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ the masks


def test_high_entropy_mask_hand_values():
    """Ten real tokens of entropy 0.1 .. 1.0 and two padded ones of entropy 5: the 0.8 quantile of the real ones
    (linear interpolation at position 0.8 * 9 = 7.2) is 0.82, so quantile 0.2 keeps 0.9 and 1.0; padding never."""
    entropy = torch.tensor([[0.3, 0.9, 0.1, 5.0, 0.5, 0.7], [1.0, 0.2, 0.4, 0.6, 0.8, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    kept = grpo.high_entropy_mask(entropy, mask, 0.2)
    assert kept.tolist() == [[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert grpo.high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).sum() == 0  # no real token: none kept


@FAST
@given(st.integers(1, 6), st.integers(1, 8), st.floats(0.01, 1.0), st.integers(0, 10_000))
def test_high_entropy_mask_keeps_the_top_tokens_and_every_token_at_quantile_one(N, T, quantile, seed):
    """Only real tokens are kept, at least one when there is one, every kept entropy is >= every dropped real one
    (ties included: entropies drawn from few values), and quantile 1 keeps every real token."""
    g = torch.Generator().manual_seed(seed)
    entropy = torch.randint(0, 4, (N, T), generator=g).float() / 3
    mask = (torch.rand(N, T, generator=g) < 0.7).float()
    kept = grpo.high_entropy_mask(entropy, mask, quantile)
    assert ((kept == 0) | (mask == 1)).all()
    assert kept.sum() >= min(1, mask.sum())
    dropped = (kept == 0) & (mask == 1)
    if kept.any() and dropped.any():
        assert entropy[kept > 0].min() >= entropy[dropped].max()
    assert torch.equal(grpo.high_entropy_mask(entropy, mask, 1.0), mask)


def test_off_policy_mask_hand_values():
    """Mean over real tokens of old_logp - logp: sequence 0 (A < 0): (0.3 + 0.1) / 2 = 0.2 > 0.15, dropped;
    sequence 1 (A < 0): 0.1 <= 0.15, kept; sequence 2 (A > 0): 0.5, kept (a positive advantage always is); sequence 3
    (A < 0): its padded token's drift of 9 does not count, kept. Per-token advantages: the sign of their sum."""
    old = torch.zeros(4, 2)
    logp = -torch.tensor([[0.3, 0.1], [0.1, 0.1], [0.5, 0.5], [0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([-1.0, -2.0, 1.0, -1.0])
    expected = [[0.0], [1.0], [1.0], [1.0]]
    assert grpo.off_policy_mask(adv, logp, old, mask, 0.15).tolist() == expected
    per_token = adv[:, None] * torch.tensor([1.0, 0.5])  # (N, T): the same signs
    assert grpo.off_policy_mask(per_token, logp, old, mask, 0.15).tolist() == expected


@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_off_policy_mask_never_drops_a_positive_advantage(N, T, threshold, seed):
    """(N, 1) of 0 and 1; a sequence is dropped exactly when its advantage is negative and its mean drift exceeds
    the threshold, so a positive (or zero) advantage is never dropped, whatever the drift."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(N, generator=g)
    logp = -torch.rand(N, T, generator=g) * 2
    old = -torch.rand(N, T, generator=g) * 2
    mask = (torch.rand(N, T, generator=g) < 0.7).float()
    kept = grpo.off_policy_mask(adv, logp, old, mask, threshold)
    assert kept.shape == (N, 1) and set(kept.flatten().tolist()) <= {0.0, 1.0}
    assert (kept[adv >= 0] == 1).all()
    drift = ((old - logp) * mask).sum(1) / mask.sum(1).clamp(min=1)
    assert torch.equal(kept[:, 0] == 0, (adv < 0) & (drift > threshold))


# --------------------------------------------------------------------------------------------- reference sync


def tiny_gpt(seed):
    torch.manual_seed(seed)
    return grpo.GPT(grpo.GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8))


@FAST
@given(st.floats(0.0, 1.0), st.integers(0, 1000))
def test_sync_reference_is_alpha_policy_plus_one_minus_alpha_reference(alpha, seed):
    """Every weight of the reference becomes alpha p + (1 - alpha) r: alpha 1 copies the policy exactly, alpha 0
    leaves the reference as it was; the policy is untouched. grpo.py's function is dpo.py's."""
    ref = tiny_gpt(seed)
    policy = tiny_gpt(seed + 1)
    r0 = {k: v.clone() for k, v in ref.state_dict().items()}
    p0 = {k: v.clone() for k, v in policy.state_dict().items()}
    grpo.sync_reference(ref, policy, alpha)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(v, alpha * p0[k] + (1 - alpha) * r0[k], rtol=0, atol=1e-6)
        assert torch.equal(policy.state_dict()[k], p0[k])
    grpo.sync_reference(ref, policy, 1.0)
    assert all(torch.equal(v, p0[k]) for k, v in ref.state_dict().items())
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    grpo.sync_reference(ref, tiny_gpt(seed + 2), 0.0)
    assert all(torch.equal(v, before[k]) for k, v in ref.state_dict().items())
    assert grpo.sync_reference.__doc__ == dpo.sync_reference.__doc__


# ------------------------------------------------------------------------------------------- flags end to end


def train_rows(out_dir):
    return [r for r in metrics(out_dir) if "train/loss" in r]


def spy(monkeypatch, name):
    """Wrap grpo.<name>: every call's arguments and result, in order."""
    calls = []
    original = getattr(grpo, name)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(grpo, name, wrapped)
    return calls


def arithmetic_args(tmp_path, monkeypatch):
    """A tiny random char model on arithmetic, rewarded by the completion's length (every group has signal)."""
    monkeypatch.setattr(grpo, "arithmetic_reward", lambda text, answer, format_reward=0.0: float(len(text)))
    init = char_checkpoint(tmp_path / "init.pt", grpo.ARITHMETIC_CHARS)
    args = ["--task", "arithmetic", "--init_from", init, "--horizon", "4", "--batch_size", "4", "--group_size", "4"]
    return [*args, "--lr", "3e-2", "--warmup_steps", "0", "--eval_size", "4", "--eval_every", "100"]


@pytest.mark.parametrize("loss_type", ["sapo", "luspo"])
def test_sapo_and_luspo_runs_pass_their_settings_to_policy_loss(tmp_path, monkeypatch, loss_type):
    """--loss_type sapo with its temperatures, and luspo (gspo's clip range, recorded in config.json), train."""
    losses = spy(monkeypatch, "policy_loss")
    out = tmp_path / "run"
    args = [
        *arithmetic_args(tmp_path, monkeypatch),
        "--loss_type",
        loss_type,
        "--sapo_tau_pos",
        "2",
        "--sapo_tau_neg",
        "3",
    ]
    run_main(grpo, monkeypatch, *args, "--max_steps", "1", "--out_dir", out)
    assert all(a[4] == loss_type and kw["sapo_tau_pos"] == 2 and kw["sapo_tau_neg"] == 3 for a, kw, _ in losses)
    assert len(losses) == 1 and math.isfinite(train_rows(out)[0]["train/loss"])
    config = json.loads((out / "config.json").read_text())
    expected = (3e-4, 4e-4) if loss_type == "luspo" else (0.2, 0.2)
    assert (config["clip_eps"], config["clip_eps_high"]) == expected


def test_clip_delta_run_passes_the_cap(tmp_path, monkeypatch):
    losses = spy(monkeypatch, "policy_loss")
    args = [*arithmetic_args(tmp_path, monkeypatch), "--loss_type", "dapo", "--clip_delta", "1.5"]
    run_main(grpo, monkeypatch, *args, "--num_iterations", "2", "--max_steps", "1", "--out_dir", tmp_path / "run")
    assert len(losses) == 2 and all(kw["clip_delta"] == 1.5 for _, kw, _ in losses)


def test_top_entropy_quantile_ranks_the_sampling_distributions_entropy(tmp_path, text_file, monkeypatch):
    """--top_entropy_quantile 0.25 at --temperature 0.5, 2 iterations of 2 micro-batches of 8 completions: the
    entropies ranked are H(softmax(logits / 0.5)) of the weights that sampled the batch (float64 here), one ranking per
    micro-batch in the first iteration; in both iterations the policy term's advantages are 0 exactly on the dropped
    tokens and unchanged on the kept ones, and rl/entropy_mask_frac is the kept share of the real tokens."""
    sampled = []
    collect = grpo.collect

    def recording_collect(task, raw, *args):
        weights = {k: v.detach().clone() for k, v in raw.state_dict().items()}
        batch = collect(task, raw, *args)
        sampled.append((raw.config, weights, batch))
        return batch

    monkeypatch.setattr(grpo, "collect", recording_collect)
    masks = spy(monkeypatch, "high_entropy_mask")
    advantages = spy(monkeypatch, "compute_advantages")
    losses = spy(monkeypatch, "policy_loss")
    out = tmp_path / "run"
    args = ["--data", text_file, *NEXT, "--temperature", "0.5", "--reference", "none", "--max_steps", "1"]
    args += ["--top_entropy_quantile", "0.25", "--num_iterations", "2", "--grad_accum", "2"]
    run_main(grpo, monkeypatch, *args, "--eval_size", "4", "--out_dir", out)
    config, weights, batch = sampled[0]
    model = grpo.GPT(config).double()
    model.load_state_dict(weights)
    seq = torch.cat([torch.tensor(batch["prompts"]), batch["completion"]], 1)  # next_token prompts: no padding
    with torch.no_grad():
        logq = torch.log_softmax(model(seq[:, :-1])[0][:, -4:] / 0.5, -1)  # (16, 4, V)
    expected = -(logq.exp() * logq).sum(-1)  # (16, 4)
    assert len(masks) == 2 and all(a[2] == 0.25 for a, _, _ in masks)
    ranked = torch.cat([a[0] for a, _, _ in masks])  # (16, 4): both micro-batches, in order
    torch.testing.assert_close(ranked.double(), expected, rtol=0, atol=1e-5)
    kept = torch.cat([m for _, _, m in masks])  # (16, 4)
    adv = advantages[0][2]  # (16, 4): process advantages
    assert len(losses) == 4  # iteration 0: micro-batches 0, 1; iteration 1: 0, 1
    for i, (a, _, _) in enumerate(losses):
        rows = slice(8 * (i % 2), 8 * (i % 2) + 8)
        assert torch.equal(a[2], adv[rows] * kept[rows])
    share = (kept.sum() / 64).item()
    assert 0 < share < 1 and train_rows(out)[0]["rl/entropy_mask_frac"] == pytest.approx(share)


def test_without_the_flags_every_real_token_and_sequence_trains(tmp_path, text_file, monkeypatch):
    """The defaults (quantile 1, no off-policy threshold) leave the advantages as they are: nothing ranked, nothing
    dropped, rl/entropy_mask_frac 1 and rl/off_policy_masked_frac 0."""
    masks = spy(monkeypatch, "high_entropy_mask")
    advantages = spy(monkeypatch, "compute_advantages")
    losses = spy(monkeypatch, "policy_loss")
    out = tmp_path / "run"
    args = ["--data", text_file, *NEXT, "--reference", "none", "--max_steps", "1", "--num_iterations", "2"]
    run_main(grpo, monkeypatch, *args, "--eval_size", "4", "--out_dir", out)
    assert not masks and all(torch.equal(a[2], advantages[0][2]) for a, _, _ in losses)
    row = train_rows(out)[0]
    assert row["rl/entropy_mask_frac"] == 1.0 and row["rl/off_policy_masked_frac"] == 0.0


def test_off_policy_mask_drops_drifted_negative_sequences_after_the_first_iteration(tmp_path, monkeypatch):
    """--num_iterations 3 at lr 3e-2, --off_policy_mask 1e-3: the first iteration's policy is the sampler (nothing
    dropped); later ones drop negative-advantage sequences whose mean drift exceeds 1e-3, and exactly those: the
    advantages policy_loss receives are the batch's, masked, times off_policy_mask's (N, 1) mask. The logged share is
    the last iteration's dropped sequences over all of the step's."""
    masks = spy(monkeypatch, "off_policy_mask")
    advantages = spy(monkeypatch, "compute_advantages")
    losses = spy(monkeypatch, "policy_loss")
    out = tmp_path / "run"
    args = [*arithmetic_args(tmp_path, monkeypatch), "--off_policy_mask", "1e-3", "--num_iterations", "3"]
    run_main(grpo, monkeypatch, *args, "--max_steps", "1", "--out_dir", out)
    assert len(masks) == len(losses) == 3 and all(a[4] == 1e-3 for a, _, _ in masks)
    adv = advantages[0][2]  # (16, H): one advantage per sequence, on each of its tokens
    for (a, _, dropped), (b, _, _) in zip(masks, losses):
        assert torch.equal(a[0], adv)
        assert torch.equal(b[2], adv * a[3] * dropped)  # (16, H): masked tokens and dropped sequences are 0
        assert (dropped[adv[:, :1] >= 0] == 1).all()
    assert (masks[0][2] == 1).all()  # no update yet: no drift
    last = masks[-1][2]
    assert (last == 0).any()
    assert train_rows(out)[0]["rl/off_policy_masked_frac"] == pytest.approx((last == 0).float().mean().item())


@pytest.mark.slow
def test_ref_sync_steps_moves_the_reference_and_the_kl_follows(tmp_path, monkeypatch):
    """--ref_sync_steps 1 --ref_mixup 1: after every step the reference is a copy of the policy, so ckpt.pt's reference
    equals its policy, and the second step's KL (its rollouts' policy against that copy) is 0 where it is not
    without the sync. --ref_mixup 0.5: the reference after one step is the mean of the initial and the new policy."""
    base = [*arithmetic_args(tmp_path, monkeypatch), "--reference", "init", "--beta_kl", "0.1", "--max_steps", "2"]
    for name, extra in [("plain", []), ("copy", ["--ref_sync_steps", "1", "--ref_mixup", "1"])]:
        run_main(grpo, monkeypatch, *base, *extra, "--out_dir", tmp_path / name)
    ckpt = torch.load(tmp_path / "copy" / "ckpt.pt", weights_only=True)
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in ckpt["reference"].items())
    assert abs(train_rows(tmp_path / "copy")[1]["rl/kl"]) < 1e-5
    assert abs(train_rows(tmp_path / "plain")[1]["rl/kl"]) > 1e-4
    base[base.index("--max_steps") + 1] = "1"
    run_main(grpo, monkeypatch, *base, "--ref_sync_steps", "1", "--ref_mixup", "0.5", "--out_dir", tmp_path / "half")
    ckpt = torch.load(tmp_path / "half" / "ckpt.pt", weights_only=True)
    init = torch.load(tmp_path / "init.pt", weights_only=True)["model"]
    for k, v in ckpt["reference"].items():
        torch.testing.assert_close(v, (init[k] + ckpt["model"][k]) / 2, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_resume_with_ref_sync_steps_matches_the_uninterrupted_run(tmp_path, monkeypatch):
    """A SIGTERM after 3 of 6 steps with the reference synced every 2 steps (alpha 0.5): ckpt.pt holds the synced
    reference, and --resume continues to exactly the uninterrupted run's metrics (its KL, and so its losses, read
    that reference)."""
    args = [*arithmetic_args(tmp_path, monkeypatch), "--reference", "init", "--beta_kl", "0.1"]
    args += ["--ref_sync_steps", "2", "--ref_mixup", "0.5", "--max_steps", "6", "--eval_every", "3"]
    run_main(grpo, monkeypatch, *args, "--out_dir", tmp_path / "full")
    run_main_until_sigterm(grpo, monkeypatch, 3, *args, "--out_dir", tmp_path / "part")
    saved = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)["reference"]
    init = torch.load(tmp_path / "init.pt", weights_only=True)["model"]
    assert any(not torch.equal(v, init[k]) for k, v in saved.items())  # synced after step 2: not the initial one
    run_main(grpo, monkeypatch, "--resume", "--out_dir", tmp_path / "part")
    assert metrics(tmp_path / "part") == metrics(tmp_path / "full")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_every_new_flag_under_two_gloo_ranks(tmp_path, parallel):
    """torchrun with 2 CPU ranks and every flag at once: the entropy ranking gathers both ranks' tokens (a collective
    per micro-batch), and under FSDP sync_reference gathers each sharded weight whole: with --ref_mixup 1 the saved
    reference equals the saved policy."""
    init = char_checkpoint(tmp_path / "init.pt", grpo.ARITHMETIC_CHARS)
    out = tmp_path / "run"
    args = ["--task", "arithmetic", "--init_from", init, "--horizon", "4", "--batch_size", "2", "--group_size", "4"]
    args += ["--loss_type", "sapo", "--top_entropy_quantile", "0.5", "--off_policy_mask", "1e-3", "--grad_accum", "2"]
    args += ["--num_iterations", "2", "--reference", "init", "--ref_sync_steps", "1", "--ref_mixup", "1"]
    args += ["--eval_size", "8", "--max_steps", "2", "--out_dir", out]
    proc = torchrun(ROOT / "grpo.py", 2, "--device", "cpu", "--parallel", parallel, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in ckpt["reference"].items())
    assert all(0.5 <= r["rl/entropy_mask_frac"] < 1 for r in train_rows(out))


NO_CAP = ("gspo", "luspo", "cispo", "sapo", "reinforce")  # losses --clip_delta does not act on


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--top_entropy_quantile", "0"], "must be in (0, 1]"),
        (["--top_entropy_quantile", "1.5"], "must be in (0, 1]"),
        (["--off_policy_mask", "-0.1"], "--off_policy_mask must be >= 0"),
        (["--clip_delta", "-1"], "--clip_delta must be >= 0"),
        (["--sapo_tau_pos", "0"], "--sapo_tau_pos must be positive"),
        (["--sapo_tau_neg", "-1"], "--sapo_tau_neg must be positive"),
        (["--ref_mixup", "1.5"], "--ref_mixup must be in [0, 1]"),
        (["--ref_mixup", "-0.5"], "--ref_mixup must be in [0, 1]"),
        (["--ref_sync_steps", "-1"], "--ref_sync_steps must be >= 0"),
        (["--ref_sync_steps", "2"], "--reference init"),  # next_token from scratch: the bigram table
        (["--ref_sync_steps", "2", "--reference", "none"], "--reference init"),
        # a sequence loss averages a completion's advantages: the entropy mask would not pick token gradients
        (["--loss_type", "gspo", "--top_entropy_quantile", "0.5"], "--top_entropy_quantile acts on token losses"),
        (["--loss_type", "luspo", "--top_entropy_quantile", "0.2"], "--loss_type luspo averages"),
        # the cap acts only on the clipped min of grpo, dapo and dr_grpo
        *[(["--loss_type", t, "--clip_delta", "3"], f"not --loss_type {t}") for t in NO_CAP],
        # at or below the upper clip: tokens with A > 0 and a ratio in (delta, 1 + eps] would get no gradient
        (["--clip_delta", "1.2"], "above the upper clip 1 + eps (1.2)"),
        (["--clip_delta", "1.1"], "above the upper clip 1 + eps (1.2)"),
        (["--loss_type", "dapo", "--clip_eps_high", "0.28", "--clip_delta", "1.25"], "1 + eps (1.28)"),
        (["--loss_type", "dr_grpo", "--clip_eps", "0.3", "--clip_delta", "1.3"], "1 + eps (1.3)"),
        # over-optimisation is measured as KL to the initial policy, which TR-DPO's moving reference would replace
        (["--task", "arithmetic", "--reward_model", "rm.pt", "--ref_sync_steps", "2"], "--ref_sync_steps with"),
    ],
)
def test_bad_values_of_the_new_flags_exit_2_with_one_line(tmp_path, text_file, args, needle, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(grpo, monkeypatch, "--data", text_file, *NEXT, "--out_dir", tmp_path / "run", *args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run" / "ckpt.pt").exists()
