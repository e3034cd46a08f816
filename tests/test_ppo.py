"""ppo.py: GAE against plain loops and its limits (Monte Carlo, TD), whitening, the clipped policy loss (dual clip
included) and the clipped value loss by hand, the Ziegler KL controller, where rewards are placed, what the value
model sees, the sampling distribution of every log-prob (temperature, top-k), and
end-to-end runs of the three tasks (run folder, exact resume float16 included, --vf_coef with a separate value model,
torchrun DDP and FSDP, bad input, learning)."""

import json
import math
import signal
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, char_checkpoint, hh_file, metrics, run_main, run_main_until_sigterm, run_script, torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt
import ppo

TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "32", "--tokenizer", "char"]
NEXT = [*TINY, "--context_len", "8", "--horizon", "4", "--batch_size", "8", "--num_minibatches", "2"]
FAST = settings(max_examples=40, deadline=None)


def prefix_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()  # (N, T)


# ------------------------------------------------------------------------------------------------------------ GAE


def gae_loop(rewards, values, length, gamma, lam):
    """GAE of one row in plain Python: real tokens 0..length-1, the state after the last one terminal (value 0)."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        adv[t] = last
    return adv, [adv[t] + (values[t] if t < length else 0.0) for t in range(len(rewards))]


rows_strategy = st.integers(1, 4).flatmap(
    lambda T: st.lists(
        st.tuples(
            st.lists(st.floats(-5, 5), min_size=T, max_size=T),
            st.lists(st.floats(-5, 5), min_size=T, max_size=T),
            st.integers(1, T),
        ),
        min_size=1,
        max_size=4,
    )
)


@FAST
@given(rows_strategy, st.floats(0, 1), st.floats(0, 1))
def test_gae_equals_a_plain_reference_loop(rows, gamma, lam):
    rewards = torch.tensor([r for r, _, _ in rows], dtype=torch.float64)
    values = torch.tensor([v for _, v, _ in rows], dtype=torch.float64)
    mask = prefix_mask([n for _, _, n in rows], rewards.size(1))
    adv, returns = ppo.gae(rewards, values, mask, gamma, lam)
    for i, (r, v, n) in enumerate(rows):
        want_adv, want_ret = gae_loop(r, v, n, gamma, lam)
        assert adv[i].tolist() == pytest.approx(want_adv, abs=1e-9)
        assert returns[i].tolist() == pytest.approx(want_ret, abs=1e-9)


@FAST
@given(rows_strategy, st.floats(0, 1))
def test_gae_with_lambda_1_is_discounted_monte_carlo_return_minus_value(rows, gamma):
    """lam = 1: A_t = sum_k>=t gamma^(k-t) r_k - V_t, and the return target is the Monte Carlo return itself."""
    rewards = torch.tensor([r for r, _, _ in rows], dtype=torch.float64)
    values = torch.tensor([v for _, v, _ in rows], dtype=torch.float64)
    mask = prefix_mask([n for _, _, n in rows], rewards.size(1))
    adv, returns = ppo.gae(rewards, values, mask, gamma, 1.0)
    for i, (r, v, n) in enumerate(rows):
        mc = [sum(gamma ** (k - t) * r[k] for k in range(t, n)) for t in range(n)]
        assert returns[i, :n].tolist() == pytest.approx(mc, abs=1e-9)
        assert adv[i, :n].tolist() == pytest.approx([mc[t] - v[t] for t in range(n)], abs=1e-9)


@FAST
@given(rows_strategy, st.floats(0, 1))
def test_gae_with_lambda_0_is_the_one_step_td_error(rows, gamma):
    """lam = 0: A_t = r_t + gamma V_t+1 - V_t (V = 0 after the last token); gamma = lam = 0 leaves r_t - V_t."""
    rewards = torch.tensor([r for r, _, _ in rows], dtype=torch.float64)
    values = torch.tensor([v for _, v, _ in rows], dtype=torch.float64)
    mask = prefix_mask([n for _, _, n in rows], rewards.size(1))
    for g in (gamma, 0.0):
        adv, _ = ppo.gae(rewards, values, mask, g, 0.0)
        for i, (r, v, n) in enumerate(rows):
            td = [r[t] + g * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
            assert adv[i, :n].tolist() == pytest.approx(td, abs=1e-9)


def test_gae_masked_tail_does_not_leak_into_real_positions():
    """Rewards and values on padding (even huge ones) change nothing, and advantages and returns there are 0."""
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = prefix_mask([2, 6, 4], 6).float()
    adv, returns = ppo.gae(rewards, values, mask, 0.9, 0.8)
    noisy_r = torch.where(mask > 0, rewards, torch.full_like(rewards, 1e6))
    noisy_v = torch.where(mask > 0, values, torch.full_like(values, -1e6))
    adv2, returns2 = ppo.gae(noisy_r, noisy_v, mask, 0.9, 0.8)
    assert torch.equal(adv, adv2) and torch.equal(returns, returns2)
    assert (adv[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()
    # a row's last real token sees no bootstrap: A = r - V there
    assert adv[0, 1].item() == pytest.approx((rewards[0, 1] - values[0, 1]).item(), abs=1e-6)


# ------------------------------------------------------------------------------------------------------- whitening


@FAST
@given(st.integers(2, 12), st.integers(0, 10_000), st.booleans())
def test_whiten_gives_masked_mean_0_and_unbiased_variance_1_and_ignores_padding(n_real, seed, shift_mean):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.zeros(3, 6, dtype=torch.float64)
    mask.view(-1)[torch.randperm(18, generator=gen)[:n_real]] = 1.0
    w = ppo.whiten(x, mask, shift_mean=shift_mean)
    real = w[mask > 0]
    x_real = x[mask > 0]
    v = x_real.var(unbiased=True).item()
    assert real.var(unbiased=True).item() == pytest.approx(v / (v + 1e-8), rel=1e-9)  # 1 up to eps
    assert real.mean().item() == pytest.approx(0.0 if shift_mean else x_real.mean().item(), abs=1e-9)
    padded = torch.where(mask > 0, x, torch.randn(3, 6, generator=gen, dtype=torch.float64) * 1e6)
    assert torch.equal(ppo.whiten(padded, mask, shift_mean=shift_mean), w)
    assert (w[mask == 0] == 0).all()


# ------------------------------------------------------------------------------------------------------- the losses


def test_ppo_policy_loss_at_ratio_1_is_minus_the_mean_advantage_with_the_reinforce_gradient():
    """logp == old_logp: every ratio is 1, nothing clips, the loss is -mean_t A_t and d loss / d logp_t = -A_t / n, the
    REINFORCE gradient."""
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = prefix_mask([5, 2, 3], 5)
    loss, stats = ppo.ppo_policy_loss(logp, logp.detach().clone(), adv, mask, clip_eps=0.2, dual_clip=3.0)
    n = mask.sum()
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / n.item())
    loss.backward()
    assert torch.allclose(logp.grad, -adv * mask / n)
    assert stats["clip_frac"].item() == 0 and stats["approx_kl"].item() == 0 and stats["ratio_mean"].item() == 1


def test_ppo_policy_loss_clips_hand_made_ratios_for_both_signs_and_dual_clip():
    """clip_eps 0.2, token terms max(-A r, -A clip(r)):
    r 1.5, A +1 -> -1.2 (clipped)   r 0.5, A +1 -> -0.5          r 1.5, A -1 -> 1.5
    r 0.5, A -1 -> 0.8 (clipped)    r 4, A -1 -> 4 (dual clip 3: 3)   r 4, A +1 -> -1.2 (clipped); padding ignored.
    Clipped tokens have no gradient; the unclipped ones have -A r."""
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 4.0, 4.0, 50.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    old = torch.log(torch.full_like(ratio, 0.01))
    for dual_clip, big in ((None, 4.0), (3.0, 3.0)):
        logp = (old + ratio.log()).requires_grad_()
        loss, stats = ppo.ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=dual_clip)
        assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 + big - 1.2) / 6)
        assert stats["clip_frac"].item() == pytest.approx(3 / 6)
        assert stats["dual_clip_frac"].item() == pytest.approx(0 if dual_clip is None else 1 / 6)
        real = ratio[0, :6]
        assert stats["approx_kl"].item() == pytest.approx(((real - 1) - real.log()).mean().item())
        loss.backward()
        want = [0.0, -0.5 / 6, 1.5 / 6, 0.0, 4.0 / 6 if dual_clip is None else 0.0, 0.0, 0.0]
        assert logp.grad[0].tolist() == pytest.approx(want)


def test_value_loss_hand_values_for_clipped_and_unclipped_branches():
    """eps 0.2; (V, V_old, G) -> max((V - G)^2, (clip(V, V_old +- 0.2) - G)^2):
    (1.0, 0.5, 2.0): 1 vs (0.7 - 2)^2 = 1.69 -> 1.69      (1.0, 0.9, 0.0): inside the range -> 1
    (0.0, 0.5, 0.0): 0 vs 0.3^2 = 0.09 -> 0.09            (0.5, 1.0, 2.0): 2.25 vs (0.8 - 2)^2 = 1.44 -> 2.25
    times 0.5, mean over the real tokens; unclipped (eps 0 or None) it is half the mean squared error."""
    values = torch.tensor([[1.0, 1.0, 0.0, 0.5, 9.0]]).requires_grad_()
    old = torch.tensor([[0.5, 0.9, 0.5, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss = ppo.value_loss(values, old, returns, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1 + 0.09 + 2.25) / 4)
    loss.backward()  # the clipped branches (tokens 0 and 2) pass no gradient to V
    assert values.grad[0].tolist() == pytest.approx([0.0, 2 * 1.0 * 0.5 / 4, 0.0, 2 * -1.5 * 0.5 / 4, 0.0])
    for eps in (0.0, None):
        plain = ppo.value_loss(values, old, returns, mask, eps)
        assert plain.item() == pytest.approx(0.5 * (1 + 1 + 0 + 2.25) / 4)


@FAST
@given(st.integers(1, 6), st.integers(0, 10_000))
def test_losses_split_over_micro_batches_with_the_global_token_count_sum_to_the_whole(cut, seed):
    """With num_tokens = the whole batch's count, the policy and value losses (and their gradients) of two parts add
    up to those of the whole batch, however unevenly the tokens are split."""
    gen = torch.Generator().manual_seed(seed)
    N, T = 7, 5
    logp = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(N, T, generator=gen, dtype=torch.float64)
    adv, returns = torch.randn(N, T, generator=gen, dtype=torch.float64), torch.randn(N, T, generator=gen)
    values, old_v = torch.randn(N, T, generator=gen), torch.randn(N, T, generator=gen)
    mask = prefix_mask(torch.randint(1, T + 1, (N,), generator=gen).tolist(), T)

    def losses(lp, v, rows, n=None):
        pg, _ = ppo.ppo_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], 0.2, 3.0, num_tokens=n)
        return pg + ppo.value_loss(v[rows], old_v[rows], returns[rows], mask[rows].float(), 0.2, num_tokens=n)

    lp1, v1 = logp.clone().requires_grad_(), values.clone().requires_grad_()
    whole = losses(lp1, v1, slice(None))
    whole.backward()
    lp2, v2 = logp.clone().requires_grad_(), values.clone().requires_grad_()
    parts = sum(losses(lp2, v2, rows, mask.sum()) for rows in (slice(0, cut), slice(cut, N)))
    parts.backward()
    assert torch.allclose(whole, parts.to(whole.dtype)) and torch.allclose(lp1.grad, lp2.grad)
    assert torch.allclose(v1.grad, v2.grad, atol=1e-6)


def test_adaptive_kl_controller_follows_ziegler_on_a_hand_computed_sequence():
    """target 6, horizon 10000, from 0.1: error = clip(KL / 6 - 1, -0.2, 0.2), value *= 1 + error * n / 10000.
    KL 9 (error 0.5 -> 0.2), n 1000: 0.1 * 1.02 = 0.102; KL 6: unchanged; KL 3 (-0.5 -> -0.2), n 5000: * 0.9;
    KL 5.4 (-0.1), n 2000: * 0.98."""
    ctl = ppo.AdaptiveKLController(0.1, 6.0, 10000)
    seen = []
    for kl, n in ((9.0, 1000), (6.0, 1000), (3.0, 5000), (5.4, 2000)):
        ctl.update(kl, n)
        seen.append(ctl.value)
    assert seen == pytest.approx([0.102, 0.102, 0.102 * 0.9, 0.102 * 0.9 * 0.98])


def test_rewards_place_sequence_scores_at_the_last_real_token_and_subtract_the_kl_everywhere():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    kl = torch.tensor([[0.5, -1.0, 2.0, 9.0], [1.0, 9.0, 9.0, 9.0]])
    scores, reward_mask = ppo.at_last_token(torch.tensor([3.0, -2.0]), mask)  # an outcome reward on its last token
    assert reward_mask.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    got = ppo.ppo_rewards(scores, kl, mask, 0.1)
    assert torch.allclose(got, torch.tensor([[-0.05, 0.1, 3 - 0.2, 0], [-2 - 0.1, 0, 0, 0]]))
    dense = torch.tensor([[1.0, 0.0, 1.0, 5.0], [0.0, 5.0, 5.0, 5.0]])  # next_token: per-token task rewards
    got = ppo.ppo_rewards(dense, kl, mask, 0.1)
    assert torch.allclose(got, torch.tensor([[0.95, 0.1, 0.8, 0], [-0.1, 0, 0, 0]]))


# ------------------------------------------------------------------------------------------------ the value models


def tiny_models(seed=0):
    torch.manual_seed(seed)
    config = ppo.GPTConfig(block_size=16, vocab_size=13, n_layer=2, n_head=2, n_embd=16)
    policy = ppo.GPT(config)
    critic = ppo.RewardModel(config)
    torch.nn.init.normal_(critic.head.weight)
    shared = ppo.PolicyWithValueHead(policy)
    torch.nn.init.normal_(shared.value_head.weight)
    return policy, critic, shared


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_the_value_of_token_t_is_read_before_it_and_never_sees_it(value_model):
    """V(s_t) is read at the position that predicts o_t: changing o_t changes the values of later tokens only, and the
    log-prob of o_t itself; both value models agree on the policy's log-probs."""
    policy, critic, shared = tiny_models()
    actor, crit = (policy, critic) if value_model == "separate" else (shared, None)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 13, (3, 10), generator=gen)  # 6 prompt tokens, H = 4 completion tokens
    H, t = 4, 2
    cfg = ppo.Config(horizon=H)
    logp, _, values = ppo.logprobs_and_values(actor, crit, seq, None, cfg)
    changed = seq.clone()
    changed[:, 6 + t] = (changed[:, 6 + t] + 1) % 13
    logp2, _, values2 = ppo.logprobs_and_values(actor, crit, changed, None, cfg)
    assert torch.equal(values[:, : t + 1], values2[:, : t + 1]) and not torch.equal(values[:, t + 1], values2[:, t + 1])
    assert torch.equal(logp[:, :t], logp2[:, :t]) and not torch.equal(logp[:, t], logp2[:, t])
    assert torch.allclose(logp, ppo.completion_logprobs(policy, seq, None, H)[0], atol=1e-6)


