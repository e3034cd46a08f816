"""dpo.py: every loss against its formula (hand values and hypothesis properties), response-only log-probs, the HH
data rules shared with reward_model.py and gpt.py, and end-to-end runs (every loss type, run folder, resume,
torchrun, the judge, learning, bad input)."""

import contextlib
import dataclasses
import importlib
import json
import math
import random
import zlib
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, char_checkpoint, metrics, needs_bpe, run_main, run_script, torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

import dpo

FAST = settings(max_examples=50, deadline=None)
logps = st.floats(-60, -0.01)
ratios = st.floats(-20, 20)
betas = st.floats(0.01, 3)
MONOTONE = ("sigmoid", "robust", "hinge", "bco_pair", "apo_zero", "simpo")  # non-increasing in a (ipo, sppo_hard,
# exo_pair, nca_pair, discopop have an optimum at finite a; apo_down is flat in a when b = 0)


def s(x):
    return 1 / (1 + math.exp(-x))


def log_s(x):
    return -math.log1p(math.exp(-x))


def f64(*values):
    """A float64 tensor of the values: f64(0.5) has shape (1,)."""
    return torch.tensor(values, dtype=torch.float64)


def loss(loss_type, pi_c, pi_r, ref_c, ref_r, **kw):
    """preference_loss on 1-element float64 tensors, as Python floats (losses, chosen reward, rejected reward)."""
    kw = {k: f64(v) if k.endswith("_len") else v for k, v in kw.items()}
    out = dpo.preference_loss(f64(pi_c), f64(pi_r), f64(ref_c), f64(ref_r), loss_type, **kw)
    return [x.item() for x in out]


# ------------------------------------------------------------------------------------------- hand-computed values

# pi_c = -10, pi_r = -12, ref_c = -11, ref_r = -11.5: a = 1, b = -0.5, h = 1.5; beta = 0.5: x = 0.75
EXAMPLE = dict(pi_c=-10.0, pi_r=-12.0, ref_c=-11.0, ref_r=-11.5)
HAND = {
    "sigmoid": ({}, -log_s(0.75)),
    "robust": ({"label_smoothing": 0.1}, (-0.9 * log_s(0.75) + 0.1 * log_s(-0.75)) / 0.8),
    "hinge": ({}, 0.25),  # max(0, 1 - 0.75)
    "exo_pair": (
        {"label_smoothing": 0.1},
        s(0.75) * (log_s(0.75) - math.log(0.9)) + s(-0.75) * (log_s(-0.75) - math.log(0.1)),
    ),
    "nca_pair": ({}, -log_s(0.5) - 0.5 * log_s(-0.5) - 0.5 * log_s(0.25)),  # beta a = 0.5, beta b = -0.25
    "bco_pair": ({"bco_delta": 0.2}, -log_s(0.5 - 0.2) - log_s(-(-0.25 - 0.2))),
    "sppo_hard": ({}, (1 - 1) ** 2 + (-0.5 + 1) ** 2),
    "apo_zero": ({}, 1 - s(0.5) + s(-0.25)),
    "apo_down": ({}, s(0.5) + 1 - s(0.75)),
    "discopop": ({"discopop_tau": 0.05}, (1 - s(15)) * -log_s(0.75) + s(15) * math.exp(-0.75)),
}


@pytest.mark.parametrize("loss_type", HAND)
def test_pair_losses_match_hand_computed_values(loss_type):
    """Each loss on a = 1, b = -0.5 (h = 1.5), beta = 0.5, against the formula evaluated by hand; the rewards are
    beta * a and beta * b."""
    kw, expected = HAND[loss_type]
    value, chosen_r, rejected_r = loss(loss_type, **EXAMPLE, beta=0.5, **kw)
    assert value == pytest.approx(expected, rel=1e-9)
    assert (chosen_r, rejected_r) == pytest.approx((0.5, -0.25))


def test_ipo_hand_value_averages_the_logratios_per_token():
    """IPO on per-token log-ratios (TRL's form): a = 1 over 2 chosen tokens, b = -0.5 over 4 rejected tokens, so
    h = 1/2 + 1/8 = 0.625 and, beta = 0.5, the loss is (0.625 - 1)^2; the rewards are beta * a/2 and beta * b/4.
    (Summed log-probs would give (1.5 - 1)^2 = 0.25 and rewards 0.5, -0.25.)"""
    value, chosen_r, rejected_r = loss("ipo", **EXAMPLE, beta=0.5, chosen_len=2.0, rejected_len=4.0)
    assert value == pytest.approx(0.375**2, rel=1e-9)
    assert (chosen_r, rejected_r) == pytest.approx((0.25, -0.0625), rel=1e-9)


def test_ipo_needs_the_response_lengths():
    with pytest.raises(ValueError, match="ipo needs chosen_len and rejected_len"):
        loss("ipo", **EXAMPLE, beta=0.5)


def test_cdpo_and_exo_hand_values_with_their_smoothing():
    """cDPO (sigmoid, eps 0.1): -0.9 log s(x) - 0.1 log s(-x); exo_pair with eps 0 uses eps = 1e-3."""
    assert loss("sigmoid", **EXAMPLE, beta=0.5, label_smoothing=0.1)[0] == pytest.approx(
        -0.9 * log_s(0.75) - 0.1 * log_s(-0.75), rel=1e-9
    )
    expected = s(0.75) * (log_s(0.75) - math.log(1 - 1e-3)) + s(-0.75) * (log_s(-0.75) - math.log(1e-3))
    assert loss("exo_pair", **EXAMPLE, beta=0.5)[0] == pytest.approx(expected, rel=1e-9)


def test_simpo_hand_value():
    """avg_c = -10/4 = -2.5, avg_r = -12/6 = -2, beta 2, gamma 0.5: -log s(2 * (-0.5) - 0.5); rewards beta * avg."""
    value, chosen_r, rejected_r = loss("simpo", **EXAMPLE, beta=2.0, gamma=0.5, chosen_len=4, rejected_len=6)
    assert value == pytest.approx(-log_s(-1.5), rel=1e-9)
    assert (chosen_r, rejected_r) == pytest.approx((-5.0, -4.0))


def test_orpo_hand_value():
    """p_c = 1/2, p_r = 1/4: odds 1 and 1/3, log odds ratio log 3; NLL log 2; lambda 0.1:
    log 2 - 0.1 log s(log 3) = log 2 - 0.1 log(3/4)."""
    avg_c, avg_r = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    losses, chosen_r, rejected_r = dpo.orpo_loss(avg_c, avg_r, -avg_c, 0.1)
    assert losses.item() == pytest.approx(math.log(2) - 0.1 * math.log(0.75), rel=1e-6)
    assert (chosen_r.item(), rejected_r.item()) == pytest.approx((0.1 * math.log(0.5), 0.1 * math.log(0.25)))


def test_kto_hand_value():
    """r = [1, -1], z0 = 0.5, beta 1, w_d 1, w_u 2: desirable 1 - s(1 - 0.5), undesirable 2 (1 - s(0.5 + 1))."""
    losses, rewards = dpo.kto_loss(
        torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0]), torch.tensor([True, False]), 1.0, 0.5, 1.0, 2.0
    )
    assert losses.tolist() == pytest.approx([1 - s(0.5), 2 * (1 - s(1.5))], rel=1e-6)
    assert rewards.tolist() == pytest.approx([1.0, -1.0])


# f-DPO (Wang et al. 2023, Table 1) on EXAMPLE (a = 1, b = -0.5), beta 0.5: f'(u) at u = e^a and u = e^b, as TRL writes
# them; the paper's forward KL f'(u) = -1/u and alpha-divergence (1 - u^-alpha) / alpha differ by constants only
F_PRIME = {
    "forward_kl": (1 - math.exp(-1), 1 - math.exp(0.5)),  # 1 - 1/u
    "js": (math.log(2) + log_s(1), math.log(2) + log_s(-0.5)),  # log(2u / (1 + u))
    "alpha": (2 * (1 - math.exp(-0.5)), 2 * (1 - math.exp(0.25))),  # f_alpha 0.5: (u^-0.5 - 1) / -0.5
}


@pytest.mark.parametrize("f_divergence", F_PRIME)
def test_f_divergence_hand_values(f_divergence):
    """The sigmoid, hinge and ipo losses on f'(e^a) - f'(e^b) instead of h = a - b (ipo: each averaged over its 2 and
    4 tokens first); the rewards are beta f', f-DPO's implicit rewards."""
    fa, fb = F_PRIME[f_divergence]
    value, chosen_r, rejected_r = loss("sigmoid", **EXAMPLE, beta=0.5, f_divergence=f_divergence)
    assert value == pytest.approx(-log_s(0.5 * (fa - fb)), rel=1e-9)
    assert (chosen_r, rejected_r) == pytest.approx((0.5 * fa, 0.5 * fb), rel=1e-9)
    value = loss("hinge", **EXAMPLE, beta=0.5, f_divergence=f_divergence)[0]
    assert value == pytest.approx(max(0.0, 1 - 0.5 * (fa - fb)), rel=1e-9)
    value = loss("ipo", **EXAMPLE, beta=0.5, f_divergence=f_divergence, chosen_len=2, rejected_len=4)[0]
    assert value == pytest.approx((fa / 2 - fb / 4 - 1) ** 2, rel=1e-9)


def test_f_divergence_is_refused_for_losses_not_built_on_h_alone():
    with pytest.raises(ValueError, match="f_divergence"):
        loss("nca_pair", **EXAMPLE, f_divergence="js")


