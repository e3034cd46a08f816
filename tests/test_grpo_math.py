"""The GRPO family's pure functions (SPEC section 7): properties with hypothesis, values derived by hand, and
identical results across every script that carries a copy."""

import importlib
import math

import numpy as np
import pytest
import torch
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import char_grpo as cg

FUNCTIONS = ("group_advantages", "process_advantages", "rloo_advantages", "kl_penalty", "policy_loss")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "reinforce", "sapo")
FAST = settings(max_examples=60, deadline=None)


def rewards_strategy(max_groups=4, max_group=6):
    """(rewards (N,), group_size) with N a multiple of the group size."""
    return st.tuples(st.integers(1, max_groups), st.integers(2, max_group)).flatmap(
        lambda s: st.tuples(
            arrays(np.float64, s[0] * s[1], elements=st.floats(-10, 10, allow_nan=False)), st.just(s[1])
        )
    )


# ---------------------------------------------------------------------------------------------------- advantages


@FAST
@given(rewards_strategy())
def test_group_advantages_have_zero_mean_and_unit_std_within_each_group(data):
    """(r - mean) / (std + eps): every group sums to 0; groups with spread have unbiased std ~ 1 (eps aside)."""
    r, g = data
    rewards = torch.tensor(r)
    adv = cg.group_advantages(rewards, g).view(-1, g)
    groups = rewards.view(-1, g)
    for a, x in zip(adv, groups):
        assert abs(a.sum().item()) < 1e-6
        std = x.std().item()
        if std > 1e-2:
            assert a.std().item() == pytest.approx(std / (std + 1e-4), rel=1e-6)


@FAST
@given(st.floats(-5, 5), st.integers(2, 8))
def test_group_advantages_of_an_all_equal_group_are_zero(value, g):
    """No spread, no signal: every scale gives exactly zero advantage."""
    for scale in ("group", "batch", "none"):
        assert torch.all(cg.group_advantages(torch.full((g,), value), g, scale=scale) == 0)


def test_group_advantages_hand_values():
    """Group [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]/(1 + eps); 'none' keeps the centred rewards;
    'batch' divides by the std of the whole batch."""
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 8.0])
    adv = cg.group_advantages(r, 3)
    assert torch.allclose(adv[:3], torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-4))
    assert torch.allclose(adv[3:], torch.tensor([-1.0, -1.0, 2.0]) / (math.sqrt(3.0) + 1e-4))
    assert torch.allclose(cg.group_advantages(r, 3, scale="none"), torch.tensor([-1.0, 0, 1, -1, -1, 2]))
    batch_std = float(np.std([1, 2, 3, 5, 5, 8], ddof=1))
    expected = torch.tensor([-1.0, 0, 1, -1, -1, 2]) / (batch_std + 1e-4)
    assert torch.allclose(cg.group_advantages(r, 3, scale="batch"), expected)


def test_process_advantages_hand_values():
    """One group of two rollouts, rewards [[1, 0], [0, 1]]: mean 0.5, unbiased std sqrt(1/3); normalised
    n = +-0.5/std; the advantage at t sums n from t to the end."""
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.ones(2, 2)
    n = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([[n - n, -n], [-n + n, n]])
    assert torch.allclose(cg.process_advantages(r, mask, 2), expected, atol=1e-6)


