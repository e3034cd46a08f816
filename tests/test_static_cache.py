"""The static KV cache (gpt-fast's layout): keys and values for all max_len positions, zeros where nothing is written,
attention over all of them masked by position, so every decode step has the same shapes. It must not change a
token: greedy and seeded sampling give what the plain loop (the whole sequence recomputed at every step) gives,
for ragged left-padded prompts and rows that end early at eos, and every decode step's logits are the full
forward's at that position."""

import pytest
import torch

from gpt import GPT, GPTConfig, KVCache, generate, left_pad

ATOL = 1e-5  # float32 logits of a tiny model along two different paths

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5, 8]]  # ragged: left-padded to 7
# Tokens of the code before the static cache (a cache that grew by one position per step), 16 new tokens each, of
# model() below. They equal the plain loop's, which the tests recompute: that loop is the definition.
GREEDY = [
    [59, 27, 27, 27, 36, 36, 22, 22, 52, 52, 22, 12, 12, 12, 12, 12],
    [54, 54, 54, 54, 7, 7, 56, 56, 56, 56, 56, 38, 38, 38, 49, 52],
    [22, 22, 22, 22, 27, 27, 27, 27, 27, 54, 54, 54, 54, 54, 54, 38],
]
SAMPLED_1234 = [  # temperature 1, torch.Generator().manual_seed(1234)
    [1, 23, 5, 22, 41, 38, 15, 18, 58, 31, 42, 19, 51, 6, 31, 42],
    [22, 2, 26, 52, 52, 17, 47, 18, 47, 50, 18, 29, 23, 26, 45, 26],
    [13, 40, 38, 36, 22, 40, 36, 36, 24, 9, 46, 43, 57, 0, 17, 4],
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def model(dtype=torch.float64):
    """A tiny GPT with its matrices scaled up 6x: peaked logits, so greedy tokens vary and no near-tie decides them
    (float64 for the fixed reference tokens)."""
    torch.manual_seed(1)
    config = GPTConfig(block_size=64, vocab_size=61, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    m = GPT(config).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return m.to(dtype)


def plain_loop(m, prompt, n, temperature=0.0, generator=None, eos_id=None):
    """One unpadded row, the whole sequence recomputed for every new token, no cache. Sampling draws as generate's
    sample_next does (one uniform per row against the cdf), so a generator shared by rows is not reproduced here:
    only greedy rows are compared with it."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = m(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
            if seq[-1] == eos_id:
                break
    return seq[len(prompt) :]


def test_greedy_tokens_equal_the_plain_loop_the_uncached_sampler_and_the_growing_cache_code():
    m = model()
    cached, mask = generate(m, PROMPTS, 16, temperature=0, use_cache=True)
    uncached, _ = generate(m, PROMPTS, 16, temperature=0, use_cache=False)
    assert cached.tolist() == GREEDY and uncached.tolist() == GREEDY and bool(mask.all())
    assert [plain_loop(m, p, 16) for p in PROMPTS] == GREEDY


def test_sampled_tokens_equal_under_the_same_generator():
    m = model()
    runs = []
    for use_cache in (True, False):
        g = torch.Generator().manual_seed(1234)
        runs.append(generate(m, PROMPTS, 16, temperature=1.0, generator=g, use_cache=use_cache)[0].tolist())
    assert runs == [SAMPLED_1234, SAMPLED_1234]


def test_rows_that_reach_eos_early_are_masked_after_it_and_generation_stops_once_all_have():
    m = model()
    tokens, mask = generate(m, PROMPTS, 16, temperature=0, eos_id=27)
    assert mask.sum(1).tolist() == [2, 16, 5]  # row 1 never produces 27
    for row, p, n in zip(tokens.tolist(), PROMPTS, [2, 16, 5]):
        assert row[:n] == plain_loop(m, p, 16, eos_id=27)
        assert row[n:] == [27] * (16 - n)  # the filler after the end
    tokens, mask = generate(m, PROMPTS, 16, temperature=0, eos_id=[27, 54])  # every row ends by step 5
    assert tokens.shape == (3, 8)  # the done check runs every 8th step
    assert mask.sum(1).tolist() == [2, 1, 5]


def test_every_decode_steps_logits_equal_the_full_forwards_at_that_position():
    """A left-padded prefill, then one token at a time through the cache: each step's logits are the masked full
    forward's at that position (float32)."""
    m = model(torch.float32)
    idx, attn = left_pad(PROMPTS, "cpu")
    steps = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(0))
    full_idx = torch.cat([idx, steps], 1)
    full_attn = torch.cat([attn, torch.ones_like(steps, dtype=torch.bool)], 1)
    cache = KVCache(m.config, 3, full_idx.size(1), "cpu")
    with torch.no_grad():
        full, _ = m(full_idx, attention_mask=full_attn)  # (3, 19, V)
        logits, _ = m(idx, attention_mask=attn, cache=cache)
        torch.testing.assert_close(logits[:, 0], full[:, idx.size(1) - 1], atol=ATOL, rtol=0)
        for t in range(steps.size(1)):
            logits, _ = m(steps[:, t : t + 1], cache=cache)
            torch.testing.assert_close(logits[:, 0], full[:, idx.size(1) + t], atol=ATOL, rtol=0)
    assert int(cache.pos) == full_idx.size(1)


def test_every_decode_step_has_the_same_shapes_and_unwritten_positions_are_zero():
    """update returns the whole (B, nh, max_len, hs) buffers and the attention mask covers all max_len keys, at
    every step; positions not yet written hold zeros (never NaN: 0 * NaN would be NaN under the mask)."""
    m = model(torch.float32)
    idx, attn = left_pad(PROMPTS, "cpu")
    cache = KVCache(m.config, 3, 20, "cpu")
    shapes, returned = [], []
    m.transformer.h[0].attn.register_forward_hook(lambda mod, args, out: shapes.append(tuple(args[1].shape)))
    update = cache.update

    def recorded(layer, k, v):
        out = update(layer, k, v)
        returned.append((tuple(out[0].shape), tuple(out[1].shape)))
        return out

    cache.update = recorded
    with torch.no_grad():
        m(idx, attention_mask=attn, cache=cache)
        assert cache.k.shape == (2, 3, 2, 20, 16)
        assert not cache.k[:, :, :, 7:].any() and not cache.v[:, :, :, 7:].any()
        for _ in range(5):
            m(torch.zeros(3, 1, dtype=torch.long), cache=cache)
    assert shapes == [(3, 1, 7, 20)] + [(3, 1, 1, 20)] * 5  # the attention mask (B, 1, T, max_len)
    assert returned == [((3, 2, 20, 16), (3, 2, 20, 16))] * 2 * 6  # 2 layers, prefill + 5 steps
    assert not cache.k[:, :, :, 12:].any()


def test_a_compiled_decode_step_is_traced_once_for_every_position():
    """The write position is a tensor (cache.pos, cache.at), not a Python number, and the shapes do not grow: after
    the first decode step, the following ones reuse its graph (dynamo with static shapes, no inductor)."""
    m = model(torch.float32)
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(m, backend=count, dynamic=False)
    idx, attn = left_pad(PROMPTS, "cpu")
    cache = KVCache(m.config, 3, 20, "cpu")
    with torch.no_grad():
        compiled(idx, attention_mask=attn, cache=cache)
        compiled(torch.zeros(3, 1, dtype=torch.long), cache=cache)
        after_first = len(graphs)
        for _ in range(4):
            compiled(torch.zeros(3, 1, dtype=torch.long), cache=cache)
    torch._dynamo.reset()
    assert len(graphs) == after_first


def test_a_compiled_step_reuses_one_cache_per_batch_size_and_length_and_eager_decoding_keeps_none():
    """A compiled decode step replays on fixed memory, so generate then reuses the model's cache: the same tensors
    for the same batch size and rounded length, emptied (a second call gives the first call's tokens), a new one
    for another batch size. Eager decoding keeps no cache on the model (no memory held between calls)."""
    from gpt import decode_step

    def step(model, token, cache):  # any decode step but the default one counts as compiled
        return decode_step(model, token, cache)

    m = model(torch.float32)
    eager, _ = generate(m, PROMPTS, 16, temperature=0)
    assert not getattr(m, "kv_caches", {})
    first, _ = generate(m, PROMPTS, 16, temperature=0, decode=step)
    (cache,) = m.kv_caches.values()
    k = cache.k
    again, _ = generate(m, PROMPTS, 12, temperature=0, decode=step)  # 7 + 12 and 7 + 16 both round up to 32
    assert torch.equal(first, eager) and torch.equal(again, first[:, :12])
    assert list(m.kv_caches.values()) == [cache] and cache.k is k
    assert cache.k.shape[3] == 32 and int(cache.pos) == 7 + 11  # the last token is sampled, never written
    generate(m, PROMPTS[:2], 4, temperature=0, decode=step)
    assert len(m.kv_caches) == 2


@pytest.fixture
def compiled_decode():
    """decode_step compiled as --compile compiles it (inductor; on a CPU reduce-overhead has no CUDA graphs)."""
    from gpt import decode_step

    torch._dynamo.reset()
    yield torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    torch._dynamo.reset()


def test_the_compiled_decode_step_gives_the_eager_tokens(compiled_decode):
    """Greedy, sampled under one generator, ragged left padding and rows that stop at eos: the compiled step gives
    eager decoding's tokens and masks, and compiles once for every position and call of one cache size."""
    m = model(torch.float32)
    compiles = torch._dynamo.utils.counters["stats"]
    before = compiles["unique_graphs"]
    for kwargs in (dict(temperature=0), dict(temperature=0, eos_id=[27, 54]), dict(temperature=1.0)):
        eager = generate(m, PROMPTS, 16, generator=torch.Generator().manual_seed(7), **kwargs)
        fast = generate(m, PROMPTS, 16, generator=torch.Generator().manual_seed(7), decode=compiled_decode, **kwargs)
        assert fast[0].tolist() == eager[0].tolist() and torch.equal(fast[1], eager[1])
    assert compiles["unique_graphs"] - before == 1


def test_wrap_model_compiles_the_decode_step_only_under_compile():
    """--compile reaches the rollouts through rt.decode: wrap_model sets it to a compiled decode_step (it is compiled
    at its first call); without --compile generate's default, the eager decode_step, stays."""
    from gpt import Runtime, decode_step, wrap_model

    rt = Runtime(torch.device("cpu"), torch.float32)
    wrap_model(model(torch.float32), rt)
    assert rt.decode is decode_step
    wrap_model(model(torch.float32), rt, compile=True)
    assert rt.decode is not decode_step and getattr(rt.decode, "__wrapped__", None) is decode_step