def test_sigmoid_norm_hand_value():
    """The sigmoid loss on per-token log-ratios: a / 2 = 0.5, b / 4 = -0.125, beta 0.5: -log s(0.3125); with label
    smoothing 0.1 the cDPO mixture; the rewards beta a / 2 and beta b / 4."""
    value, chosen_r, rejected_r = loss("sigmoid_norm", **EXAMPLE, beta=0.5, chosen_len=2, rejected_len=4)
    assert value == pytest.approx(-log_s(0.3125), rel=1e-9)
    assert (chosen_r, rejected_r) == pytest.approx((0.25, -0.0625), rel=1e-9)
    smoothed = loss("sigmoid_norm", **EXAMPLE, beta=0.5, label_smoothing=0.1, chosen_len=2, rejected_len=4)[0]
    assert smoothed == pytest.approx(-0.9 * log_s(0.3125) - 0.1 * log_s(-0.3125), rel=1e-9)
    with pytest.raises(ValueError, match="needs chosen_len"):
        loss("sigmoid_norm", **EXAMPLE)


# three pairs: policy margins pi_c - pi_r = [2, -2, 2], reference margins [0.5, -1, 2]; log-ratios a = [1, -1, 1],
# b = [-0.5, 0, 1]
AOT_BATCH = dict(
    pi_c=[-10.0, -12.0, -9.0], pi_r=[-12.0, -10.0, -11.0], ref_c=[-11.0, -11.0, -10.0], ref_r=[-11.5, -10.0, -12.0]
)


def batch_loss(loss_type, pi_c, pi_r, ref_c, ref_r, **kw):
    """preference_loss on float64 batches given as lists, as lists."""
    out = dpo.preference_loss(f64(*pi_c), f64(*pi_r), f64(*ref_c), f64(*ref_r), loss_type, **kw)
    return [x.tolist() for x in out]


def test_aot_hand_values():
    """aot: sorted policy margins [-2, 2, 2] minus sorted reference margins [-1, 0.5, 2] = [-1, 1.5, 0]; aot_unpaired:
    sorted a [-1, 1, 1] minus sorted b [-0.5, 0, 1] = [-0.5, 1, 0]; beta 0.5, then the sigmoid loss with label
    smoothing 0.1 (TRL 1.16's forms). The rewards stay per pair: beta a and beta b."""

    def cdpo(x):
        return -0.9 * log_s(x) - 0.1 * log_s(-x)

    value, chosen_r, rejected_r = batch_loss("aot", **AOT_BATCH, beta=0.5, label_smoothing=0.1)
    assert value == pytest.approx([cdpo(-0.5), cdpo(0.75), cdpo(0.0)], rel=1e-9)
    assert chosen_r == pytest.approx([0.5, -0.5, 0.5]) and rejected_r == pytest.approx([-0.25, 0.0, 0.5])
    value = batch_loss("aot_unpaired", **AOT_BATCH, beta=0.5, label_smoothing=0.1)[0]
    assert value == pytest.approx([cdpo(-0.25), cdpo(0.5), cdpo(0.0)], rel=1e-9)


@FAST
@given(st.lists(st.tuples(logps, logps, logps, logps), min_size=1, max_size=6), betas, st.randoms())
def test_aot_losses_do_not_depend_on_the_order_of_the_pairs(rows, beta, rng):
    """AOT compares distributions (sorted values), so shuffling the pairs permutes nothing in its losses; a single
    pair is the plain sigmoid loss."""
    columns = [list(c) for c in zip(*rows)]
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = [[c[i] for i in order] for c in columns]
    for loss_type in ("aot", "aot_unpaired"):
        plain = batch_loss(loss_type, *columns, beta=beta)[0]
        assert batch_loss(loss_type, *shuffled, beta=beta)[0] == pytest.approx(plain, rel=1e-12, abs=1e-12)
    single = [c[:1] for c in columns]
    sigmoid = batch_loss("sigmoid", *single, beta=beta)[0]
    assert batch_loss("aot", *single, beta=beta)[0] == pytest.approx(sigmoid, rel=1e-12)
    assert batch_loss("aot_unpaired", *single, beta=beta)[0] == pytest.approx(sigmoid, rel=1e-12)


@FAST
@given(st.sampled_from(dpo.F_DIVERGENCE_LOSSES), logps, logps, logps, logps, betas, st.floats(0, 0.4))
def test_reverse_kl_f_divergence_is_the_loss_of_today(loss_type, pi_c, pi_r, ref_c, ref_r, beta, eps):
    """f_divergence="reverse_kl" (f'(u) = log u) changes nothing: each loss equals the call without the keyword, and
    sigmoid equals DPO's (cDPO's) formula evaluated here."""
    kw = dict(beta=beta, label_smoothing=eps, chosen_len=3, rejected_len=5)
    explicit = loss(loss_type, pi_c, pi_r, ref_c, ref_r, f_divergence="reverse_kl", **kw)
    assert explicit == loss(loss_type, pi_c, pi_r, ref_c, ref_r, **kw)
    if loss_type == "sigmoid":
        x = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        assert explicit[0] == pytest.approx(-(1 - eps) * log_s(x) - eps * log_s(-x), rel=1e-9, abs=1e-12)


@FAST
@given(ratios)
def test_alpha_divergence_spans_forward_kl_to_reverse_kl(logratio):
    """f_alpha = 0 gives forward KL's f' exactly (in exact arithmetic) and f_alpha -> 1 reverse KL's, log u."""
    t = f64(logratio)
    assert dpo.f_prime(t, "alpha", 0.0).item() == pytest.approx(dpo.f_prime(t, "forward_kl", 0.5).item(), rel=1e-9)
    assert dpo.f_prime(t, "alpha", 1 - 1e-7).item() == pytest.approx(logratio, rel=1e-4, abs=1e-4)
    assert dpo.f_prime(t, "reverse_kl", 0.5).item() == logratio


@pytest.mark.parametrize("loss_type", dpo.F_DIVERGENCE_LOSSES)
@pytest.mark.parametrize("f_divergence, rejected_logratio", [("forward_kl", -110.0), ("alpha", -200.0)])
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_f_divergence_at_an_extreme_log_ratio_gives_no_nan(loss_type, f_divergence, rejected_logratio, beta):
    """In float32, exp(110) (forward_kl's 1/u) and exp(100) (alpha at f_alpha 0.5) overflow to inf, and the loss or its
    gradient was NaN. With the exponent capped as TRL caps it, every f-DPO loss and its gradients are finite at a
    rejected log-ratio of -110 (-200), and so is the rejected reward; ipo's square of f' ~ -3e38 (the true value is
    beyond float32) is inf, never NaN, and its gradients stay finite."""
    pi_c = torch.tensor([-5.0], requires_grad=True)
    pi_r = torch.tensor([-10.0 + rejected_logratio], requires_grad=True)
    ref_c = torch.tensor([-4.0])
    ref_r = torch.tensor([-10.0])
    lengths = dict(chosen_len=torch.tensor([3.0]), rejected_len=torch.tensor([4.0]))
    losses, chosen_r, rejected_r = dpo.preference_loss(
        pi_c, pi_r, ref_c, ref_r, loss_type, beta, f_divergence=f_divergence, **lengths
    )
    losses.sum().backward()
    grads = torch.cat([pi_c.grad, pi_r.grad])
    assert torch.isfinite(grads).all() and torch.isfinite(torch.cat([chosen_r, rejected_r])).all()
    if loss_type == "ipo":
        assert not losses.isnan().any()
    else:
        assert torch.isfinite(losses).all()


@FAST
@given(st.floats(-88, 88), st.floats(0.05, 0.95))
def test_the_exponent_cap_leaves_f_prime_unchanged_below_it(logratio, f_alpha):
    """Where exp does not overflow, the capped f' is exactly the plain formula, in float32 and float64."""
    for dtype in (torch.float32, torch.float64):
        t = torch.tensor([logratio], dtype=dtype)
        assert torch.equal(dpo.f_prime(t, "forward_kl", f_alpha), 1 - torch.exp(-t))
        if (f_alpha - 1) * logratio < 80:  # below the cap, 88.7228 - log 1/(1 - f_alpha) >= 85.7 in float32
            assert torch.equal(dpo.f_prime(t, "alpha", f_alpha), torch.expm1((f_alpha - 1) * t) / (f_alpha - 1))


def test_losses_are_batched_elementwise():
    """A batch gives each pair the loss it gets alone (here a pair and its mirror image, h = +-1.5); not aot and
    aot_unpaired, which sort across the batch by design."""
    for loss_type in set(dpo.PAIR_LOSSES) - {"aot", "aot_unpaired"}:
        pi_c, pi_r = torch.tensor([-10.0, -12.0]), torch.tensor([-12.0, -10.0])
        ref_c, ref_r = torch.tensor([-11.0, -11.5]), torch.tensor([-11.5, -11.0])
        lens = torch.tensor([4.0, 6.0]), torch.tensor([6.0, 4.0])
        batch = dpo.preference_loss(pi_c, pi_r, ref_c, ref_r, loss_type, 0.5, 0.1, *lens)[0]
        for i in range(2):
            alone = dpo.preference_loss(
                pi_c[i : i + 1], pi_r[i : i + 1], ref_c[i : i + 1], ref_r[i : i + 1], loss_type, 0.5, 0.1,
                lens[0][i : i + 1], lens[1][i : i + 1],
            )[0]  # fmt: skip
            assert torch.allclose(batch[i], alone[0]), loss_type


# ------------------------------------------------------------------------------------------------ properties


@FAST
@given(logps, logps, betas)
def test_sigmoid_loss_is_log2_when_policy_equals_reference(pi_c, pi_r, beta):
    """h = 0: -log s(0) = log 2, whatever the log-probs and beta; both rewards are 0."""
    value, chosen_r, rejected_r = loss("sigmoid", pi_c, pi_r, pi_c, pi_r, beta=beta)
    assert value == pytest.approx(math.log(2), rel=1e-12)
    assert chosen_r == rejected_r == 0