def test_the_shared_value_model_samples_exactly_as_its_policy():
    """PolicyWithValueHead stands in for the GPT when sampling and evaluating: the same logits, the same tokens, the
    same log-probs and entropies from completion_logprobs (the reward-model task's evaluation)."""
    policy, _, shared = tiny_models()
    idx = torch.randint(0, 13, (4, 5))
    assert torch.equal(shared(idx)[0], policy(idx)[0])
    for a, b in zip(
        ppo.completion_logprobs(shared, idx, None, 3, True), ppo.completion_logprobs(policy, idx, None, 3, True)
    ):
        assert torch.equal(a, b)
    a = ppo.generate(policy, idx, 6, generator=torch.Generator().manual_seed(0))
    b = ppo.generate(shared, idx, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------------- the sampling distribution


def first_step(tmp_path, monkeypatch, text_file, *args):
    """Runs ppo.main() in this process for one step of one epoch of one minibatch (one update), and returns what it
    saw: the rollout batch, the policy's logits (float64) at the completion positions before any update, the first
    ppo_policy_loss call's (logp, old_logp, stats) and the step's logged metrics."""
    seen = {}
    real_rollout, real_loss = ppo.rollout, ppo.ppo_policy_loss

    def rollout(run):
        batch = real_rollout(run)
        with torch.no_grad():
            seen["logits"] = run.actor(batch["seq"][:, :-1], keep_last=run.cfg.horizon)[0].double()  # (N, H, V)
        seen["batch"] = batch
        return batch

    def policy_loss(logp, old_logp, *rest):
        loss, stats = real_loss(logp, old_logp, *rest)
        seen.setdefault("update", (logp.detach(), old_logp, stats))
        return loss, stats

    monkeypatch.setattr(ppo, "rollout", rollout)
    monkeypatch.setattr(ppo, "ppo_policy_loss", policy_loss)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's SIGTERM/SIGINT handlers would outlive it here
    argv = ["--data", text_file, *NEXT, "--num_minibatches", "1", "--ppo_epochs", "1", "--max_steps", "1"]
    argv += ["--eval_size", "8", "--device", "cpu", "--dtype", "float32", "--out_dir", tmp_path / "run", *args]
    monkeypatch.setattr(sys, "argv", ["ppo.py", *map(str, argv)])
    ppo.main()
    seen["metrics"] = [r for r in metrics(tmp_path / "run") if "train/loss" in r][0]
    return seen


def truncated_logprobs(logits, temperature, top_k):
    """log softmax(logits / temperature) with every logit below the top_k-th largest removed (float64 oracle)."""
    z = logits / temperature
    kth = z.topk(top_k, dim=-1).values[..., -1:]
    return torch.log_softmax(z.masked_fill(z < kth, float("-inf")), -1)


@pytest.mark.slow
def test_logged_entropy_is_that_of_the_tempered_sampling_distribution(tmp_path, monkeypatch, text_file):
    """At --temperature 0.5 rl/entropy (one update, before it changes the policy) is the mean entropy of
    softmax(logits / 0.5) at the completion positions, not that of softmax(logits)."""
    seen = first_step(tmp_path, monkeypatch, text_file, "--temperature", "0.5")
    logq = torch.log_softmax(seen["logits"] / 0.5, -1)  # (N, H, V)
    entropy = -(logq.exp() * logq).sum(-1)  # (N, H); next_token: every completion token is real
    assert seen["metrics"]["rl/entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)


@pytest.mark.slow
def test_rollout_samples_inside_the_top_k_and_stores_the_truncated_distributions_logprobs(
    tmp_path, monkeypatch, text_file
):
    """--temperature 0.7 --top_k 3: no sampled token lies outside the 3 most likely, and the stored old log-probs
    are those of softmax(logits / 0.7) renormalised over those 3 tokens."""
    seen = first_step(tmp_path, monkeypatch, text_file, "--temperature", "0.7", "--top_k", "3")
    batch = seen["batch"]
    want = truncated_logprobs(seen["logits"], 0.7, 3).gather(-1, batch["completion"][..., None])[..., 0]  # (N, H)
    assert torch.isfinite(want).all()  # inside the top 3
    assert torch.allclose(batch["old_logp"].double(), want, atol=1e-5)


@pytest.mark.slow
def test_first_update_ratio_is_exactly_1_under_temperature_and_top_k(tmp_path, monkeypatch, text_file):
    """The first update sees the policy that sampled: its log-probs, under the same truncated tempered distribution,
    equal the rollout's bit for bit (ratio mean 1.0, nothing clipped), and are those of that distribution."""
    seen = first_step(tmp_path, monkeypatch, text_file, "--temperature", "0.7", "--top_k", "3")
    logp, old_logp, stats = seen["update"]
    assert torch.equal(logp, old_logp)
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_frac"].item() == 0.0
    want = truncated_logprobs(seen["logits"], 0.7, 3).gather(-1, seen["batch"]["completion"][..., None])[..., 0]
    # the minibatch holds the rollout's rows in another order: compare the sorted values
    assert torch.allclose(logp.flatten().sort().values.double(), want.flatten().sort().values, atol=1e-5)


# ---------------------------------------------------------------------------------------------- end-to-end runs


@pytest.mark.slow
@pytest.mark.plots
def test_next_token_run_writes_the_run_folder_and_resume_is_exact(tmp_path, text_file, monkeypatch):
    """SIGTERM after 2 of 4 steps saves and exits 143; --resume continues to exactly the uninterrupted metrics, the
    adaptive KL coefficient and both optimizers included (separate value model, 2 epochs of 2 minibatches of 2
    micro-batches, entropy bonus, bigram reference). The checkpoint's policy loads into gpt.py's GPT."""
    common = ["--data", text_file, *NEXT, "--eval_every", "2", "--save_every", "2", "--eval_size", "8"]
    common += ["--ppo_epochs", "2", "--grad_accum", "2", "--entropy_coef", "0.01"]
    common += ["--adaptive_kl", "--target_kl", "0.01", "--kl_horizon", "20", "--warmup_steps", "0", "--max_steps", "4"]
    common += ["--lr", "1e-2", "--value_lr", "3e-2"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(ppo, monkeypatch, *common, "--out_dir", full)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt", "samples.txt"):
        assert (full / name).is_file(), name
    proc = run_script("ppo.py", *common, "--out_dir", part, env={"FAULT_SIGTERM_AT_STEP": "2"})
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert run_script("ppo.py", "--resume", "--out_dir", part).returncode == 0
    assert metrics(part) == metrics(full)
    rows = [r for r in metrics(full) if "train/loss" in r]
    names = ("rl/pg_loss", "rl/value_loss", "rl/entropy", "rl/approx_kl", "rl/clip_frac")
    names += ("rl/explained_variance", "rl/beta", "rl/reward_mean", "rl/reward_std", "rl/returns_mean", "rl/kl")
    names += ("rl/value_mean", "rl/rollout_kl", "rl/accuracy", "train/value_grad_norm")
    assert all(name in rows[0] for name in names)
    assert rows[0]["rl/value_mean"] == 0.0  # the value head starts at zero
    coefs = [r["rl/beta"] for r in rows]  # KL far above the target: the coefficient grows by 1 + 0.2 * 8 / 20
    assert coefs == pytest.approx([0.05 * 1.08**i for i in range(4)])
    ckpt = torch.load(full / "ckpt.pt", weights_only=True)
    assert ckpt["kl_coef"] == pytest.approx(0.05 * 1.08**4) and ckpt["tokens"] == 4 * 8 * 4
    assert {"value_model", "value_optimizer", "value_model_config"} <= set(ckpt)
    model, spec, _ = gpt.load_model(str(full / "ckpt.pt"))  # any script can start from the policy
    assert spec["type"] == "char" and isinstance(model, gpt.GPT)
    results = json.loads((full / "final_results.json").read_text())
    assert set(results["before"]) == set(results["after"]) == {"next_token_acc", "val_loss", "greedy_match"}


@pytest.mark.slow
def test_a_resumed_float16_run_continues_the_loss_scale_of_the_uninterrupted_run(tmp_path, text_file, monkeypatch):
    """With --dtype float16 the GradScaler's state (loss scale, growth tracker) is part of ckpt.pt: a run stopped
    after step 1 and resumed ends with the uninterrupted run's scaler state and metrics, instead of restarting at
    scale 65536 with a fresh growth tracker."""
    common = ["--data", text_file, *NEXT, "--dtype", "float16", "--device", "cpu", "--ppo_epochs", "1"]
    common += ["--max_steps", "2", "--eval_every", "2", "--eval_size", "8"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(ppo, monkeypatch, *common, "--out_dir", full)
    run_main_until_sigterm(ppo, monkeypatch, 1, *common, "--out_dir", part)
    run_main(ppo, monkeypatch, "--resume", "--out_dir", part)
    scaler = torch.load(full / "ckpt.pt", weights_only=True)["scaler"]
    assert scaler["_growth_tracker"] == 4  # 2 steps of 2 finite updates: the scaler is in use on this device
    assert torch.load(part / "ckpt.pt", weights_only=True)["scaler"] == scaler
    assert metrics(part) == metrics(full)


@pytest.mark.slow
@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_vf_coef_weighs_the_value_loss_only_where_the_trunk_is_shared(tmp_path, text_file, value_model, monkeypatch):
    """A separate value model shares no parameter with the policy and has its own AdamW, so it minimises L_V itself:
    --vf_coef 0.1 and 3 give the same run, metrics included (a weight would only move where its clipping starts).
    With the shared trunk, vf_coef weighs L_V against the policy loss in one gradient: the runs differ."""
    common = ["--data", text_file, *NEXT, "--max_steps", "2", "--eval_size", "8", "--value_model", value_model]
    runs = []
    for vf_coef in ("0.1", "3"):
        out = tmp_path / vf_coef
        run_main(ppo, monkeypatch, *common, "--vf_coef", vf_coef, "--out_dir", out)
        runs.append(metrics(out))
    assert (runs[0] == runs[1]) == (value_model == "separate")


@pytest.mark.slow
def test_reward_model_task_with_the_value_model_initialised_from_the_reward_model(tmp_path, monkeypatch):
    """HH prompts scored by a reward_model.py checkpoint, which also initialises the value model (body and head):
    the first step's values are the reward model's scores of the prompt prefixes, so they are not all zero."""
    data = hh_file(tmp_path / "hh.jsonl")
    chars = "".join(sorted(set(data.read_text()) | set("\n")))
    init = char_checkpoint(tmp_path / "init.pt", chars, block_size=64)
    rm = char_checkpoint(tmp_path / "rm.pt", chars, block_size=64, seed=1, reward_head=True)
    out = tmp_path / "run"
    run_main(
        ppo,
        monkeypatch,
        *["--task", "reward_model", "--init_from", init, "--reward_model", rm, "--data_path", data],
        *["--value_init", "reward_model", "--max_prompt_len", "40", "--horizon", "8", "--batch_size", "4"],
        *["--num_minibatches", "2", "--max_steps", "2", "--eval_every", "2", "--eval_size", "4", "--out_dir", out],
    )
    results = json.loads((out / "final_results.json").read_text())
    assert results["before"]["completion_kl"] == pytest.approx(0.0, abs=1e-5)
    assert np.isfinite(results["after"]["rm_score"]) and results["after"]["completion_len"] == 8
    first = [r for r in metrics(out) if "train/loss" in r][0]
    assert first["rl/value_mean"] != 0.0 and math.isfinite(first["rl/explained_variance"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_gloo_runs(tmp_path, text_file, parallel):
    """torchrun with 2 CPU ranks. DDP: next_token with a separate value model, both models wrapped. FSDP: the
    arithmetic task with the shared value head, where every forward pass is collective, and its flags: the missing-EOS
    penalty, the dual clip, a format reward, 2 micro-batches, no whitening, an unclipped value loss, and a tiny
    --target_kl_stop that ends every step after its first epoch."""
    out = tmp_path / "run"
    if parallel == "ddp":
        args = ["--data", text_file, *NEXT, "--eval_size", "8"]
    else:
        init = char_checkpoint(tmp_path / "init.pt", ppo.ARITHMETIC_CHARS)
        args = ["--task", "arithmetic", "--init_from", init, "--horizon", "4", "--batch_size", "4", "--eval_size", "8"]
        args += ["--num_minibatches", "2", "--grad_accum", "2", "--value_model", "shared", "--ppo_epochs", "2"]
        args += ["--no-whiten_advantages", "--clip_eps_value", "0", "--missing_eos_penalty", "0.5", "--dual_clip", "3"]
        args += ["--target_kl_stop", "1e-9", "--format_reward", "0.1"]
    proc = torchrun(
        ROOT / "ppo.py", 2, "--device", "cpu", "--parallel", parallel, *args, "--max_steps", "2", "--out_dir", out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert len(ckpt["rng_ranks"]) == 2 and ckpt["step"] == 2
    gpt.GPT(gpt.GPTConfig(**ckpt["model_config"])).load_state_dict(ckpt["model"])  # unsharded policy weights
    rows = [r for r in metrics(out) if "train/loss" in r]
    if parallel == "ddp":
        assert ckpt["tokens"] == 2 * 2 * 8 * 4  # steps * ranks * prompts * horizon
        assert {"value_model", "value_optimizer", "value_model_config"} <= set(ckpt)
        return
    # the shared value head is saved apart from the policy; there is no value optimizer
    assert set(ckpt["value_model"]) == {"weight", "bias"} and "value_optimizer" not in ckpt
    assert set(ckpt["reference"]) == set(ckpt["model"])  # the starting policy, for an exact resume
    assert len(rows) == 2 and all(0 <= r["rl/accuracy"] <= 1 and 1 <= r["rl/completion_len"] <= 4 for r in rows)
    assert all(0 <= r["rl/truncated_frac"] <= 1 and 0 <= r["rl/dual_clip_frac"] <= 1 for r in rows)
    assert [r["train/epochs"] for r in rows] == [1, 1]
    results = json.loads((out / "final_results.json").read_text())
    assert {"accuracy", "format_rate"} <= set(results["after"]) and results["value_model"] == "shared"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"batch_size": 6, "num_minibatches": 4}, "--num_minibatches"),
        ({"batch_size": 8, "num_minibatches": 2, "grad_accum": 3}, "--grad_accum"),
        ({"horizon": 0}, "--horizon"),
        ({"ppo_epochs": 0}, "--ppo_epochs"),
        ({"lam": 1.5}, "--lam"),
        ({"gamma": -0.1}, "--gamma"),
        ({"clip_eps": 0.0}, "--clip_eps"),
        ({"dual_clip": 0.5}, "--dual_clip"),
        ({"vf_coef": -1.0}, "--vf_coef"),
        ({"kl_horizon": 0}, "--kl_horizon"),
        ({"temperature": 0.0}, "--temperature"),
        ({"value_model": "twin"}, "--value_model"),
        ({"value_init": "reward_model"}, "--reward_model"),
        ({"value_init": "reward_model", "value_model": "shared", "reward_model": "rm.pt"}, "--value_model separate"),
        ({"missing_eos_penalty": 1.0}, "--missing_eos_penalty"),
        ({"reference": "bigram", "task": "arithmetic"}, "--reference"),
        ({"adaptive_kl": True, "reference": "none"}, "--adaptive_kl"),
    ],
)
def test_impossible_settings_exit_2_with_one_line(overrides, needle, capsys):
    """validate() rejects impossible settings before anything runs: exit code 2, one line naming the setting."""
    with pytest.raises(SystemExit) as e:
        ppo.validate(ppo.Config(**overrides))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.slow
def test_a_policy_checkpoint_cannot_initialise_the_value_model_as_a_reward_model(tmp_path):
    """--value_init reward_model needs a reward head: a plain policy checkpoint is refused with one line, exit code 2,
    no traceback and no checkpoint written."""
    init = char_checkpoint(tmp_path / "init.pt", ppo.ARITHMETIC_CHARS)
    args = ["--task", "arithmetic", "--init_from", init, "--value_init", "reward_model", "--reward_model", init]
    proc = run_script("ppo.py", *args, "--out_dir", tmp_path / "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "reward head" in lines[0]
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.slow
@pytest.mark.learning
def test_mean_reward_rises_on_the_dense_next_token_task(tmp_path, monkeypatch):
    """A tiny char model from scratch on a text that repeats one short phrase: PPO with its value model lifts the
    per-token reward far above chance (about 1/11) within 30 steps."""
    path = tmp_path / "rep.txt"
    path.write_text("the cat sat on the mat. " * 400)
    out = tmp_path / "run"
    args = ["--data", path, "--tokenizer", "char", "--n_layer", "2", "--n_head", "2", "--n_embd", "32"]
    args += ["--block_size", "32", "--context_len", "8", "--horizon", "8", "--batch_size", "32", "--max_steps", "30"]
    args += ["--lr", "3e-3", "--warmup_steps", "5", "--eval_every", "30", "--eval_size", "32", "--log_every", "30"]
    run_main(ppo, monkeypatch, *args, "--out_dir", out)
    rewards = [r["rl/reward_mean"] for r in metrics(out) if "rl/reward_mean" in r]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > 2 * first and last > first + 0.1, (first, last)  # measured here: 0.105 -> 0.302