def test_process_advantages_use_only_real_tokens():
    """Masked rewards take no part in the group statistics and get zero advantage."""
    r = torch.tensor([[1.0, 0.0, 99.0], [0.0, 1.0, -99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = cg.process_advantages(r, mask, 2)
    clean = cg.process_advantages(r[:, :2], mask[:, :2], 2)
    assert torch.allclose(adv[:, :2], clean) and torch.all(adv[:, 2] == 0)


@FAST
@given(rewards_strategy(max_groups=3, max_group=4), st.integers(1, 5))
def test_process_advantages_are_suffix_sums_of_group_normalised_rewards(data, T):
    """adv[t] - adv[t+1] is the normalised reward at t, and normalised rewards have zero mean per group."""
    r, g = data
    torch.manual_seed(0)
    rewards = torch.tensor(r).repeat_interleave(T).view(-1, T) + torch.randn(len(r), T).double()
    adv = cg.process_advantages(rewards, torch.ones_like(rewards), g)
    normed = adv - torch.cat([adv[:, 1:], torch.zeros(len(r), 1, dtype=adv.dtype)], 1)
    assert torch.allclose(normed.view(-1, g * T).sum(1), torch.zeros(len(r) // g, dtype=adv.dtype), atol=1e-6)


# ------------------------------------------------------------------------------------------------------------ KL


@FAST
@given(arrays(np.float64, 8, elements=st.floats(-20, 0)), arrays(np.float64, 8, elements=st.floats(-20, 0)))
def test_k2_and_k3_are_nonnegative_and_zero_only_when_equal(a, b):
    """k2 = d^2/2 and k3 = exp(-d) - 1 + d are >= 0, and 0 exactly where logp == ref_logp."""
    logp = torch.tensor(a)
    ref = torch.tensor(b)
    for kind in ("k2", "k3"):
        k = cg.kl_penalty(logp, ref, kind)
        assert torch.all(k >= 0)
        assert torch.all((k > 0) | (logp == ref) | ((logp - ref).abs() < 1e-7))
        assert torch.all(cg.kl_penalty(logp, logp, kind) == 0)


def test_kl_estimators_hand_values():
    """d = log 2: k1 = log 2, k2 = (log 2)^2 / 2, k3 = 1/2 - 1 + log 2."""
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert cg.kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert cg.kl_penalty(logp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    assert cg.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))


def test_k1_and_k3_average_to_the_true_kl_on_samples_from_the_policy():
    """Monte Carlo: over tokens drawn from p, mean(k1) and mean(k3) approach KL(p || q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(10, generator=g), 0)
    q = torch.softmax(torch.randn(10, generator=g), 0)
    true_kl = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = cg.kl_penalty(p.log()[x], q.log()[x], kind).mean().item()
        assert est == pytest.approx(true_kl, abs=0.01), kind


def test_kl_estimators_as_loss_terms_have_these_expected_gradients():
    """Exact enumeration over a 5-token categorical pi = softmax(theta), d = log pi - log pi_ref: the expected gradient
    E_{x~pi}[grad k(d(x))] (samples held fixed, as a loss term is differentiated) is 0 for k1, since
    E_pi[grad log pi] = 0 (why grpo.py refuses k1 as a loss term); grad KL(pi || pi_ref) for k2; and
    grad KL(pi_ref || pi) for k3 (Tang & Munos 2025), although k3's value estimates KL(pi || pi_ref)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().detach()  # the sampling weights carry no gradient

    def grad(f):
        return torch.autograd.grad(f, theta, retain_graph=True)[0]

    expected = {kind: grad((p * cg.kl_penalty(logp, ref, kind)).sum()) for kind in ("k1", "k2", "k3")}
    forward_kl = grad((logp.exp() * (logp - ref)).sum())  # grad KL(pi || pi_ref)
    reverse_kl = grad((ref.exp() * (ref - logp)).sum())  # grad KL(pi_ref || pi)
    torch.testing.assert_close(expected["k1"], torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(expected["k2"], forward_kl)
    torch.testing.assert_close(expected["k3"], reverse_kl)
    assert not torch.allclose(expected["k3"], forward_kl, atol=1e-3)


# --------------------------------------------------------------------------------------------------- policy loss


def batch(seed=0, N=4, T=5, ragged=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g) * 3
    old = logp + 0.3 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, generator=g)
    mask = torch.ones(N, T)
    if ragged:
        mask[0, 3:] = 0
        mask[2, 1:] = 0
    return logp, old, adv, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_with_ratio_one_every_objective_has_the_reinforce_gradient(loss_type):
    """At logp == old_logp the clipped objectives' gradient is -A grad logp, aggregated as the loss type says."""
    logp, _, adv, mask = batch()
    N, T = logp.shape
    x = logp.clone().requires_grad_(True)
    loss, _ = cg.policy_loss(x, logp.clone(), adv, mask, loss_type, max_len=T)
    (grad,) = torch.autograd.grad(loss, x)
    y = logp.clone().requires_grad_(True)
    per_token = -adv[:, None] * y * mask
    lengths = mask.sum(1, keepdim=True)
    reference = {
        "grpo": (per_token / lengths).sum() / N,
        "dapo": per_token.sum() / mask.sum(),
        "dr_grpo": per_token.sum() / (N * T),
        "gspo": (per_token / lengths).sum() / N,  # d s_i / d logp_t = s_i / |o_i| at s_i = 1
        "luspo": per_token.sum() / N,  # gspo's times |o_i|: every token of the step weighs A / N
        "sapo": (per_token / lengths).sum() / N,  # the gate's slope at r = 1 is 1, whatever tau
        "cispo": per_token.sum() / mask.sum(),
        "reinforce": per_token.sum() / mask.sum(),
    }[loss_type]
    (expected,) = torch.autograd.grad(reference, y)
    assert torch.allclose(grad, expected, atol=1e-7)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@FAST
@given(st.integers(0, 10_000))
def test_masked_positions_never_change_the_loss(loss_type, seed):
    """Whatever sits under mask == 0 (log-probs, old log-probs, per-token advantages) leaves loss and stats alone."""
    logp, old, _, mask = batch(seed)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
    noise = torch.randn(3, *logp.shape, generator=torch.Generator().manual_seed(seed + 1)) * (1 - mask)
    a, sa = cg.policy_loss(logp, old, adv, mask, loss_type, clip_eps_high=0.28)
    b, sb = cg.policy_loss(logp + noise[0], old + noise[1], adv + noise[2], mask, loss_type, clip_eps_high=0.28)
    assert torch.allclose(a, b, atol=1e-6)
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in ("clip_frac", "ratio_mean"))


def test_policy_loss_hand_values():
    """Two sequences, lengths 2 and 1, ratios r = exp(logp - old), clip_eps 0.2, clip_eps_high 0.28:
    seq 0 (A = +1): r = [1.5, 1.0] -> terms min(rA, clip(r)A) = [1.28, 1.0] (grpo, dapo, dr_grpo: TRL's epsilon_high)
    seq 1 (A = -1): r = [0.5]      -> grpo term min(-0.5, -0.8) = -0.8."""
    old = torch.log(torch.tensor([[0.2, 0.5], [0.4, 0.3]]))
    logp = old + torch.log(torch.tensor([[1.5, 1.0], [0.5, 7.0]]))  # seq 1's second token is padding
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])

    def loss(loss_type, **kw):
        return cg.policy_loss(logp, old, adv, mask, loss_type, clip_eps=0.2, clip_eps_high=0.28, **kw)[0].item()

    assert loss("grpo") == pytest.approx(-((1.28 + 1.0) / 2 + (-0.8)) / 2)
    assert loss("dapo") == pytest.approx(-(1.28 + 1.0 - 0.8) / 3)
    assert loss("dr_grpo", max_len=4) == pytest.approx(-(1.28 + 1.0 - 0.8) / (2 * 4))
    symmetric = cg.policy_loss(logp, old, adv, mask, "grpo", clip_eps=0.2)[0].item()  # clip_eps_high unset
    assert symmetric == pytest.approx(-((1.2 + 1.0) / 2 + (-0.8)) / 2)
    # sequence ratios: geometric means of the token ratios
    s0 = math.exp((math.log(1.5) + 0) / 2)
    s1 = 0.5
    assert loss("gspo") == pytest.approx(-(min(s0, 1.28) * 1 + min(-s1, -0.8)) / 2)
    lp = logp[mask > 0]
    assert loss("cispo") == pytest.approx(-(1.28 * lp[0] + 1.0 * lp[1] - 0.5 * lp[2]).item() / 3)
    assert loss("reinforce") == pytest.approx(-(lp[0] + lp[1] - lp[2]).item() / 3)
    _, stats = cg.policy_loss(logp, old, adv, mask, "grpo")
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)  # tokens 0 (r = 1.5, A > 0) and 2 (r = 0.5, A < 0)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1.0 + 0.5) / 3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_split_batches_with_global_counts_sum_to_the_whole_batch_loss(loss_type):
    """Gradient accumulation: micro-batch losses with the global num_seqs / num_tokens add up to the full loss."""
    logp, old, adv, mask = batch(3, N=6)
    full, _ = cg.policy_loss(logp, old, adv, mask, loss_type, max_len=5)
    parts = sum(
        cg.policy_loss(
            logp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            loss_type,
            max_len=5,
            num_seqs=6,
            num_tokens=mask.sum(),
        )[0]
        for i in range(0, 6, 2)
    )
    assert torch.allclose(full, parts, atol=1e-6)