@FAST
@given(logps, logps, logps, logps, betas, st.floats(0.0, 0.49))
def test_cdpo_is_the_label_noise_mixture_and_equals_sigmoid_at_zero_smoothing(pi_c, pi_r, ref_c, ref_r, beta, eps):
    """cDPO(eps) = (1 - eps) DPO(h) + eps DPO(-h); with eps = 0 it is DPO's -log s(beta h), and so is robust."""
    h = (pi_c - ref_c) - (pi_r - ref_r)

    def dpo_loss(x):  # -log s(beta x)
        return math.log1p(math.exp(-beta * x))

    plain = loss("sigmoid", pi_c, pi_r, ref_c, ref_r, beta=beta)[0]
    assert plain == pytest.approx(dpo_loss(h), rel=1e-9, abs=1e-12)
    assert loss("sigmoid", pi_c, pi_r, ref_c, ref_r, beta=beta, label_smoothing=0.0)[0] == plain
    assert loss("robust", pi_c, pi_r, ref_c, ref_r, beta=beta, label_smoothing=0.0)[0] == pytest.approx(plain)
    mixed = loss("sigmoid", pi_c, pi_r, ref_c, ref_r, beta=beta, label_smoothing=eps)[0]
    assert mixed == pytest.approx((1 - eps) * dpo_loss(h) + eps * dpo_loss(-h), rel=1e-9, abs=1e-12)


@FAST
@given(ratios, ratios, st.floats(0.05, 3), st.integers(1, 50), st.integers(1, 50))
def test_ipo_is_minimised_at_h_equal_to_one_over_two_beta(a, b, beta, len_c, len_r):
    """(h - 1/(2 beta))^2, h of per-token log-ratios, is 0 with zero gradient at h* = 1/(2 beta), and larger
    anywhere else."""
    target = 1 / (2 * beta)
    lens = dict(chosen_len=float(len_c), rejected_len=float(len_r))
    at_min = loss("ipo", a + target * len_c, 0.0, a, 0.0, beta=beta, **lens)[0]  # h = target exactly
    assert at_min == pytest.approx(0.0, abs=1e-12)
    assert loss("ipo", a, b, 0.0, 0.0, beta=beta, **lens)[0] >= at_min
    pi_c = f64(a + target * len_c).requires_grad_()
    dpo.preference_loss(pi_c, f64(0.0), f64(a), f64(0.0), "ipo", beta, 0.0, f64(len_c), f64(len_r))[0].sum().backward()
    assert abs(pi_c.grad.item()) < 1e-9


@FAST
@given(st.sampled_from(MONOTONE), logps, logps, logps, logps, betas, st.floats(0.01, 5))
def test_monotone_losses_decrease_as_the_chosen_logratio_grows(loss_type, pi_c, pi_r, ref_c, ref_r, beta, step):
    """Raising log pi(chosen) (so a, and h) never raises these losses, and their gradient in it is <= 0."""
    kw = dict(beta=beta, chosen_len=3.0, rejected_len=5.0)
    kw.update(label_smoothing=0.2 if loss_type == "robust" else 0.0, bco_delta=0.3 if loss_type == "bco_pair" else 0.0)
    before = loss(loss_type, pi_c, pi_r, ref_c, ref_r, **kw)[0]
    after = loss(loss_type, pi_c + step, pi_r, ref_c, ref_r, **kw)[0]
    assert after <= before + 1e-12
    x = torch.tensor([pi_c], dtype=torch.float64, requires_grad=True)
    kw = {k: f64(v) if k.endswith("_len") else v for k, v in kw.items()}
    dpo.preference_loss(x, f64(pi_r), f64(ref_c), f64(ref_r), loss_type, **kw)[0].sum().backward()
    assert x.grad.item() <= 1e-12


@FAST
@given(logps, logps, st.floats(0.01, 2))
def test_orpo_and_kto_decrease_as_the_chosen_logprob_grows(avg_c, avg_r, step):
    """ORPO: a likelier chosen response lowers both the NLL and the odds-ratio term. KTO: a desirable row's loss
    falls and an undesirable row's rises as its log-ratio grows."""
    avg_c = min(avg_c, -step - 1e-3)  # room to rise below 0

    def orpo(c):
        return dpo.orpo_loss(torch.tensor([c]), torch.tensor([avg_r]), torch.tensor([-c]), 0.5)[0].item()

    def kto(r, good):
        return dpo.kto_loss(torch.tensor([r]), torch.zeros(1), torch.tensor([good]), 0.5, 0.2)[0].item()

    assert orpo(avg_c + step) <= orpo(avg_c) + 1e-6
    assert kto(avg_c + step, True) <= kto(avg_c, True) and kto(avg_c + step, False) >= kto(avg_c, False)


def test_kto_reference_point_gets_no_gradient():
    """z0 is a baseline: a kl_ref that carries gradient gets none from the loss."""
    kl_ref = torch.tensor(0.3, requires_grad=True)
    logps = torch.tensor([-2.0, -3.0], requires_grad=True)
    dpo.kto_loss(logps, torch.tensor([-2.5, -2.5]), torch.tensor([True, False]), 0.5, kl_ref)[0].sum().backward()
    assert kl_ref.grad is None and logps.grad is not None


@FAST
@given(logps, logps, logps, logps, logps, logps, st.floats(1, 50), st.floats(1, 50))
def test_simpo_ignores_the_reference_arguments(pi_c, pi_r, ref_c, ref_r, ref_c2, ref_r2, len_c, len_r):
    """SimPO has no reference: any reference log-probs (or None) give the same loss and rewards."""
    kw = dict(beta=2.0, gamma=0.7, chosen_len=len_c, rejected_len=len_r)
    first = loss("simpo", pi_c, pi_r, ref_c, ref_r, **kw)
    assert first == loss("simpo", pi_c, pi_r, ref_c2, ref_r2, **kw)
    none = dpo.preference_loss(f64(pi_c), f64(pi_r), None, None, "simpo", 2.0, 0.0, f64(len_c), f64(len_r), 0.7)
    assert [x.item() for x in none] == first


@FAST
@given(ratios, ratios, betas, st.floats(-2, 2))
def test_bco_delta_shifts_the_rewards(a, b, beta, delta):
    """BCO with reward shift delta equals BCO without it on log-ratios moved by -delta/beta."""
    shifted = loss("bco_pair", a - delta / beta, b - delta / beta, 0.0, 0.0, beta=beta)[0]
    assert loss("bco_pair", a, b, 0.0, 0.0, beta=beta, bco_delta=delta)[0] == pytest.approx(shifted, rel=1e-9)


@pytest.mark.parametrize("loss_type", dpo.PAIR_LOSSES)
def test_losses_and_gradients_are_finite_for_extreme_logratios(loss_type):
    """Log-ratios of +-1e4 (a collapsed or exploded policy) give finite losses and gradients, in float32."""
    pi_c = torch.tensor([1e4, -1e4, 0.0, 30.0], requires_grad=True)
    pi_r = torch.tensor([-1e4, 1e4, 0.0, -30.0])
    zero = torch.zeros(4)
    losses, _, _ = dpo.preference_loss(pi_c, pi_r, zero, zero, loss_type, 1.0, 0.1, torch.ones(4), torch.ones(4))
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(pi_c.grad).all(), (losses, pi_c.grad)


def test_unknown_loss_type_is_an_error():
    with pytest.raises(ValueError, match="unknown loss_type"):
        loss("dpo", **EXAMPLE)


# ------------------------------------------------------------------------------------------ response log-probs


def tiny_model(vocab=11, block=32, seed=0):
    torch.manual_seed(seed)
    return dpo.GPT(dpo.GPTConfig(block_size=block, vocab_size=vocab, n_layer=2, n_head=2, n_embd=16)).eval()


MODEL = tiny_model()


def chain_rule_logprob(model, prompt, response):
    """log p(response | prompt) = log p(prompt + response) - log p(prompt), each from its own unpadded forward."""

    def seq_logprob(ids):
        if len(ids) < 2:
            return 0.0  # a lone token predicts nothing (and the model takes no empty sequence)
        x = torch.tensor([ids])
        return dpo.token_logprobs(model(x[:, :-1])[0], x[:, 1:]).sum().item()

    return seq_logprob(prompt + response) - seq_logprob(prompt)


@FAST
@given(
    st.lists(st.integers(0, 10), min_size=1, max_size=8),
    st.lists(st.integers(0, 10), min_size=1, max_size=8),
    st.integers(0, 10),
    st.integers(0, 12),
)
def test_prompt_and_padding_tokens_never_change_the_summed_logprob(prompt, response, pad_id, longer_by):
    """The summed log-prob of a right-padded row is log p(response | prompt) by the chain rule: the prompt's own
    tokens are not counted, and neither the padding id nor how much padding a longer row forces changes it."""
    with torch.no_grad():
        expected = chain_rule_logprob(MODEL, prompt, response)
        other = [1] * (len(prompt) + len(response) + longer_by)  # a longer row in the batch pads this one
        ids, mask = dpo.collate([(prompt + response, len(prompt)), (other, 1)], pad_id=pad_id)
        logp, n_tokens = dpo.sequence_logprobs(MODEL, MODEL.lm_head, ids, mask)
    assert logp[0].item() == pytest.approx(expected, abs=1e-4)
    assert n_tokens[0].item() == len(response)


def test_chosen_and_rejected_in_one_forward_equal_separate_forwards():
    """The concatenated forward of chosen and rejected rows gives each row the log-prob it gets alone."""
    rows = [([1, 2, 3, 4], 2), ([1, 2, 5], 2), ([7, 7, 7, 8, 9, 10], 3), ([7, 7, 7, 1], 3)]
    with torch.no_grad():
        together, _ = dpo.sequence_logprobs(MODEL, MODEL.lm_head, *dpo.collate(rows))
        alone = [dpo.sequence_logprobs(MODEL, MODEL.lm_head, *dpo.collate([r]))[0].item() for r in rows]
    assert together.tolist() == pytest.approx(alone, abs=1e-5)


# ------------------------------------------------------------------------------------------------ HH data rules

