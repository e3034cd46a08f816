"""The `model` shared block of gpt.py (SPEC section 3): logits and log-probs, causality, left padding, the KV
cache, the sampler, eos handling, initialisation, weight tying and loading GPT-2 weights in the Hugging Face
layout. Oracles are independent of the code under test: log-softmax in float64, unpadded single-row runs, a
naive generation loop, chi-square tests of sample counts, and a GPT-2 forward written here from raw tensors."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from gpt import GPT, GPTConfig, KVCache, generate, linear_logprobs, sample_next, sampling_logits, token_logprobs

FAST = settings(max_examples=25, deadline=None)
ATOL = 1e-5  # float32 logits of the tiny model, computed along two different paths

# chi-square critical values at p = 0.001 (scipy is not a dependency): df -> x such that P(X > x) = 0.001
CHI2_CRIT_001 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spin-waiting makes
    each forward ~500x slower; restored afterwards so other modules keep their setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config(**kw):
    base = dict(block_size=64, vocab_size=61, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    return GPTConfig(**{**base, **kw})


def tiny_model(seed=0, scale=3.0, **kw):
    """A tiny GPT in eval mode. Matrices are scaled up from the 0.02 init so attention is peaked and logits
    spread out: a leak across positions or rows then shows as a large change, not a 1e-7 one."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def fixed_distribution_model(z):
    """A GPT whose next-token logits are exactly `z` at every position, whatever the input: ln_f outputs the
    constant unit vector e0 (weight 0, bias e0), so logits = wte @ e0 = wte[:, 0] = z."""
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=len(z), block_size=96)).eval()
    with torch.no_grad():
        ln_f = model.transformer.ln_f
        ln_f.weight.zero_()
        ln_f.bias.zero_()
        ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = torch.as_tensor(z, dtype=torch.float32)
    return model


def left_pad(prompts, pad_ids=None):
    """(idx, attention_mask) for a list of prompts, left-padded to the longest; pad_ids gives each row's
    (arbitrary) pad token, so the test also checks that the content of padding does not matter."""
    width = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, : width - len(p)] = 0 if pad_ids is None else pad_ids[i]
        idx[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return idx, mask


def greedy_reference(model, prompt, n):
    """Greedy decoding the slow, obvious way: run the whole unpadded sequence, take the argmax, append."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


# -------------------------------------------------------------------------------------- logits and log-probs


@FAST
@given(st.integers(1, 3), st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_softmax_of_logits_sums_to_one_at_every_position(B, T, seed):
    """forward returns finite (B, T, V) logits whose softmax is a distribution at every position."""
    torch.manual_seed(seed)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad():
        logits, loss = model(idx)
    assert logits.shape == (B, T, model.config.vocab_size) and loss is None
    assert torch.isfinite(logits).all()
    total = torch.softmax(logits.double(), dim=-1).sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-9, rtol=0)


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(2, 50),
    st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e5, 1e7]),
    st.integers(0, 2**31 - 1),
)
def test_token_logprobs_are_nonpositive_and_equal_log_softmax_gathered(B, T, V, scale, seed):
    """token_logprobs = log_softmax(logits)[target] (float64 oracle), always <= 0, and exp of the log-probs of
    all V targets sums to 1, for logits of any magnitude (no overflow from large logits)."""
    torch.manual_seed(seed)
    logits = torch.randn(B, T, V) * scale
    targets = torch.randint(0, V, (B, T))
    logp = token_logprobs(logits, targets)
    assert logp.shape == (B, T) and logp.dtype == torch.float32
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    oracle = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    tol = 8 * torch.finfo(torch.float32).eps * logits.abs().max().item() + 1e-6  # float32 rounding of the logits
    torch.testing.assert_close(logp.double(), oracle, atol=tol, rtol=0)
    every = torch.stack([token_logprobs(logits, torch.full((B, T), v)) for v in range(V)], -1)  # (B, T, V)
    torch.testing.assert_close(every.double().logsumexp(-1), torch.zeros(B, T, dtype=torch.float64), atol=tol, rtol=0)


def test_token_logprobs_of_bfloat16_logits_are_float32_and_nonpositive():
    """Low-precision logits (autocast) give float32 log-probs, still <= 0 and close to the float64 oracle."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 7, 33) * 5).bfloat16()
    targets = torch.randint(0, 33, (4, 7))
    logp = token_logprobs(logits, targets)
    assert logp.dtype == torch.float32 and (logp <= 0).all()
    oracle = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), oracle, atol=1e-5, rtol=0)