# ------------------------------------------------------------------------------------------- copies across scripts


def scripts_with(name):
    found = []
    for path in sorted(ROOT.glob("*.py")):
        if f"def {name}(" in path.read_text():
            found.append(importlib.import_module(path.stem))
    return found


@pytest.mark.parametrize("name", FUNCTIONS)
def test_copies_in_every_script_give_identical_results(name):
    """A function copied into several scripts computes the same thing in each, on the same random inputs."""
    modules = scripts_with(name)
    if len(modules) < 2:
        pytest.skip(f"{name} lives in {len(modules)} script(s)")
    logp, old, adv, mask = batch(7, N=6)
    calls = {
        "group_advantages": lambda f: [f(adv, 3, scale=s) for s in ("group", "batch", "none")],
        "process_advantages": lambda f: [f(logp, mask, 3)],
        "rloo_advantages": lambda f: [f(adv, 3)],
        "kl_penalty": lambda f: [f(logp, old, k) for k in ("k1", "k2", "k3")],
        "policy_loss": lambda f: [
            f(logp, old, adv, mask, t, clip_eps=0.2, clip_eps_high=0.28, max_len=5)[0] for t in LOSS_TYPES
        ],
    }[name]
    first = calls(getattr(modules[0], name))
    for module in modules[1:]:
        for a, b in zip(first, calls(getattr(module, name))):
            assert torch.equal(a, b), f"{module.__name__}.{name} differs from {modules[0].__name__}.{name}"