DIALOGUES = [
    {"chosen": "\n\nHuman: hi\n\nAssistant: hello there", "rejected": "\n\nHuman: hi\n\nAssistant: go away"},
    {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d", "rejected": "\n\nHuman: a\n\nAssistant: b"},
    {"chosen": "\n\nHuman: x\n\nAssistant:  ", "rejected": "\n\nHuman: x\n\nAssistant: y"},
    {"chosen": "\n\nHuman: q\n\nAssistant: same ", "rejected": "\n\nHuman: q\n\nAssistant: same"},
    {"chosen": "no turns at all", "rejected": "\n\nHuman: q\n\nAssistant: r"},
    {"chosen": "\n\nHuman: q\n\nAssistant: r"},
    {"chosen": 3, "rejected": "\n\nHuman: q\n\nAssistant: r"},
    {
        "chosen": "\n\nHuman: m\n\nAssistant: one\n\nAssistant: two",
        "rejected": "\n\nHuman: m\n\nAssistant: one\n\nAssistant: 3",
    },
]


def test_hh_pairs_split_at_the_last_assistant_turn_and_count_skips():
    """Hand-made dialogues: a plain pair, prompts that differ, a blank response, identical responses, no Assistant
    turn, missing or non-string fields, and a pair whose prompt holds an earlier Assistant turn."""
    pairs, skipped = dpo.hh_pairs(DIALOGUES)
    assert pairs == [
        ("\n\nHuman: hi\n\nAssistant:", " hello there", " go away"),
        ("\n\nHuman: m\n\nAssistant: one\n\nAssistant:", " two", " 3"),
    ]
    assert skipped == {"prompts differ": 1, "no Assistant response": 2, "chosen == rejected": 1, "missing field": 2}
    assert dpo.split_hh("\n\nHuman: a\n\nAssistant: b") == ("\n\nHuman: a\n\nAssistant:", " b")


ids_lists = st.lists(st.integers(0, 99), max_size=30)
prompts = st.lists(st.integers(0, 99), min_size=1, max_size=30)
max_lens = st.integers(2, 40)


@FAST
@given(prompts, ids_lists, ids_lists, max_lens)
def test_truncate_pair_cuts_one_prompt_from_its_start_and_responses_only_when_needed(prompt, chosen, rejected, max_len):
    """truncate_pair's rules: one prompt for both responses, a suffix of the original (its end stays), never empty,
    as long as fits beside the longer response; responses are prefixes, cut only when a one-token prompt does not
    fit beside them; prompt + response <= max_len for both."""
    p, c, r = dpo.truncate_pair(prompt, chosen, rejected, max_len)
    assert p and p == prompt[len(prompt) - len(p) :]
    assert len(p) == min(len(prompt), max(1, max_len - max(len(chosen), len(rejected))))  # maximal
    for cut, whole in ((c, chosen), (r, rejected)):
        assert cut == whole[: len(cut)] and len(p) + len(cut) <= max_len
        assert cut == whole or (len(p) == 1 and len(cut) == max_len - 1)  # cut only if needed, and then to fit
    if len(prompt) + max(len(chosen), len(rejected)) <= max_len:
        assert (p, c, r) == (prompt, chosen, rejected)  # what fits is left alone


def test_truncate_pair_hand_example():
    """max_len 6, a 5-token prompt, responses of 2 and 4 tokens: the prompt keeps its last 2 tokens for both (6 - 4),
    nothing else is cut; at max_len 4 the prompt keeps 1 token and the longer response loses its last token."""
    prompt, chosen, rejected = [1, 2, 3, 4, 5], [10, 11], [20, 21, 22, 23]
    assert dpo.truncate_pair(prompt, chosen, rejected, 6) == ([4, 5], [10, 11], [20, 21, 22, 23])
    assert dpo.truncate_pair(prompt, chosen, rejected, 4) == ([5], [10, 11], [20, 21, 22])
    assert dpo.truncate_pair(prompt, chosen, rejected, 20) == (prompt, chosen, rejected)


def letter_tokenizer():
    return SimpleNamespace(encode=lambda text: [ord(c) - 96 for c in text], eot_id=0)


def test_encode_pair_gives_both_rows_the_same_prompt_tokens():
    """Responses of different lengths (2 and 5 tokens with <|endoftext|>) at max_len 7: both rows carry the same last
    2 prompt tokens, then their response and <|endoftext|>. (Cut per row, the shorter response's row would keep 5
    prompt tokens, so the two would be scored on different contexts.)"""
    chosen, rejected, n_prompt = dpo.encode_pair(letter_tokenizer(), "abcdefgh", "x", "wxyz", 7)
    assert (chosen, rejected, n_prompt) == ([7, 8, 24, 0], [7, 8, 23, 24, 25, 26, 0], 2)
    chosen, rejected, n_prompt = dpo.encode_pair(letter_tokenizer(), "abc", "uvwxyz", "x", 4)
    assert (chosen, rejected, n_prompt) == ([3, 21, 22, 23], [3, 24, 0], 1)  # a response longer than max_len


def reward_model_module():
    if not (ROOT / "reward_model.py").is_file():
        pytest.skip("reward_model.py does not exist yet")
    return importlib.import_module("reward_model")


@pytest.mark.parametrize("name", ["split_hh", "hh_pairs", "encode_pair"])
def test_hh_functions_match_reward_model_py(name):
    """dpo.py and reward_model.py parse and encode HH-RLHF identically (their copies of the same functions)."""
    rm = reward_model_module()
    if not hasattr(rm, name):
        pytest.skip(f"reward_model.py has no {name}")
    ours, theirs = getattr(dpo, name), getattr(rm, name)
    if name == "split_hh":
        for rec in DIALOGUES:
            for text in rec.values():
                if isinstance(text, str):
                    assert ours(text) == theirs(text)
    elif name == "hh_pairs":
        assert ours(DIALOGUES) == theirs(DIALOGUES)
    else:
        tok = SimpleNamespace(encode=lambda text: [ord(c) % 50 for c in text], eot_id=49)
        for max_len in (2, 5, 12, 100):
            for pair in dpo.hh_pairs(DIALOGUES)[0]:
                assert ours(tok, *pair, max_len) == theirs(tok, *pair, max_len)


@FAST
@given(prompts, ids_lists, ids_lists, max_lens)
def test_truncate_pair_gives_identical_results_in_dpo_and_reward_model(prompt, chosen, rejected, max_len):
    """truncate_pair is copied into reward_model.py: both copies cut every pair alike."""
    rm = reward_model_module()
    assert dpo.truncate_pair(prompt, chosen, rejected, max_len) == rm.truncate_pair(prompt, chosen, rejected, max_len)


@FAST
@given(logps, logps, logps, logps, betas)
def test_sigmoid_loss_equals_reward_model_bradley_terry_on_implicit_rewards(pi_c, pi_r, ref_c, ref_r, beta):
    """DPO is a Bradley-Terry model of the implicit rewards beta * (pi - ref): reward_model.py's loss on them."""
    rm = reward_model_module()
    losses, chosen_r, rejected_r = dpo.preference_loss(f64(pi_c), f64(pi_r), f64(ref_c), f64(ref_r), "sigmoid", beta)
    bt = rm.bradley_terry_loss(beta * (f64(pi_c) - f64(ref_c)), beta * (f64(pi_r) - f64(ref_r)))
    assert losses.mean().item() == pytest.approx(bt.item(), rel=1e-9)


def synthetic_hh(n, seed=0, marker="please"):
    """HH-formatted dialogue pairs with a learnable preference: the chosen response holds the marker word somewhere,
    the rejected one (same length in words) does not."""
    rng = random.Random(seed)
    words = "the cat sat on a mat dog ran far sun is hot cold day".split()
    records = []
    for _ in range(n):
        prompt = "\n\nHuman: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 4))) + "?\n\nAssistant:"
        good = [rng.choice(words) for _ in range(rng.randint(2, 4))]
        good.insert(rng.randint(0, len(good)), marker)
        bad = [rng.choice(words) for _ in range(len(good))]
        records.append({"chosen": prompt + " " + " ".join(good), "rejected": prompt + " " + " ".join(bad)})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@needs_bpe
def test_held_out_split_is_gpt_py_hh_sft_split(tmp_path):
    """dpo's held-out pairs are exactly the dialogues gpt.py --data hh_sft holds out from the same file."""
    gpt = importlib.import_module("gpt")
    path = write_jsonl(tmp_path / "hh.jsonl", synthetic_hh(45))
    train, val = dpo.load_pairs(SimpleNamespace(data_path=str(path), data=""), SimpleNamespace(master=False))
    assert len(val) == 2 and len(train) == 43
    tok = gpt.BPETokenizer()
    (_, _), (val_ids, _) = gpt.load_splits(SimpleNamespace(data="hh_sft", data_path=str(path)), tok)
    ids = [i for p, c, _ in val for i in gpt.hh_dialogue(p + c, tok)[0]]
    assert val_ids.tolist() == ids


# ---------------------------------------------------------------------------------------------- end-to-end runs


@pytest.fixture(scope="module")
def hh(tmp_path_factory):
    """A synthetic HH file (600 pairs: 570 train, 30 held out) and a random char-level GPT checkpoint for it."""
    folder = tmp_path_factory.mktemp("hh")
    records = synthetic_hh(600)
    path = write_jsonl(folder / "hh.jsonl", records)
    chars = "".join(sorted(set("".join(r["chosen"] + r["rejected"] for r in records))))
    torch.manual_seed(0)
    config = dpo.GPTConfig(block_size=64, vocab_size=len(chars), n_layer=2, n_head=2, n_embd=32)
    ckpt = {
        "model": dpo.GPT(config).state_dict(),
        "model_config": dataclasses.asdict(config),
        "tokenizer": {"type": "char", "chars": chars},
    }
    torch.save(ckpt, folder / "init.pt")
    small = write_jsonl(folder / "small.jsonl", records[:80])  # 76 train, 4 held out
    return SimpleNamespace(data=path, small=small, init=folder / "init.pt", folder=folder, chars=chars, config=config)


def base_args(hh):
    return [
        "--data_path",
        hh.data,
        "--init_from",
        hh.init,
        "--max_len",
        "64",
        "--sample_tokens",
        "16",
        "--device",
        "cpu",
    ]


def train_in_process(out_dir, *args):
    """dpo.py's main() without the subprocess: parse, validate, run; returns (final results, metrics rows)."""
    cfg = dpo.parse_config(dpo.Config, [*map(str, args), "--out_dir", str(out_dir)])
    dpo.validate(cfg)
    rt = dpo.setup_runtime(cfg)
    results = dpo.train(cfg, dpo.prepare_out_dir(cfg, "dpo", rt), rt)
    return results, metrics(out_dir)


def close(rows_a, rows_b, tol=1e-5):
    assert [r.keys() for r in rows_a] == [r.keys() for r in rows_b]
    for a, b in zip(rows_a, rows_b):
        assert a == pytest.approx(b, rel=tol, abs=tol), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", dpo.LOSS_TYPES)
def test_every_loss_type_runs_a_step(tmp_path, hh, loss_type):
    """One optimizer step of each loss type: finite metrics, the run folder, held-out results."""
    extra = ["--sft_weight", "0.5"] if loss_type == "hinge" else []  # RPO's NLL term on top of a loss
    results, rows = train_in_process(
        tmp_path / "run", *base_args(hh), "--loss_type", loss_type, "--batch_size", "4", "--max_steps", "1",
        "--eval_size", "8", "--num_samples", "2", "--lr", "1e-3", *extra,
    )  # fmt: skip
    for name in ("config.json", "metrics.jsonl", "final_results.json", "ckpt.pt", "samples.txt"):
        assert (tmp_path / "run" / name).is_file(), name
    train_row = next(r for r in rows if "train/loss" in r)
    assert all(math.isfinite(v) for v in train_row.values())
    assert 0 <= results["reward_acc"] <= 1 and results["loss_type"] == loss_type and results["pairs"] == 4
    # step 0: the policy is the reference, so every log-ratio is 0
    assert rows[0]["eval/logratio_acc"] == 0.5 and rows[0]["eval/logratio_margin"] == 0
    assert rows[0]["eval/reward_acc"] == 0.5 or loss_type in dpo.REFERENCE_FREE
    if loss_type == "sigmoid":
        assert rows[0]["eval/loss"] == pytest.approx(math.log(2))
    if loss_type == "hinge":
        assert rows[0]["eval/loss"] > 1  # hinge at h = 0, plus the NLL
    if loss_type == "kto":
        assert train_row["train/kto_kl"] >= 0


@pytest.mark.slow
def test_grad_accum_and_precomputed_reference_do_not_change_the_run(tmp_path, hh):
    """The loss is normalised by the pairs of the whole step, so 4 micro-batches give the metrics of one; cached
    reference log-probs give those of a reference forward at every step."""
    common = [*base_args(hh), "--batch_size", "8", "--max_steps", "3", "--eval_every", "3", "--lr", "3e-3"]
    _, plain = train_in_process(tmp_path / "plain", *common)
    _, accum = train_in_process(tmp_path / "accum", *common, "--grad_accum", "4")
    _, cached = train_in_process(tmp_path / "cached", *common, "--precompute_ref")
    close(plain, accum)
    close(plain, cached)


@pytest.mark.slow
def test_training_batches_give_chosen_and_rejected_rows_the_same_prompt(tmp_path, hh, monkeypatch):
    """In a run whose pairs are longer than --max_len, the chosen and rejected rows of every pair in a batch (the
    rows that go to collate) start with the same prompt tokens, also where the responses differ in length."""
    batches, collate = [], dpo.collate
    monkeypatch.setattr(dpo, "collate", lambda rows, pad_id=0: batches.append(rows) or collate(rows, pad_id))
    args = [*base_args(hh), "--max_len", "30", "--batch_size", "4", "--max_steps", "1", "--eval_size", "4"]
    train_in_process(tmp_path / "run", *args, "--num_samples", "0")
    cut_and_unequal = False
    for rows in batches:
        half = len(rows) // 2
        for (c, n_c), (r, n_r) in zip(rows[:half], rows[half:]):
            assert n_c == n_r and c[:n_c] == r[:n_r] and max(len(c), len(r)) <= 30
            cut_and_unequal |= max(len(c), len(r)) == 30 and len(c) != len(r)
    assert batches and cut_and_unequal  # the case that matters did occur


@pytest.mark.slow
@pytest.mark.plots
def test_run_writes_the_run_folder_and_resume_reproduces_metrics_exactly(tmp_path, hh, monkeypatch):
    """Stopped by SIGTERM after 3 of 6 steps and resumed: the same metrics as the uninterrupted run, including the
    state a resume must carry (BCO's running mean, cached reference log-probs, the optimizer, micro-batches)."""
    common = [*base_args(hh), "--data_path", hh.small, "--loss_type", "bco_pair", "--precompute_ref"]
    common += ["--grad_accum", "2", "--batch_size", "4", "--max_steps", "6", "--eval_every", "2", "--lr", "3e-3"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(dpo, monkeypatch, *common, "--out_dir", full)
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt", "samples.txt"):
        assert (full / name).is_file(), name
    proc = run_script("dpo.py", *common, "--out_dir", part, env={"FAULT_SIGTERM_AT_STEP": "3"})
    assert proc.returncode == 143, proc.stderr[-2000:]
    ckpt = torch.load(part / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 3 and ckpt["ref_logps"]["train"].shape == (76, 2) and ckpt["bco_count"] == 3 * 2 * 4
    proc = run_script("dpo.py", "--resume", "--out_dir", part)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert metrics(part) == metrics(full)
    results = json.loads((full / "final_results.json").read_text())
    assert (
        results["pairs"] == 24
        and results["heldout_pairs"] == 4
        and "policy (greedy)" in (full / "samples.txt").read_text()
    )


@pytest.mark.slow
def test_resume_restores_the_float16_loss_scale(tmp_path, hh):
    """--dtype float16 trains with a GradScaler: its state is saved in ckpt.pt and a resumed run continues from it
    (here a scale of 1024, as after overflows), not from the initial 65536."""
    out = tmp_path / "run"
    args = [*base_args(hh), "--dtype", "float16", "--batch_size", "4", "--eval_size", "4", "--num_samples", "0"]
    train_in_process(out, *args, "--max_steps", "2")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["scaler"]["scale"] > 1024.0  # 65536, halved at each step whose gradients overflowed
    ckpt["scaler"]["scale"] = 1024.0
    torch.save(ckpt, out / "ckpt.pt")
    train_in_process(out, "--resume", "--max_steps", "3")
    assert torch.load(out / "ckpt.pt", weights_only=True)["scaler"]["scale"] == 1024.0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_gloo_run_matches_one_process_on_the_same_pairs(tmp_path, hh, parallel):
    """torchrun with 2 CPU ranks of 4 pairs trains on the pairs one process of 8 takes, with the same metrics (so
    the gradient of the output layer, called outside the DDP/FSDP wrapper, is synchronised too)."""
    common = [*base_args(hh), "--max_steps", "3", "--eval_every", "3", "--lr", "3e-3", "--loss_type", "bco_pair"]
    out = tmp_path / parallel
    proc = torchrun(ROOT / "dpo.py", 2, *common, "--batch_size", "4", "--parallel", parallel, "--out_dir", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, single = train_in_process(tmp_path / "one", *common, "--batch_size", "8")
    close(metrics(out), single, tol=1e-4)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["pairs"] == 24 and len(ckpt["rng_ranks"]) == 2


def save_judge(path, hh, zero_head=False):
    """A reward_model.py checkpoint (body, head, task, tokenizer) of a random reward model for the hh fixture."""
    torch.manual_seed(1)
    judge = dpo.RewardModel(hh.config)
    if zero_head:
        torch.nn.init.zeros_(judge.head.weight)
        torch.nn.init.zeros_(judge.head.bias)
    ckpt = {
        "model": judge.body.state_dict(),
        "reward_head": judge.head.state_dict(),
        "reward_task": "preference",
        "tokenizer": {"type": "char", "chars": hh.chars},
        "model_config": dataclasses.asdict(hh.config),
    }
    torch.save(ckpt, path)
    return path


def test_judge_loader_matches_reward_model_py(tmp_path, hh):
    """dpo.py's copy of RewardModel and load_reward_model scores sequences exactly as reward_model.py's does."""
    rm = reward_model_module()
    path = save_judge(tmp_path / "rm.pt", hh)
    ours, spec, task = dpo.load_reward_model(path)
    theirs, *rest = rm.load_reward_model(path)
    ids = torch.randint(len(hh.chars), (3, 20))
    assert torch.equal(ours(ids), theirs(ids)) and [spec, task] == rest


@pytest.mark.slow
def test_judge_scores_policy_against_reference(tmp_path, hh):
    """--judge loads a reward_model.py checkpoint and reports eval/win_rate; a judge whose head is zero scores
    every response 0, so every comparison is a tie and the win rate is exactly 1/2."""
    save_judge(tmp_path / "rm.pt", hh, zero_head=True)
    args = [*base_args(hh), "--max_steps", "2", "--judge", tmp_path / "rm.pt", "--judge_prompts", "6"]
    results, rows = train_in_process(tmp_path / "run", *args, "--lr", "3e-3", "--precompute_ref")
    assert results["win_rate"] == 0.5 and rows[-1] == {"step": 2, "eval/win_rate": 0.5}
    assert "reference (greedy)" in (tmp_path / "run" / "samples.txt").read_text()


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize(
    "loss_type, args",
    [("sigmoid", ["--beta", "0.1"]), ("ipo", ["--beta", "0.1"]), ("simpo", ["--beta", "2", "--gamma", "0.5"])],
)
def test_heldout_reward_accuracy_rises_above_90_percent(tmp_path, hh, loss_type, args):
    """On pairs whose chosen response holds a marker word, the held-out implicit-reward accuracy climbs from 1/2
    (policy = reference) to > 0.9 within 30 steps."""
    results, rows = train_in_process(
        tmp_path / "run", *base_args(hh), "--loss_type", loss_type, *args, "--batch_size", "16", "--max_steps", "30",
        "--lr", "3e-3", "--min_lr", "3e-4", "--warmup_steps", "3", "--eval_every", "30", "--num_samples", "0",
    )  # fmt: skip
    assert rows[0]["eval/reward_acc"] == 0.5 or loss_type == "simpo"
    assert results["reward_acc"] > 0.9 and results["margin"] > 0, results
    assert results["logratio_acc"] > 0.9


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_named_and_keeps_the_last_checkpoint(tmp_path, hh):
    """An absurd learning rate blows the weights up; the first non-finite loss stops the run with exit code 1."""
    out = tmp_path / "run"
    proc = run_script("dpo.py", *base_args(hh), "--lr", "1e30", "--warmup_steps", "0", "--max_steps", "20",
                      "--save_every", "1", "--eval_every", "100", "--out_dir", out)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: loss is" in proc.stderr and "Traceback" not in proc.stderr
    step = int(proc.stderr.split("at step ")[1].split(";")[0])
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == step


def other_tokenizer_checkpoint(hh):
    path = hh.folder / "bpe.pt"
    model = dpo.GPT(dpo.GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=8))
    torch.save(
        {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "tokenizer": "gpt2"}, path
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--label_smoothing", "0.5"], "--label_smoothing"),
        (["--loss_type", "kto", "--batch_size", "1"], "--batch_size >= 2"),
        (["--batch_size", "6", "--grad_accum", "4"], "--grad_accum"),
        (["--max_len", "65"], "block_size"),
        (["--judge", "INIT"], "no reward head"),
        (["--reference", "BPE"], "another tokenizer"),
    ],
)
def test_impossible_settings_are_refused_before_training(tmp_path, hh, capsys, args, needle):
    """The checks behind exit code 2, in-process: each names the setting and exits before any step."""
    args = [str(hh.init) if a == "INIT" else str(other_tokenizer_checkpoint(hh)) if a == "BPE" else a for a in args]
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "run", *base_args(hh), *args)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.slow
def test_char_checkpoint_refuses_data_outside_its_vocabulary(tmp_path, hh, capsys):
    """Dialogues with characters the char-level policy cannot encode are bad input, not a KeyError."""
    odd = {"chosen": "\n\nHuman: q\n\nAssistant: Zebra!", "rejected": "\n\nHuman: q\n\nAssistant: no"}
    path = write_jsonl(tmp_path / "odd.jsonl", [odd] * 30)
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "run", *base_args(hh), "--data_path", path)
    assert exit_info.value.code == 2 and "outside the model's vocabulary" in capsys.readouterr().err