@FAST
@given(st.sampled_from([0.3, 0.5, 1.0, 2.0]), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_log_probs_of_sampled_tokens_are_those_of_the_sampling_distribution(temperature, top_k, seed):
    """Tokens drawn by sample_next at (temperature, top_k) are scored by token_logprobs under the same
    distribution: log softmax(logits / temperature) renormalised over the top_k set (float64 oracle); a token
    outside that set is never drawn, and the logits of the excluded tokens change neither the log-probs nor get a
    gradient: their probability under the training distribution is never used."""
    torch.manual_seed(seed)
    logits = (torch.randn(64, 12) * 2).requires_grad_(True)
    drawn = sample_next(logits.detach(), temperature, top_k, torch.Generator().manual_seed(seed))
    kth = logits.detach().topk(top_k, -1).values[:, -1:]
    inside = logits.detach() >= kth
    assert inside.gather(1, drawn[:, None]).all()
    logp = token_logprobs(logits, drawn, temperature, top_k)
    z = (logits.detach().double() / temperature).masked_fill(~inside, float("-inf"))
    oracle = torch.log_softmax(z, -1).gather(1, drawn[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), oracle, atol=1e-5, rtol=1e-5)
    logp.sum().backward()
    assert (logits.grad[~inside] == 0).all()
    moved = logits.detach() + torch.randn(64, 12).abs() * (~inside) * -3  # excluded logits pushed further down
    torch.testing.assert_close(token_logprobs(moved, drawn, temperature, top_k), logp.detach(), atol=0, rtol=0)


def test_a_token_below_the_top_k_is_scored_not_excluded_and_stays_finite():
    """After an update a sampled token can fall out of the policy's top_k set: it is then kept in the set it is
    scored over (sampling_logits' keep), so its log-prob and gradient stay finite instead of -inf (a k3 KL of
    exp(inf), a NaN run)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], requires_grad=True)
    logp = token_logprobs(logits, torch.tensor([3]), 1.0, 2)
    expected = torch.log_softmax(torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64), -1)[2]
    torch.testing.assert_close(logp.double(), expected[None], atol=1e-6, rtol=1e-6)
    logp.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0
    assert sampling_logits(logits.detach(), 1.0, 2)[0, 3] == float("-inf")  # what the sampler itself excludes


def test_loss_is_mean_cross_entropy_over_targets_not_minus_one():
    """forward(idx, targets) returns -mean log p(target) over the positions whose target is not -1 (float64
    hand computation), together with the full (B, T, V) logits."""
    torch.manual_seed(0)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (3, 11))
    targets = torch.randint(0, model.config.vocab_size, (3, 11))
    targets[0, :4] = -1
    targets[2, 7:] = -1
    targets[1, 5] = -1
    with torch.no_grad():
        logits, loss = model(idx, targets)
        plain, _ = model(idx)
    assert logits.shape == (3, 11, model.config.vocab_size)
    torch.testing.assert_close(logits, plain)
    logp = torch.log_softmax(plain.double(), -1)
    terms = [-logp[b, t, targets[b, t]] for b in range(3) for t in range(11) if targets[b, t] != -1]
    assert len(terms) == 33 - 4 - 4 - 1
    assert loss.item() == pytest.approx(sum(terms).item() / len(terms), abs=1e-5)


# ---------------------------------------------------------------------------------------------------- causality


@FAST
@given(st.integers(1, 39), st.integers(0, 2**31 - 1), st.booleans())
def test_changing_a_future_token_never_changes_earlier_logits(t, seed, padded):
    """Logits at positions < t depend only on tokens < t: rewriting tokens t.. leaves them unchanged (with and
    without a left-padding attention mask), while the logits at t do change."""
    torch.manual_seed(seed)
    model = tiny_model()
    V, T = model.config.vocab_size, 40
    idx = torch.randint(0, V, (2, T))
    other = idx.clone()
    other[:, t:] = (idx[:, t:] + torch.randint(1, V, (2, T - t))) % V  # every future token differs
    mask = None
    if padded:
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, : min(t, 5)] = 0  # row 1 starts with up to 5 pads, all before t
    with torch.no_grad():
        a, _ = model(idx, attention_mask=mask)
        b, _ = model(other, attention_mask=mask)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------- padding


@FAST
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=4),
    st.lists(st.integers(0, 60), min_size=4, max_size=4),
    st.integers(0, 2**31 - 1),
)
def test_a_rows_logits_do_not_depend_on_left_padding_or_batch_mates(lengths, pad_ids, seed):
    """Left-padded batch with an attention mask: each row's logits at its real positions equal the logits of
    that row run alone without padding, whatever the pad token ids and the other rows' lengths."""
    torch.manual_seed(seed)
    model = tiny_model()
    prompts = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in lengths]
    idx, mask = left_pad(prompts, pad_ids)
    with torch.no_grad():
        batch, _ = model(idx, attention_mask=mask)
        for i, p in enumerate(prompts):
            alone, _ = model(torch.tensor([p]))
            torch.testing.assert_close(batch[i, idx.size(1) - len(p) :], alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_of_a_prompt_does_not_depend_on_its_batch_mates(use_cache):
    """Greedy (temperature 0) continuation of a prompt is the same alone, in a batch with longer and shorter
    prompts (left-padded by generate), and from the naive full-recompute argmax loop."""
    torch.manual_seed(0)
    model = tiny_model()
    V = model.config.vocab_size
    short, mid, long = (torch.randint(0, V, (n,)).tolist() for n in (3, 9, 17))
    expected = {tuple(p): greedy_reference(model, p, 12) for p in (short, mid, long)}
    for batch in ([mid], [short, mid, long], [long, mid], [mid, short, short], [long, long, mid, short]):
        tokens, masks = generate(model, batch, 12, temperature=0.0, use_cache=use_cache)
        assert tokens.shape == (len(batch), 12) and bool((masks == 1).all())
        for row, p in zip(tokens.tolist(), batch):
            assert row == expected[tuple(p)]


def test_list_prompts_of_equal_length_and_the_same_tensor_prompt_generate_the_same():
    """A list of equal-length prompts (no padding needed) and the equivalent LongTensor give the same samples."""
    torch.manual_seed(0)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (3, 8))
    a = generate(model, idx.tolist(), 10, generator=torch.Generator().manual_seed(5))
    b = generate(model, idx, 10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("padded", [False, True])
def test_keep_last_and_return_hidden_are_slices_of_the_full_forward(padded):
    """keep_last=n computes the logits of the last n positions only, equal to the full forward's; return_hidden gives
    the final hidden states whose projection by lm_head is the logits."""
    torch.manual_seed(0)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.bool)
    if padded:
        mask[0, :5] = False
    with torch.no_grad():
        full, _ = model(idx, attention_mask=mask)
        last, _ = model(idx, attention_mask=mask, keep_last=4)
        hidden, _ = model(idx, attention_mask=mask, output="hidden")
    assert last.shape == (3, 4, model.config.vocab_size) and hidden.shape == (3, 12, model.config.n_embd)
    torch.testing.assert_close(last, full[:, -4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.lm_head(hidden), full, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("chunks", [[20], [7, 13], [1] * 20, [5, 1, 1, 8, 5]])
def test_cached_forward_returns_the_last_positions_logits_of_the_full_forward(chunks):
    """Feeding a sequence through a KVCache in chunks gives, after each chunk, logits (B, 1, V) equal to the
    no-cache logits at the chunk's last position."""
    torch.manual_seed(0)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (3, 20))
    cache = KVCache(model.config, 3, 20, "cpu")
    with torch.no_grad():
        full, _ = model(idx)
        start = 0
        for n in chunks:
            logits, _ = model(idx[:, start : start + n], cache=cache)
            start += n
            assert logits.shape == (3, 1, model.config.vocab_size)
            torch.testing.assert_close(logits[:, 0], full[:, start - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[18], [9, 9], [6, 1, 1, 1, 9]])
def test_cached_forward_of_a_left_padded_batch_matches_the_masked_full_forward(chunks):
    """A left-padded prefill (attention mask) followed by real-token chunks through the cache gives the same
    last-position logits as the masked full forward, and as each row run alone without padding."""
    torch.manual_seed(0)
    model = tiny_model()
    V = model.config.vocab_size
    idx = torch.randint(0, V, (3, 18))
    mask = torch.ones(3, 18, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :6] = 0
    cache = KVCache(model.config, 3, 18, "cpu")
    with torch.no_grad():
        full, _ = model(idx, attention_mask=mask)
        alone = [model(idx[i : i + 1, int((mask[i] == 0).sum()) :])[0][0, -1] for i in range(3)]
        start = 0
        for k, n in enumerate(chunks):
            chunk_mask = mask[:, start : start + n] if k == 0 else None
            logits, _ = model(idx[:, start : start + n], attention_mask=chunk_mask, cache=cache)
            start += n
            torch.testing.assert_close(logits[:, 0], full[:, start - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[:, 0], torch.stack(alone), atol=ATOL, rtol=0)


def test_an_all_ones_attention_mask_on_a_cached_chunk_changes_nothing():
    """After an unmasked prefill, a continuation chunk with attention_mask all ones (nothing padded) gives the
    same logits as the same chunk without a mask, and as the full forward at that position."""
    torch.manual_seed(0)
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, 2, 8, "cpu")
        model(idx[:, :5], cache=cache)
        logits, _ = model(idx[:, 5:], attention_mask=torch.ones(2, 3, dtype=torch.long), cache=cache)
    torch.testing.assert_close(logits[:, 0], full[:, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (1.0, 5), (0.7, 12), (0.0, None)])
@pytest.mark.parametrize("lengths", [[6, 6, 6], [2, 11, 5, 8]])
def test_generation_with_kv_cache_equals_generation_without(temperature, top_k, lengths):
    """Same seeded torch.Generator: the KV-cache sampler returns exactly the tokens and masks of the loop that
    recomputes the whole (left-padded) sequence each step, for sampling, top-k and greedy, with and without
    an eos token."""
    torch.manual_seed(0)
    model = tiny_model()
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in lengths]
    for eos_id in (None, 7):
        runs = []
        for use_cache in (True, False):
            g = torch.Generator().manual_seed(1234)
            runs.append(generate(model, prompts, 30, temperature, top_k, eos_id, generator=g, use_cache=use_cache))
        (t1, m1), (t2, m2) = runs
        assert torch.equal(t1, t2) and torch.equal(m1, m2)
        if eos_id is None:
            assert t1.shape == (len(prompts), 30)