@FAST
@given(st.integers(1, 3), st.integers(1, 9), st.integers(2, 40), st.sampled_from([0.1, 3.0, 300.0]), st.integers(0, 99))
def test_entropy_of_given_logits_matches_the_float64_definition_and_its_gradient(B, T, V, scale, seed):
    """H = -sum p log p of softmax(logits) (float64 oracle), value and gradient, over several row chunks;
    0 <= H <= log V: linear_logprobs of the model block with the logits given (weight None), the entropy
    grpo.py, ppo.py and rookworld_grpo.py log and use as a bonus."""
    from gpt import linear_logprobs

    torch.manual_seed(seed)
    logits = (torch.randn(B, T, V) * scale).requires_grad_(True)
    weights = torch.randn(B, T)
    targets = torch.randint(0, V, (B * T,))
    ent = linear_logprobs(logits.flatten(0, 1), None, targets, entropy=True, rows=3)[1].view(B, T)
    (ent * weights).sum().backward()
    x = logits.detach().double().requires_grad_(True)
    oracle = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    (oracle * weights).sum().backward()
    assert ent.shape == (B, T)
    torch.testing.assert_close(ent.double(), oracle.detach(), atol=1e-4, rtol=1e-4)
    assert (ent >= -1e-5).all() and (ent <= math.log(V) + 1e-5).all()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-4, rtol=1e-3)