@pytest.mark.slow
def test_unusable_pairs_are_refused_with_the_skip_counts(tmp_path, hh, capsys):
    """A file whose every record is skipped (here: identical responses) is an error naming why."""
    same = {"chosen": "\n\nHuman: q\n\nAssistant: no", "rejected": "\n\nHuman: q\n\nAssistant: no"}
    path = write_jsonl(tmp_path / "same.jsonl", [same] * 30)
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "run", *base_args(hh), "--data_path", path)
    assert exit_info.value.code == 2 and "30 chosen == rejected" in capsys.readouterr().err


def test_help_lists_every_setting(capsys):
    """--help works (no stray % in a help text) and names every Config field."""
    with pytest.raises(SystemExit) as exit_info:
        dpo.parse_config(dpo.Config, ["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(f"--{f.name}" in out for f in dataclasses.fields(dpo.Config))


# ------------------------------------------------------------------------------------- --data arithmetic


ARITH_CHARS = "\n*+-0123456789="  # gpt.py's char vocabulary of --data arithmetic


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    """A char-level policy trained for 150 steps on 1-digit additions (its sampled answers are a mix of right and
    wrong), saved as a gpt.py checkpoint."""
    folder = tmp_path_factory.mktemp("arith")
    tok, rng = dpo.CharTokenizer(ARITH_CHARS), random.Random(0)
    ids = torch.tensor(tok.encode("".join("".join(dpo.arithmetic_problem(rng, 1, "+")) for _ in range(3000))))
    torch.manual_seed(0)
    config = dpo.GPTConfig(block_size=16, vocab_size=len(ARITH_CHARS), n_layer=1, n_head=2, n_embd=32)
    model = dpo.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        windows = torch.stack([ids[i : i + 17] for i in torch.randint(len(ids) - 17, (32,)).tolist()])
        _, loss = model(windows[:, :-1], targets=windows[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(config), "tokenizer": tok.spec}
    torch.save(ckpt, folder / "sft.pt")
    return SimpleNamespace(init=folder / "sft.pt", model=model.eval(), tok=tok, config=config, folder=folder)


def arith_args(arith, *extra):
    return [
        "--data", "arithmetic", "--ops", "+", "--init_from", arith.init, "--max_len", "16", "--device", "cpu",
        "--pair_prompts", "48", "--pair_samples", "8", "--eval_size", "32", "--batch_size", "8", "--lr", "3e-3",
        "--num_samples", "2", *extra,
    ]  # fmt: skip


def addition(prompt):
    """The right answer of "a+b=", computed here rather than by dpo.py."""
    a, b = prompt.removesuffix("=").split("+")
    return f"{int(a) + int(b)}\n"


def read_pairs(out_dir):
    return [json.loads(line) for line in (out_dir / "pairs.jsonl").read_text().splitlines()]


def greedy_answer(model, tok, prompt, n_tokens=4):
    """A greedy answer by a plain loop, without the KV cache, through the first newline."""
    ids = tok.encode(prompt)
    for _ in range(n_tokens):
        ids.append(model(torch.tensor([ids]))[0][0, -1].argmax().item())
        if ids[-1] == tok.encode("\n")[0]:
            break
    return tok.decode(ids[len(tok.encode(prompt)) :])


def is_held_out(prompt):
    """SPEC section 8's rule, written here rather than taken from dpo.py."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def heldout_problems(n, digits=1, ops="+"):
    """The distinct held-out problems among n held-out draws of random.Random(1234), as SPEC section 8 asks."""
    rng = random.Random(1234)
    problems = {}
    while n > 0:
        prompt, answer = dpo.arithmetic_problem(rng, digits, ops)
        if is_held_out(prompt):
            problems[prompt] = answer
            n -= 1
    return list(problems.items())


@pytest.mark.slow
def test_arithmetic_gold_pairs_have_a_right_chosen_and_a_wrong_rejected_answer(tmp_path, arith):
    """--data arithmetic writes pairs.jsonl before training: in every pair the chosen answer is the right one and the
    rejected one is not (checked by the test's own addition); held-out pairs come from the distinct held-out problems
    of random.Random(1234); eval/accuracy at step 0 is the greedy accuracy of the starting policy on those problems."""
    results, rows = train_in_process(tmp_path / "run", *arith_args(arith), "--max_steps", "2", "--eval_every", "2")
    records = read_pairs(tmp_path / "run")
    train = [r for r in records if r["split"] == "train"]
    heldout = [r for r in records if r["split"] == "heldout"]
    assert len(train) >= 5 and len(heldout) >= 2 and len(records) == len(train) + len(heldout)
    for r in records:
        assert r["chosen"] == addition(r["prompt"]) != r["rejected"] and r["answer"] == r["chosen"]
    problems = heldout_problems(32)  # 1-digit additions: 16 of the 100 are held out, 15 of them drawn
    assert {r["prompt"] for r in heldout} <= {p for p, _ in problems}
    right = [greedy_answer(arith.model, arith.tok, p) == a for p, a in problems]
    assert rows[0]["eval/accuracy"] == results["accuracy_before"] == pytest.approx(sum(right) / len(problems))
    assert rows[0]["eval/n_problems"] == results["heldout_problems"] == len(problems) == 15
    assert "eval/accuracy" in rows[-1] and results["gold_agreement"] == 1
    assert results["train_pairs"] == len(train) and results["heldout_pairs"] == len(heldout)
    assert (tmp_path / "run" / "final_results.json").is_file()


def save_arith_judge(path, arith, chars=ARITH_CHARS, seed=3, zero_head=False):
    """A reward_model.py checkpoint (body, head, task, tokenizer) of a random reward model for arithmetic answers."""
    torch.manual_seed(seed)
    judge = dpo.RewardModel(arith.config)
    if zero_head:
        torch.nn.init.zeros_(judge.head.weight)
        torch.nn.init.zeros_(judge.head.bias)
    ckpt = {
        "model": judge.body.state_dict(),
        "reward_head": judge.head.state_dict(),
        "reward_task": "orm",
        "tokenizer": {"type": "char", "chars": chars},
        "model_config": dataclasses.asdict(arith.config),
    }
    torch.save(ckpt, path)
    return judge.eval()


@pytest.mark.slow
def test_arithmetic_judge_ranks_the_pairs_and_its_agreement_with_gold_is_reported(tmp_path, arith):
    """With --judge, chosen is the answer the reward model scores higher (its score at the last token of prompt +
    answer, computed here), and gold_agreement is the share of pairs whose chosen answer is right and rejected wrong."""
    judge = save_arith_judge(tmp_path / "rm.pt", arith)
    results, _ = train_in_process(
        tmp_path / "run", *arith_args(arith, "--judge", tmp_path / "rm.pt", "--max_steps", "1")
    )
    records = read_pairs(tmp_path / "run")
    assert len(records) > 10

    @torch.no_grad()
    def score(prompt, answer):  # the judge's score at the last token of prompt + answer
        return judge(torch.tensor([arith.tok.encode(prompt + answer)]))[0, -1].item()

    assert all(score(r["prompt"], r["chosen"]) > score(r["prompt"], r["rejected"]) for r in records)
    agree = [r["chosen"] == addition(r["prompt"]) != r["rejected"] for r in records]
    assert results["gold_agreement"] == pytest.approx(sum(agree) / len(agree)) and 0 < sum(agree) < len(agree)
    assert "win_rate" in results


def answer_logprob(model, tok, prompt, answer):
    """log p(answer | prompt) by a plain forward: the sum over the answer's tokens."""
    ids = tok.encode(prompt + answer)
    n = len(tok.encode(prompt))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0]  # (T, V)
    logp = torch.log_softmax(logits.float(), -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(n, len(ids)))


def test_reward_model_measures_sampled_answers_as_grpo_does(tmp_path, arith, monkeypatch):
    """--reward_model's eval/sample_*: four answers a held-out problem at temperature 1 (here a stand-in that answers
    right or off by one); the exact share over all problems and over those at even (a) and odd (b) places of the
    sorted list; the reward model's mean score (its score at the answer's last token); and the mean over answers of
    log pi(answer) - log pi_ref(answer), each by the test's own forward."""
    rm = save_arith_judge(tmp_path / "rm.pt", arith)
    ref = dpo.GPT(arith.config)
    ref.load_state_dict(arith.model.state_dict())
    with torch.no_grad():
        ref.lm_head.weight.mul_(1.5)  # another model: a KL to measure
    cfg = dpo.Config(data="arithmetic", ops="+", digits=1, batch_size=8, max_len=16)
    rt = dpo.Runtime(torch.device("cpu"), torch.float32)
    run = SimpleNamespace(cfg=cfg, rt=rt, model=arith.model, ref=ref.eval(), tok=arith.tok)
    run.problems = dpo.held_out_problems(1, "+", 40)
    assert run.problems == sorted(heldout_problems(40))  # the held-out problems, sorted
    run.rm = dpo.load_scorer(run, str(tmp_path / "rm.pt"), "reward_model")
    rng = random.Random(0)
    sampled = []

    def stand_in(net, prompts, tok, cfg, rt, temperature=0.0, generator=None, batch=0):
        assert net is arith.model and temperature == 1.0
        texts = [f"{int(addition(p)) + rng.choice([0, 0, 1])}\n" for p in prompts]
        sampled.extend(zip(prompts, texts))
        return texts

    monkeypatch.setattr(dpo, "respond", stand_in)
    metrics = dpo.sampled_measures(run)
    prompts = sorted(p for p, _ in run.problems)
    assert [p for p, _ in sampled] == [p for p in prompts for _ in range(4)]
    right = [sum(a == addition(p) for q, a in sampled if q == p) / 4 for p in prompts]
    assert metrics["eval/sample_accuracy"] == pytest.approx(sum(right) / len(right), abs=1e-6)
    assert metrics["eval/sample_accuracy_a"] == pytest.approx(sum(right[0::2]) / len(right[0::2]), abs=1e-6)
    assert metrics["eval/sample_accuracy_b"] == pytest.approx(sum(right[1::2]) / len(right[1::2]), abs=1e-6)
    with torch.no_grad():
        scores = [rm(torch.tensor([arith.tok.encode(p + a)]))[0, -1].item() for p, a in sampled]
    assert metrics["eval/sample_rm_score"] == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    kl = [answer_logprob(arith.model, arith.tok, p, a) - answer_logprob(ref, arith.tok, p, a) for p, a in sampled]
    assert metrics["eval/sample_kl"] == pytest.approx(sum(kl) / len(kl), abs=1e-4) and abs(sum(kl)) > 1e-2


@pytest.mark.slow
def test_reward_model_is_logged_at_every_evaluation_and_kl_starts_at_0(tmp_path, arith):
    """End to end: with --reward_model, every evaluation logs eval/sample_*; at step 0 the policy is its reference."""
    save_arith_judge(tmp_path / "rm.pt", arith)
    args = arith_args(arith, "--reward_model", tmp_path / "rm.pt", "--max_steps", "2", "--eval_every", "1")
    _, rows = train_in_process(tmp_path / "run", *args)
    evals = [r for r in rows if "eval/sample_kl" in r]
    assert len(evals) == 3 and evals[0]["eval/sample_kl"] == pytest.approx(0.0, abs=1e-5)
    assert all({"eval/sample_accuracy_a", "eval/sample_accuracy_b", "eval/sample_rm_score"} <= set(r) for r in evals)
    assert evals[-1]["eval/sample_kl"] != evals[0]["eval/sample_kl"]


@pytest.mark.slow
def test_arithmetic_resume_reads_the_pairs_back_and_reproduces_the_run(tmp_path, arith, monkeypatch):
    """Stopped after 2 of 4 steps and resumed: the pairs come from pairs.jsonl (not rebuilt from the trained policy)
    and the metrics equal the uninterrupted run's."""
    args = [*arith_args(arith), "--max_steps", "4", "--eval_every", "2"]
    _, full = train_in_process(tmp_path / "full", *args)
    monkeypatch.setenv("FAULT_SIGTERM_AT_STEP", "2")
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "part", *args)
    assert exit_info.value.code == 143
    monkeypatch.delenv("FAULT_SIGTERM_AT_STEP")
    greedy = dpo.respond  # evaluation answers greedily; only building the pairs samples (temperature 1)

    def respond(net, prompts, tok, cfg, rt, temperature=0.0, *rest):
        assert temperature == 0.0, "--resume rebuilt the pairs"
        return greedy(net, prompts, tok, cfg, rt, temperature, *rest)

    monkeypatch.setattr(dpo, "respond", respond)
    _, resumed = train_in_process(tmp_path / "part", "--resume")
    assert resumed == full and read_pairs(tmp_path / "part") == read_pairs(tmp_path / "full")


def without_newline(folder, arith):
    """The arith policy with its newline character renamed: answers have no end token."""
    ckpt = torch.load(arith.init, weights_only=True)
    ckpt["tokenizer"] = {"type": "char", "chars": ARITH_CHARS.replace("\n", "x")}
    torch.save(ckpt, folder / "no_newline.pt")
    return folder / "no_newline.pt"


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda t, a, hh: ["--init_from", hh.init], "vocabulary lacks '+0123456789='"),
        (lambda t, a, hh: ["--init_from", without_newline(t, a)], "vocabulary lacks '\\n'"),
        (lambda t, a, hh: ["--judge", a.init], "no reward head"),
        (lambda t, a, hh: ["--judge", save_arith_judge(t / "rm.pt", a, chars="abc") and t / "rm.pt"], "cannot encode"),
        (
            lambda t, a, hh: ["--judge", save_arith_judge(t / "rm.pt", a, zero_head=True) and t / "rm.pt"],
            "without pairs",
        ),
        (lambda t, a, hh: ["--pair_samples", "1"], "--pair_samples"),
        (lambda t, a, hh: ["--ops", "/"], "--ops"),
        (lambda t, a, hh: ["--reward_model", str(t / "missing.pt")], "--reward_model"),
    ],
)
def test_arithmetic_bad_input_is_refused_before_training(tmp_path, arith, hh, capsys, make, needle):
    """A policy whose vocabulary cannot write the problems, a judge that is no reward model or cannot encode the
    answers, a judge that ties every answer (no pair), impossible settings: one line, exit 2, no checkpoint."""
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "run", *arith_args(arith, *make(tmp_path, arith, hh)))
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.slow
def test_default_max_len_is_the_models_block_size(tmp_path, arith):
    """--max_len left unset is the models' block_size: a block_size-16 policy runs without --max_len (it stopped on
    the default 256 before), and config.json records the 16 the run used."""
    args = arith_args(arith, "--max_steps", "1", "--eval_every", "1")
    i = args.index("--max_len")
    del args[i : i + 2]
    train_in_process(tmp_path / "run", *args)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_len"] == 16