def test_generation_with_the_same_seed_repeats_and_with_another_seed_differs():
    """The torch.Generator alone decides the samples: same seed, same tokens; a different seed, other tokens."""
    torch.manual_seed(0)
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    a, _ = generate(model, prompts, 20, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(99)  # the global RNG must not matter
    b, _ = generate(model, prompts, 20, generator=torch.Generator().manual_seed(1))
    c, _ = generate(model, prompts, 20, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------------- eos


@pytest.mark.parametrize("use_cache", [True, False])
def test_tokens_after_the_first_eos_are_masked_and_the_eos_is_kept(use_cache):
    """Mask is 1 up to and including each row's first eos and 0 after it; rows without eos are all 1."""
    torch.manual_seed(0)
    model = tiny_model(scale=1.0)  # near-uniform next-token distribution: eos comes at varied steps
    eos = 5
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (3, 7, 1, 5, 4, 6, 2, 8)]
    tokens, mask = generate(
        model, prompts, 50, eos_id=eos, generator=torch.Generator().manual_seed(0), use_cache=use_cache
    )
    assert tokens.shape == mask.shape and tokens.size(1) <= 50
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    n_with_eos = 0
    for row, m in zip(tokens.tolist(), mask.tolist()):
        first = row.index(eos) if eos in row else None
        expected = [1.0] * len(row) if first is None else [1.0] * (first + 1) + [0.0] * (len(row) - first - 1)
        assert m == expected
        n_with_eos += first is not None
    assert 0 < n_with_eos < len(prompts)  # the seed gives both kinds of rows, so both branches are checked


def test_generation_stops_early_once_every_row_has_produced_eos():
    """With eos likely (p = 0.3 at every step), every row ends long before max_new_tokens: the result is
    narrower than max_new_tokens, each row holds an eos, and the masks follow the first eos."""
    z = torch.zeros(20)
    z[3] = math.log(0.3 / 0.7 * 19)  # p(eos = 3) = 0.3, the other 19 tokens share the rest
    model = fixed_distribution_model(z)
    tokens, mask = generate(
        model, [[1, 2], [4], [5, 6, 7]] * 2, 80, eos_id=3, generator=torch.Generator().manual_seed(0)
    )
    assert tokens.size(1) < 80
    for row, m in zip(tokens.tolist(), mask.tolist()):
        first = row.index(3)
        assert m == [1.0] * (first + 1) + [0.0] * (len(row) - first - 1)


def test_greedy_generation_whose_argmax_is_eos_stops_after_the_eos():
    """If eos is the argmax everywhere, greedy decoding emits eos first; everything after it is masked and the
    result is far narrower than max_new_tokens."""
    z = torch.linspace(-1, 1, 20)
    model = fixed_distribution_model(z)
    tokens, mask = generate(model, [[1], [2, 3]], 60, temperature=0.0, eos_id=19)
    assert tokens.size(1) < 60
    assert (tokens[:, 0] == 19).all()
    assert (mask[:, 0] == 1).all() and (mask[:, 1:] == 0).all()


# ---------------------------------------------------------------------------------------------------- sampler


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def softmax_list(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


LOGITS6 = [1.0, 0.5, -0.3, 2.0, 0.0, -1.2]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sample_next_draws_from_softmax_of_logits_over_temperature(temperature):
    """20000 draws per distribution pass a chi-square test (df 5, p = 0.001) against softmax(logits / T),
    with two different distributions interleaved in the batch, so each row must use its own logits."""
    torch.manual_seed(0)
    n = 20000
    a, b = torch.tensor(LOGITS6), torch.tensor(LOGITS6[::-1])
    logits = torch.stack([a, b]).repeat(n, 1)  # rows alternate a, b
    draws = sample_next(logits, temperature, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (2 * n,) and draws.dtype == torch.long
    for row_logits, sample in ((LOGITS6, draws[0::2]), (LOGITS6[::-1], draws[1::2])):
        counts = torch.bincount(sample, minlength=6).tolist()
        probs = softmax_list([x / temperature for x in row_logits])
        assert chi_square(counts, probs) < CHI2_CRIT_001[5], (counts, [round(n * p) for p in probs])


def test_sample_next_with_top_k_draws_only_the_k_most_likely_renormalised():
    """top_k=3: the three smallest logits never appear, and the top three follow their renormalised softmax
    (chi-square, df 2, p = 0.001)."""
    torch.manual_seed(0)
    n = 20000
    logits = torch.tensor(LOGITS6).repeat(n, 1)
    draws = sample_next(logits, 1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).tolist()
    top = [3, 0, 1]  # logits 2.0, 1.0, 0.5
    assert all(counts[i] == 0 for i in range(6) if i not in top)
    probs = softmax_list([LOGITS6[i] for i in top])
    assert chi_square([counts[i] for i in top], probs) < CHI2_CRIT_001[2]


@FAST
@given(st.integers(1, 6), st.integers(2, 80), st.integers(0, 2**31 - 1))
def test_sample_next_at_temperature_zero_returns_the_argmax(B, V, seed):
    """Greedy: the chosen token of every row has that row's largest logit."""
    torch.manual_seed(seed)
    logits = torch.randn(B, V) * 3
    chosen = sample_next(logits, 0.0)
    for row, c in zip(logits.tolist(), chosen.tolist()):
        assert row[c] == max(row)


@FAST
@given(st.integers(2, 40), st.data())
def test_sample_next_never_draws_a_zero_probability_token(V, data):
    """Tokens with logit -inf (probability 0), including the first and last of the vocabulary, are never
    drawn, at any temperature and with or without top_k."""
    banned = data.draw(st.sets(st.integers(0, V - 1), min_size=1, max_size=V - 1))
    banned |= data.draw(st.sets(st.sampled_from([0, V - 1]), max_size=2))
    if len(banned) == V:
        banned.discard(V // 2)
    temperature = data.draw(st.sampled_from([0.3, 1.0, 4.0]))
    top_k = data.draw(st.sampled_from([None, 1, 2, V]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    torch.manual_seed(seed)
    logits = (torch.randn(V) * 3).repeat(2000, 1)
    logits[:, sorted(banned)] = float("-inf")
    draws = sample_next(logits, temperature, top_k, generator=torch.Generator().manual_seed(seed))
    assert not set(draws.tolist()) & banned


def test_generate_samples_from_the_models_distribution():
    """End to end: the first sampled token of 20000 rows from a model with fixed next-token logits follows
    softmax(logits / T) (chi-square, df 5, p = 0.001)."""
    torch.manual_seed(0)
    model = fixed_distribution_model(LOGITS6)
    tokens, _ = generate(model, torch.zeros(20000, 1, dtype=torch.long), 1, temperature=0.8)
    counts = torch.bincount(tokens[:, 0], minlength=6).tolist()
    assert chi_square(counts, softmax_list([x / 0.8 for x in LOGITS6])) < CHI2_CRIT_001[5]


# ---------------------------------------------------------------------------------------------------- init, tying


def test_lm_head_weight_is_the_token_embedding_and_a_gradient_step_moves_both():
    """lm_head.weight and wte.weight are one parameter (same storage); its gradient is the sum of the input-
    embedding and output-head gradients of an untied copy, and an optimizer step keeps them identical."""
    torch.manual_seed(0)
    model = tiny_model(scale=1.0).train()
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    assert head is wte and head.data_ptr() == wte.data_ptr()
    assert sum(p is wte for p in model.parameters()) == 1  # counted once, so optimizers update it once

    idx = torch.randint(0, model.config.vocab_size, (2, 12))
    targets = torch.randint(0, model.config.vocab_size, (2, 12))
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    _, loss = model(idx, targets)
    loss.backward()
    _, loss2 = untied(idx, targets)
    loss2.backward()
    assert loss.item() == pytest.approx(loss2.item(), abs=1e-6)
    expected = untied.transformer.wte.weight.grad + untied.lm_head.weight.grad
    torch.testing.assert_close(wte.grad, expected, atol=1e-6, rtol=1e-5)

    before = wte.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.transformer.wte.weight, before)
    torch.testing.assert_close(model.lm_head.weight.detach(), before - 0.5 * expected, atol=1e-6, rtol=1e-5)


def test_residual_projections_are_initialised_with_std_002_over_sqrt_2_n_layer():
    """GPT-2 init: c_proj weights ~ N(0, (0.02/sqrt(2 n_layer))^2); other Linear weights and the (tied) token
    embedding ~ N(0, 0.02^2); Linear biases 0; LayerNorms weight 1, bias 0. Tensors of 65k-262k entries, so
    the sample std is within 5% (the relative standard error is < 0.3%)."""
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=n_layer, n_head=4, n_embd=256))
    resid = 0.02 / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            want = resid
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight")):
            want = 0.02
        elif name.endswith(".bias") or (name.endswith(".weight") and p.dim() == 1):  # biases, LayerNorm
            want = 0.0 if name.endswith(".bias") else 1.0
            assert torch.all(p == want), name
            continue
        else:
            continue
        assert p.std().item() == pytest.approx(want, rel=0.05), name
        assert abs(p.mean().item()) < 5 * want / math.sqrt(p.numel()), name
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)


# ---------------------------------------------------------------------------------------------------- block_size


def test_a_sequence_longer_than_block_size_raises_value_error():
    """forward accepts exactly block_size tokens and raises ValueError for more; with a KV cache its whole max_len
    counts (a cache longer than block_size is refused at once), and a chunk that does not fit in the cache raises
    IndexError. generate raises when prompt + max_new_tokens exceeds block_size, for list and tensor prompts."""
    torch.manual_seed(0)
    model = tiny_model(block_size=16)
    with torch.no_grad():
        assert model(torch.zeros(1, 16, dtype=torch.long))[0].shape == (1, 16, 61)
        with pytest.raises(ValueError):
            model(torch.zeros(1, 17, dtype=torch.long))
        with pytest.raises(ValueError):
            model(torch.zeros(1, 1, dtype=torch.long), cache=KVCache(model.config, 1, 17, "cpu"))
        cache = KVCache(model.config, 1, 16, "cpu")
        model(torch.zeros(1, 15, dtype=torch.long), cache=cache)
        with pytest.raises(IndexError):
            model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    assert generate(model, [[1, 2, 3, 4]], 12)[0].shape == (1, 12)  # 4 + 12 = block_size: fine
    with pytest.raises(ValueError):
        generate(model, [[1, 2, 3, 4], [5]], 13)
    with pytest.raises(ValueError):
        generate(model, torch.zeros(2, 17, dtype=torch.long), 1)


# ---------------------------------------------------------------------------------------------------- HF loading


HF = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=57, n_positions=24, n_ctx=24)


def hf_gpt2_state_dict(seed=0):
    """Random GPT-2 weights in the save_pretrained layout (`transformer.` prefix, Conv1D weights (in, out), no
    lm_head.weight). Scales chosen so attention is peaked and the GELU runs beyond its linear range."""
    g = torch.Generator().manual_seed(seed)
    C, V, P = HF["n_embd"], HF["vocab_size"], HF["n_positions"]

    def rnd(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    sd = {"transformer.wte.weight": rnd(V, C, std=0.3), "transformer.wpe.weight": rnd(P, C, std=0.3)}
    for i in range(HF["n_layer"]):
        h = f"transformer.h.{i}."
        sd.update(
            {
                h + "ln_1.weight": 1 + rnd(C),
                h + "ln_1.bias": rnd(C),
                h + "attn.c_attn.weight": rnd(C, 3 * C, std=0.25),
                h + "attn.c_attn.bias": rnd(3 * C),
                h + "attn.c_proj.weight": rnd(C, C, std=0.2),
                h + "attn.c_proj.bias": rnd(C),
                h + "ln_2.weight": 1 + rnd(C),
                h + "ln_2.bias": rnd(C),
                h + "mlp.c_fc.weight": rnd(C, 4 * C, std=0.3),
                h + "mlp.c_fc.bias": rnd(4 * C),
                h + "mlp.c_proj.weight": rnd(4 * C, C, std=0.1),
                h + "mlp.c_proj.bias": rnd(C),
            }
        )
    sd["transformer.ln_f.weight"] = 1 + rnd(C)
    sd["transformer.ln_f.bias"] = rnd(C)
    return sd


def hub_layout(sd):
    """The original hub file layout: no prefix, plus the causal-mask buffers attn.bias / attn.masked_bias."""
    P = HF["n_positions"]
    out = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for i in range(HF["n_layer"]):
        out[f"h.{i}.attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
        out[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def write_hf_folder(folder, sd, layout):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", **HF}))
    if layout == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(hub_layout(sd), folder / "pytorch_model.bin")
    return folder


def reference_gpt2_logits(sd, idx):
    """GPT-2 (transformers.GPT2LMHeadModel semantics) written from the raw HF tensors in float64: Conv1D is
    x @ W + b with W (in, out), LayerNorm eps 1e-5, causal softmax attention with scores / sqrt(head size),
    gelu_new (tanh approximation), output head tied to wte."""
    w = {k.removeprefix("transformer."): v.double() for k, v in sd.items()}
    nh, C = HF["n_head"], HF["n_embd"]
    hs = C // nh

    def layer_norm(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    def conv1d(x, name):
        return x @ w[name + ".weight"] + w[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    B, T = idx.shape
    x = w["wte.weight"][idx] + w["wpe.weight"][torch.arange(T)]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(HF["n_layer"]):
        p = f"h.{i}."
        q, k, v = conv1d(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, p + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(layer_norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return layer_norm(x, "ln_f") @ w["wte.weight"].T


@pytest.mark.parametrize("layout", ["safetensors", "hub_bin"])
def test_from_pretrained_matches_an_independent_gpt2_forward(tmp_path, layout):
    """A hand-made GPT-2 checkpoint in either Hugging Face layout (save_pretrained model.safetensors with the
    `transformer.` prefix and no lm_head, or the hub's pytorch_model.bin with bare keys and attn.bias buffers)
    loads with the config's sizes and gives the logits of a GPT-2 forward written from the raw tensors."""
    torch.manual_seed(0)
    sd = hf_gpt2_state_dict()
    folder = write_hf_folder(tmp_path / "gpt2-tiny", sd, layout)
    model = GPT.from_pretrained(str(folder)).eval()
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size) == (2, 4, 32, 57, 24)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, HF["vocab_size"], (3, HF["n_positions"]))
    with torch.no_grad():
        logits, _ = model(idx)
    expected = reference_gpt2_logits(sd, idx)
    assert expected.abs().max() > 1.0  # a meaningful scale for the tolerance below
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-5)


def test_both_hf_layouts_load_the_same_model(tmp_path):
    """The same weights saved in the two layouts load to identical state dicts."""
    sd = hf_gpt2_state_dict(seed=3)
    a = GPT.from_pretrained(str(write_hf_folder(tmp_path / "a", sd, "safetensors"))).state_dict()
    b = GPT.from_pretrained(str(write_hf_folder(tmp_path / "b", sd, "hub_bin"))).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "corrupt",
    [
        "missing_bias",
        "missing_layer",
        "linear_layout_c_attn",
        "linear_layout_c_fc",
        "vocab_mismatch",
        "positions_mismatch",
    ],
)
@pytest.mark.parametrize("layout", ["safetensors", "hub_bin"])
def test_from_pretrained_rejects_a_missing_or_misshapen_weight(tmp_path, corrupt, layout):
    """A checkpoint missing a weight, or with a weight of the wrong shape (nn.Linear (out, in) layout instead
    of Conv1D, a vocabulary or position table that disagrees with config.json), raises ValueError."""
    sd = hf_gpt2_state_dict()
    if corrupt == "missing_bias":
        del sd["transformer.h.1.mlp.c_fc.bias"]
    elif corrupt == "missing_layer":
        sd = {k: v for k, v in sd.items() if not k.startswith("transformer.h.1.")}
    elif corrupt == "linear_layout_c_attn":
        sd["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].t().contiguous()
    elif corrupt == "linear_layout_c_fc":
        sd["transformer.h.1.mlp.c_fc.weight"] = sd["transformer.h.1.mlp.c_fc.weight"].t().contiguous()
    elif corrupt == "vocab_mismatch":
        sd["transformer.wte.weight"] = torch.randn(HF["vocab_size"] + 1, HF["n_embd"])
    elif corrupt == "positions_mismatch":
        sd["transformer.wpe.weight"] = torch.randn(HF["n_positions"] - 1, HF["n_embd"])
    folder = write_hf_folder(tmp_path / "bad", sd, layout)
    with pytest.raises(ValueError):
        GPT.from_pretrained(str(folder))


@FAST
@given(st.integers(1, 4), st.integers(1, 9), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_token_logprobs_gradient_is_onehot_minus_softmax(B, T, V, seed):
    """d log p(y) / d logits = onehot(y) - softmax(logits) (float64 oracle), through the chunked fused path;
    B * T up to 36 rows spans several chunks."""
    torch.manual_seed(seed)
    logits = (torch.randn(B, T, V) * 3).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T)
    (token_logprobs(logits, targets) * weights).sum().backward()
    expected = (F.one_hot(targets, V).double() - torch.softmax(logits.detach().double(), -1)) * weights[..., None]
    torch.testing.assert_close(logits.grad.double(), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------- fused cross-entropy


def plain_cross_entropy_sum(h, weight, targets):
    """The oracle: float64 logits held whole, log-softmax gathered at the targets, -1 skipped."""
    logp = torch.log_softmax(h.double() @ weight.double().T, -1)
    keep = targets != -1
    return -logp[keep, targets[keep]].sum()


@FAST
@given(st.integers(1, 4), st.integers(1, 20), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_forward_loss_and_gradients_equal_float64_cross_entropy_of_the_hidden_states(B, T, skip, seed):
    """forward(idx, targets, output="loss") is the mean float64 cross-entropy of the final hidden states times the
    tied embedding over targets != -1 (0 when none is left), and every parameter's gradient is the oracle's (the
    checkpointed chunks over several rows are tested by the linear_logprobs oracle test below, with rows=8)."""
    torch.manual_seed(seed)
    model = tiny_model(scale=1.0).train()
    idx = torch.randint(0, 61, (B, T))
    targets = torch.randint(0, 61, (B, T)).masked_fill(torch.rand(B, T) < skip, -1)
    _, loss = model(idx, targets, output="loss")
    h, _ = model(idx, output="hidden")
    count = max(1, int((targets != -1).sum()))
    expected = plain_cross_entropy_sum(h.flatten(0, 1), model.lm_head.weight, targets.flatten()) / count
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    want = torch.autograd.grad(expected.float(), params, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_cross_entropy_is_exact_where_the_target_probability_underflows_float32():
    """A target 300 nats below the top logit has probability exp(-300), 0 in float32: log p is still the float64
    value (about -300, not -inf) and the gradient still onehot - softmax, chunk by chunk (rows=2)."""
    h = torch.tensor([[30.0, 0.0], [0.0, 1.0], [-20.0, 2.0]], requires_grad=True)
    weight = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 3.0]], requires_grad=True)  # row 0 logits: 150, -150, 0
    targets = torch.tensor([1, 2, 0])
    loss = -linear_logprobs(h, weight, targets, entropy=False, rows=2)[0].sum()
    loss.backward()
    h64, w64 = h.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    expected = plain_cross_entropy_sum(h64, w64, targets)
    expected.backward()
    assert expected.item() > 300
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_fused_training_loss_equals_the_loss_of_the_logits_with_the_same_parameter_gradients():
    """forward(idx, targets, output="loss") gives the mean cross-entropy of forward(idx, targets) and the
    same gradient for every parameter (the tied embedding included), with no logits."""
    model = tiny_model(scale=1.0).train()
    fused = copy.deepcopy(model)
    torch.manual_seed(1)
    idx = torch.randint(0, 61, (3, 17))
    targets = torch.randint(0, 61, (3, 17))
    targets[0, :9] = -1
    _, loss = model(idx, targets)
    logits, fused_loss = fused(idx, targets, output="loss")
    assert logits is None
    assert fused_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    loss.backward()
    fused_loss.backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    _, none = fused(idx, torch.full_like(targets, -1), output="loss")
    assert none.item() == 0.0  # no targets at all: 0, not NaN


def test_fused_loss_under_bfloat16_autocast_keeps_float32_gradients_close_to_the_float32_run():
    """Under autocast the products run in bf16 (as on a GPU) but the loss and the gradients stay float32."""
    model = tiny_model(scale=1.0).train()
    torch.manual_seed(1)
    idx, targets = torch.randint(0, 61, (3, 12)), torch.randint(0, 61, (3, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, low = model(idx, targets, output="loss")
    low_grads = torch.autograd.grad(low, list(model.parameters()))
    _, full = model(idx, targets, output="loss")
    grads = torch.autograd.grad(full, list(model.parameters()))
    assert low.dtype == torch.float32 and all(g.dtype == torch.float32 for g in low_grads)
    assert low.item() == pytest.approx(full.item(), rel=2e-2)
    for low_grad, grad in zip(low_grads, grads):
        assert (low_grad - grad).norm() <= 0.05 * grad.norm() + 1e-6  # bf16 rounding of the products, nothing more


def test_token_logprobs_keep_only_the_logits_and_a_normaliser_per_row_for_backward():
    """Autograd keeps the logits it was given and O(rows) numbers, not a float32 log-softmax of every logit."""
    logits = torch.randn(40, 300, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp = token_logprobs(logits, torch.randint(0, 300, (40,)))
    logp.sum().backward()
    assert logits.grad is not None
    assert sum(saved) <= logits.numel() + 3 * 40


def test_token_logprobs_gradient_of_bfloat16_logits_keeps_one_minus_p_of_a_confident_target():
    """For bf16 logits (autocast on a GPU) the target's gradient g * (1 - p) must survive when p is close to 1:
    adding the onehot after rounding -p to bf16 made it exactly 0. Against a float64 oracle."""
    torch.manual_seed(0)
    logits = torch.randn(64, 200) * 0.5
    targets = torch.randint(0, 200, (64,))
    logits[torch.arange(64), targets] += torch.linspace(6.0, 14.0, 64)  # p(target) from about 0.9 to 0.99999
    logits = logits.bfloat16().requires_grad_(True)
    grad_out = torch.rand(64) + 0.5
    (token_logprobs(logits, targets) * grad_out).sum().backward()
    p = torch.softmax(logits.detach().double(), -1)[torch.arange(64), targets]
    expected = grad_out.double() * (1 - p)
    got = logits.grad[torch.arange(64), targets].double()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)


# ------------------------------------------------------------------------------ fused log-probs and entropy


def logprobs_and_entropy_oracle(h, weight, targets, temperature=1.0, top_k=None):
    """float64 logits held whole: log p(targets) and the entropy of every row under softmax(logits / temperature)
    over the top_k largest logits (ties kept) and the target."""
    z = (h.double() @ weight.double().T) / temperature
    drop = torch.zeros_like(z, dtype=torch.bool)
    if top_k:
        kth = z.detach().sort(-1, descending=True).values[:, min(top_k, z.size(-1)) - 1, None]  # (N, 1)
        drop = z.detach() < kth
        drop[torch.arange(len(targets)), targets] = False
    logq = torch.log_softmax(z.masked_fill(drop, float("-inf")), -1)
    return logq.gather(1, targets[:, None])[:, 0], -(logq.exp() * logq.masked_fill(drop, 0.0)).sum(-1)


@FAST
@given(
    st.integers(1, 30),
    st.integers(2, 60),
    st.sampled_from(["both", "logp", "entropy"]),
    st.floats(0.1, 4.0),
    st.sampled_from([1.0, 0.5, 1.7]),
    st.sampled_from([None, 1, 3, 100]),
    st.integers(0, 2**31 - 1),
)
def test_linear_logprobs_values_and_gradients_equal_the_float64_oracle(N, V, used, scale, temperature, top_k, seed):
    """log p(targets), the entropy, and the gradients of h and the weight under arbitrary per-row upstream
    gradients of either output or both, against float64 autograd, at any temperature and top_k (the sampling
    distribution). Up to 30 rows span several 8-row chunks, each recomputed in backward."""
    torch.manual_seed(seed)
    h = (torch.randn(N, 8) * scale).requires_grad_(True)
    weight = torch.randn(V, 8).requires_grad_(True)
    targets = torch.randint(0, V, (N,))
    a, b = torch.randn(N), torch.randn(N)
    h64, w64 = h.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logp64, ent64 = logprobs_and_entropy_oracle(h64, w64, targets, temperature, top_k)

    def objective(lp, e):  # only the outputs in use enter the graph
        return sum([lp @ a.to(lp.dtype)] * (used != "entropy") + [e @ b.to(e.dtype)] * (used != "logp"))

    objective(logp64, ent64).backward()
    logp, ent = linear_logprobs(h, weight, targets, True, temperature, top_k, rows=8)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp.double(), logp64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), atol=1e-5, rtol=1e-5)
    objective(logp, ent).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)


def test_linear_logprobs_skips_a_frozen_weight_the_entropy_on_request_and_runs_under_no_grad():
    torch.manual_seed(0)
    h, weight, targets = torch.randn(9, 4, requires_grad=True), torch.randn(7, 4), torch.randint(0, 7, (9,))
    logp, ent = linear_logprobs(h, weight, targets, entropy=False)
    assert ent is None
    logp.sum().backward()
    assert weight.grad is None and h.grad is not None
    with torch.no_grad():
        logp, ent = linear_logprobs(h, weight.requires_grad_(True), targets)
    assert not logp.requires_grad and not ent.requires_grad
    oracle = logprobs_and_entropy_oracle(h, weight, targets)[0].detach()  # float64
    torch.testing.assert_close(logp.double(), oracle, atol=1e-5, rtol=1e-5)  # float32 work: float32 tolerance


def test_forward_logprobs_equal_the_logits_path_with_the_same_parameter_gradients():
    """forward(idx, targets, keep_last, output="logprobs") gives token_logprobs and the entropy of forward's logits,
    and an objective of both gives every parameter (the tied embedding included) the same gradient."""
    model = tiny_model(scale=1.0).train()
    fused = copy.deepcopy(model)
    torch.manual_seed(1)
    idx = torch.randint(0, 61, (3, 17))
    targets = torch.randint(0, 61, (3, 5))
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    logits, _ = model(idx, keep_last=5)
    logq = torch.log_softmax(logits.float(), -1)
    entropy = -(logq.exp() * logq).sum(-1)
    logp, ent = fused(idx, targets, keep_last=5, output="logprobs")
    torch.testing.assert_close(logp, token_logprobs(logits, targets), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, entropy, atol=1e-5, rtol=1e-5)
    ((token_logprobs(logits, targets) * a).sum() + (entropy * b).sum()).backward()
    ((logp * a).sum() + (ent * b).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_linear_logprobs_under_bfloat16_autocast_keep_one_minus_p_of_a_confident_target():
    """Under autocast the product runs in bf16 and the logits are bf16, but the gradient of log p(y) for a
    target with p close to 1 must stay g * (1 - p) (the onehot added in float32), and h's gradient float32."""
    torch.manual_seed(0)
    N, V, C = 64, 200, 16
    weight = torch.randn(V, C) * 0.3
    targets = torch.randint(0, V, (N,))
    h = torch.randn(N, C)
    h = h + weight[targets] * torch.linspace(0.5, 3.0, N)[:, None]  # p(target) from moderate to close to 1
    h.requires_grad_(True)
    grad_out = torch.rand(N) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = linear_logprobs(h, weight, targets)
    (logp * grad_out).sum().backward()
    assert logp.dtype == torch.float32 and h.grad.dtype == torch.float32
    h64 = h.detach().double().requires_grad_(True)
    (logprobs_and_entropy_oracle(h64, weight, targets)[0] * grad_out.double()).sum().backward()
    assert (h.grad.double() - h64.grad).norm() < 0.03 * h64.grad.norm()  # bf16 rounding of the products