@FAST
@given(st.integers(0, 10**6), st.integers(1, 3), st.sampled_from(["+", "-", "*", "+-*"]), st.booleans())
def test_draw_problem_keeps_to_its_side_of_the_held_out_rule(seed, digits, ops, held):
    """draw_problem(held=True) gives a problem the test's own crc32 rule holds out, held=False one it does not."""
    prompt, answer = dpo.draw_problem(random.Random(seed), digits, ops, held)
    assert is_held_out(prompt) == held == dpo.held_out(prompt)
    assert dpo.arithmetic_reward(answer, answer) == 1.0


@pytest.mark.slow
def test_arithmetic_pairs_train_on_no_held_out_problem_and_evaluate_only_distinct_held_out_ones(tmp_path, arith):
    """SPEC section 8: no training pair is a held-out problem (crc32 of the prompt 0 mod 10); every held-out pair and
    every problem of eval/accuracy is one, each once."""
    args = arith_args(arith, "--pair_prompts", "96", "--eval_size", "40", "--max_steps", "1", "--eval_every", "1")
    results, rows = train_in_process(tmp_path / "run", *args)
    records = read_pairs(tmp_path / "run")
    train = [r["prompt"] for r in records if r["split"] == "train"]
    heldout = [r["prompt"] for r in records if r["split"] == "heldout"]
    assert len(train) >= 10 and heldout
    assert not any(is_held_out(p) for p in train) and all(is_held_out(p) for p in heldout)
    assert len(set(heldout)) == len(heldout)  # one pair per held-out problem at most
    problems = heldout_problems(40)
    assert rows[0]["eval/n_problems"] == len(problems) == 15  # of the 16 held-out 1-digit additions
    right = [greedy_answer(arith.model, arith.tok, p) == a for p, a in problems]
    assert results["accuracy_before"] == pytest.approx(sum(right) / 15)


# -------------------------------------------------------------------- LD-DPO and TR-DPO (issue 30), end to end


def ld_run(ld_alpha):
    """The parts of a run pair_logprobs reads: the letter tokenizer (ids 1-10 for a-j, 0 ends a response)."""
    cfg = SimpleNamespace(max_len=32, ld_alpha=ld_alpha)
    rt = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    return SimpleNamespace(cfg=cfg, rt=rt, tok=letter_tokenizer())


@pytest.mark.parametrize("ld_alpha", [1.0, 0.5, 0.0])
def test_ld_dpo_weighs_the_tokens_past_the_shorter_response(ld_alpha):
    """LD-DPO (Liu et al. 2024): the chosen response "de" has 3 tokens with <|endoftext|>, the rejected "fghij" 6;
    the rejected one's log-prob is its first 3 tokens' plus ld_alpha times the last 3 (chain rule, computed here),
    the shorter one's is unchanged. The counts are the tokens summed (ld_alpha 0: the shared length)."""
    with torch.no_grad():
        logp, n_tokens = dpo.pair_logprobs(ld_run(ld_alpha), MODEL, [("abc", "de", "fghij")])
        prompt = [1, 2, 3]
        chosen = chain_rule_logprob(MODEL, prompt, [4, 5, 0])
        head = chain_rule_logprob(MODEL, prompt, [6, 7, 8])
        tail = chain_rule_logprob(MODEL, prompt + [6, 7, 8], [9, 10, 0])
    assert logp.tolist() == pytest.approx([chosen, head + ld_alpha * tail], abs=1e-4)
    assert n_tokens.tolist() == [3, 6 if ld_alpha > 0 else 3]


@FAST
@given(st.integers(0, 1000), st.integers(0, 1000), st.floats(0, 1))
def test_sync_reference_mixes_every_weight_once(seed_ref, seed_policy, alpha):
    """sync_reference(ref, policy, alpha) sets every reference weight to alpha policy + (1 - alpha) ref, in place: 1
    copies the policy exactly, 0 leaves ref exactly as it was; the tied embedding and output weights are mixed once."""
    ref = tiny_model(seed=seed_ref)
    policy = tiny_model(seed=seed_policy)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    dpo.sync_reference(ref, policy, alpha)
    after = ref.state_dict()
    assert ref.lm_head.weight is ref.transformer.wte.weight
    for name, p in policy.state_dict().items():
        if alpha == 1:
            assert torch.equal(after[name], p), name
        elif alpha == 0:
            assert torch.equal(after[name], before[name]), name
        else:
            assert torch.allclose(after[name], alpha * p + (1 - alpha) * before[name], rtol=1e-5, atol=1e-6), name
    for alpha in (0.0, 1.0):  # the endpoints, whatever hypothesis draws
        ref = tiny_model(seed=seed_ref)
        dpo.sync_reference(ref, policy, alpha)
        expected = policy if alpha == 1 else tiny_model(seed=seed_ref)
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), expected.state_dict().values()))


NEW_FORMS = [
    ["--f_divergence", "forward_kl"],
    ["--f_divergence", "js", "--loss_type", "hinge"],
    ["--f_divergence", "alpha", "--f_alpha", "0.3", "--loss_type", "ipo"],
    ["--loss_type", "sigmoid_norm"],
    ["--loss_type", "aot", "--label_smoothing", "0.1"],
    ["--loss_type", "aot_unpaired"],
    ["--ld_alpha", "0.5"],
    ["--ref_sync_steps", "1", "--ref_mixup", "0.5"],
]


@pytest.mark.slow
@pytest.mark.parametrize("args", NEW_FORMS, ids=" ".join)
def test_every_new_form_trains(tmp_path, hh, args):
    """Two steps of each new flag: finite metrics, and at step 0 (policy = reference, so every f'(1) is equal) the
    loss of the sigmoid family is log 2."""
    _, rows = train_in_process(
        tmp_path / "run", *base_args(hh), *args, "--batch_size", "4", "--max_steps", "2", "--eval_every", "1",
        "--eval_size", "8", "--num_samples", "1", "--lr", "3e-3",
    )  # fmt: skip
    assert all(math.isfinite(v) for r in rows for v in r.values())
    if "hinge" not in args and "ipo" not in args:
        assert rows[0]["eval/loss"] == pytest.approx(math.log(2))
    assert any(r.get("eval/logratio_margin", 0) != 0 for r in rows[1:])  # it learned something


@pytest.mark.slow
@pytest.mark.parametrize("mixup", [1.0, 0.0])
def test_ref_sync_with_mixup_one_makes_the_reference_the_policy(tmp_path, hh, mixup):
    """--ref_sync_steps 1 --ref_mixup 1 (TR-DPO's hard update every step): after each step the reference is the
    policy, so the next evaluation sees log-ratios 0 (loss log 2) and ckpt.pt's reference is its policy; --ref_mixup
    0 leaves the reference where it was."""
    out = tmp_path / "run"
    _, rows = train_in_process(
        out, *base_args(hh), "--ref_sync_steps", "1", "--ref_mixup", str(mixup), "--batch_size", "4",
        "--max_steps", "2", "--eval_every", "1", "--eval_size", "8", "--num_samples", "0", "--lr", "1e-2",
    )  # fmt: skip
    evals = [r for r in rows if "eval/loss" in r]
    assert len(evals) == 3  # steps 0, 1 and the end
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    same = [torch.equal(ckpt["model"][k], v) for k, v in ckpt["ref_model"].items()]
    if mixup == 1:
        assert all(r["eval/logratio_margin"] == 0 and r["eval/loss"] == pytest.approx(math.log(2)) for r in evals)
        assert all(same)
    else:
        assert evals[1]["eval/logratio_margin"] != 0 and not all(same)
    reference = dpo.GPT(hh.config)
    reference.load_state_dict(ckpt["ref_model"])
    assert ckpt["ref_checksum"] == dpo.weights_checksum(reference)


@pytest.mark.slow
def test_resume_with_ref_sync_continues_from_the_synced_reference(tmp_path, hh, monkeypatch):
    """Stopped after 3 of 5 steps with the reference synced every 2 and resumed: the metrics of the uninterrupted
    run (the synced reference is in ckpt.pt); a checkpoint whose reference weights were altered is refused."""
    args = [*base_args(hh), "--ref_sync_steps", "2", "--ref_mixup", "0.5", "--batch_size", "4", "--max_steps", "5"]
    args += ["--eval_every", "2", "--eval_size", "8", "--num_samples", "0", "--lr", "1e-2"]
    _, full = train_in_process(tmp_path / "full", *args)
    monkeypatch.setenv("FAULT_SIGTERM_AT_STEP", "3")
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "part", *args)
    assert exit_info.value.code == 143
    monkeypatch.delenv("FAULT_SIGTERM_AT_STEP")
    ckpt = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)
    torch.save(ckpt, tmp_path / "intact.pt")
    ckpt["ref_model"]["transformer.ln_f.bias"] += 0.5
    torch.save(ckpt, tmp_path / "part" / "ckpt.pt")
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "part", "--resume")
    assert exit_info.value.code == 2
    (tmp_path / "intact.pt").replace(tmp_path / "part" / "ckpt.pt")
    _, resumed = train_in_process(tmp_path / "part", "--resume")
    assert resumed == full


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--f_divergence", "kl"], "--f_divergence 'kl'"),
        (["--f_divergence", "js", "--loss_type", "nca_pair"], "--f_divergence js needs"),
        (["--f_divergence", "alpha", "--f_alpha", "1"], "--f_alpha"),
        (["--f_alpha", "0"], "--f_alpha"),
        (["--ld_alpha", "1.5"], "--ld_alpha"),
        (["--ld_alpha", "-0.1"], "--ld_alpha"),
        (["--ref_mixup", "2"], "--ref_mixup"),
        (["--ref_sync_steps", "-1"], "--ref_sync_steps"),
        (["--ref_sync_steps", "2", "--precompute_ref"], "--precompute_ref"),
        (["--ref_sync_steps", "2", "--reference", "INIT"], "--reference"),
        (["--max_len", "1"], "--max_len"),
        (["--loss_type", "aot_paired"], "--loss_type"),
    ],
)
def test_bad_values_of_the_new_flags_exit_2_with_one_line(tmp_path, hh, capsys, args, needle):
    args = [str(hh.init) if a == "INIT" else a for a in args]
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(tmp_path / "run", *base_args(hh), *args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_ref_sync_under_two_process_fsdp_matches_one_process(tmp_path, hh):
    """sync_reference gathers FSDP2's sharded policy weights whole: 2 CPU ranks of 4 pairs with the reference synced
    every step give the metrics of one process of 8."""
    common = [*base_args(hh), "--max_steps", "3", "--eval_every", "1", "--eval_size", "8", "--lr", "3e-3"]
    common += ["--ref_sync_steps", "1", "--ref_mixup", "0.5", "--num_samples", "0"]
    out = tmp_path / "fsdp"
    proc = torchrun(ROOT / "dpo.py", 2, *common, "--batch_size", "4", "--parallel", "fsdp", "--out_dir", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, single = train_in_process(tmp_path / "one", *common, "--batch_size", "8")
    close(metrics(out), single, tol=1e-4)


def test_a_prm_is_refused_as_judge_or_reward_model(tmp_path, capsys):
    """dpo.py scores a whole answer at its last token; a prm, labelled up to the first wrong step, judges only the
    last step there: --judge or --reward_model PRM ends with one line and exit code 2."""
    from types import SimpleNamespace

    chars = "\n*+-0123456789="
    path = char_checkpoint(tmp_path / "prm.pt", chars, block_size=32, reward_head=True)
    ckpt = torch.load(path, weights_only=True)
    ckpt["reward_task"] = "prm"
    torch.save(ckpt, path)
    run = SimpleNamespace(tok=dpo.CharTokenizer(chars), rt=dpo.Runtime(torch.device("cpu"), torch.float32))
    with pytest.raises(SystemExit) as e:
        dpo.load_scorer(run, str(path), "judge")
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "prm" in lines[0]
