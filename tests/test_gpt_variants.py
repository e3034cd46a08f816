"""gpt.py's two model variants beside the standard GPT: multi-head latent attention (--attention mla: a KV cache of
kv_latent_dim numbers per token and layer, the same tokens with and without it) and the masked-diffusion objective
(--objective denoise: bidirectional attention, a loss on masked tokens only, a sampler that unmasks everything in
exactly --denoise_steps steps). Both learn in a short run, resume exactly, and only gpt.py loads their checkpoints:
another script stops with one line and exit code 2."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, metrics, run_main, run_script

import gpt

RUN = [*TINY, "--eval_iters", "2", "--log_every", "5", "--num_samples", "2", "--sample_tokens", "12"]
SIZES = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)


def model(seed=0, **variant):
    torch.manual_seed(seed)
    return gpt.make_model({**SIZES, **variant}).eval()


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------------------------- MLA


def test_mla_cached_greedy_generation_equals_uncached():
    """Greedy tokens from the latent KV cache equal those of recomputing the whole sequence at every step, for
    left-padded prompts of different lengths."""
    mla = model(attention="mla", kv_latent_dim=12).double()
    for p in mla.parameters():  # larger weights: peaked logits, so a near-tie cannot hide a difference
        p.data.mul_(4)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    cached, _ = gpt.generate(mla, prompts, 16, temperature=0, use_cache=True)
    uncached, _ = gpt.generate(mla, prompts, 16, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached.flatten().tolist())) > 3  # not one token repeated: the comparison means something


def test_a_compiled_decode_step_for_mla_is_refused_in_one_line():
    """A compiled decode step replays on a KVCache's k and v, which MLA never allocates: generate refuses a compiled
    step for an MLA model with one clear line (a ValueError, not a TypeError from deep inside)."""
    mla = model(attention="mla", kv_latent_dim=12)

    def compiled_stand_in(model, token, cache):
        return gpt.decode_step(model, token, cache)

    with pytest.raises(ValueError, match="decode this model eagerly"):
        gpt.generate(mla, [[1, 2, 3]], 4, decode=compiled_stand_in)


def test_mla_cache_holds_kv_latent_dim_numbers_per_token_and_layer():
    """After a prefill and one decoding step the cache holds the latent c_kv only: n_layer * kv_latent_dim numbers
    per token (not the 2 * n_embd of keys and values, which stay unallocated), and they are the layers' c_kv."""
    mla = model(attention="mla", kv_latent_dim=12)
    B, max_len = 3, 20
    cache = gpt.KVCache(mla.config, B, max_len, "cpu")
    prompt = torch.randint(50, (B, 7))
    with torch.no_grad():
        mla(prompt, cache=cache)
        mla(torch.randint(50, (B, 1)), cache=cache)
        first = mla.transformer.h[0]
        x = first.ln_1(mla.transformer.wte(prompt) + mla.transformer.wpe(torch.arange(7)))
        c_kv = first.attn.kv_norm(first.attn.kv_down(x))  # the normalised latent
    assert cache.k is None and cache.v is None
    assert cache.latent.shape == (SIZES["n_layer"], B, max_len, 12)
    assert cache.latent.numel() // (B * max_len) == SIZES["n_layer"] * 12 < 2 * SIZES["n_layer"] * SIZES["n_embd"]
    assert cache.pos == 8 and torch.allclose(cache.latent[0, :, :7], c_kv, atol=1e-6)  # layer 0's c_kv of the prompt


def test_mla_values_start_at_the_scale_of_standard_attentions():
    """DeepSeek-V2's RMSNorm of the latent: at initialisation and width 128, MLA's values (the W_UV half of kv_up's
    output) have a std within a factor of 2 of standard attention's (c_attn's v). Without the norm the latent's std
    is 0.02 * sqrt(128) and the values come out about 5x smaller."""
    sizes = {**SIZES, "n_layer": 4, "n_head": 4, "n_embd": 128}
    torch.manual_seed(0)
    mha = gpt.make_model(sizes).eval()
    torch.manual_seed(0)
    mla = gpt.make_model({**sizes, "attention": "mla", "kv_latent_dim": 2 * 128 // 3}).eval()
    idx = torch.randint(SIZES["vocab_size"], (8, SIZES["block_size"]))
    outputs = {}

    def keep(name):
        def hook(module, inputs, output):
            outputs[name] = output[..., -128:]  # the values: the last n_embd outputs of both projections

        return hook

    mha.transformer.h[0].attn.c_attn.register_forward_hook(keep("mha"))
    mla.transformer.h[0].attn.kv_up.register_forward_hook(keep("mla"))
    with torch.no_grad():
        mha(idx)
        mla(idx)
    ratio = outputs["mla"].std().item() / outputs["mha"].std().item()
    assert 0.5 < ratio < 2, ratio


def test_mla_default_latent_matches_the_standard_models_parameter_count(text_file):
    """--kv_latent_dim 0 picks 2 * n_embd // 3: the MLA model's parameters are within 1% of the standard model's."""
    flags = dict(data=str(text_file), n_layer=2, n_head=2, n_embd=48, block_size=32)
    mha, _ = gpt.model_and_tokenizer(gpt.Config(**flags), None)
    mla, _ = gpt.model_and_tokenizer(gpt.Config(**flags, attention="mla"), None)
    assert mla.variant == {"attention": "mla", "kv_latent_dim": 32} and mha.variant == {}
    assert abs(mla.num_params() - mha.num_params()) < 0.01 * mha.num_params()


# --------------------------------------------------------------------------------------------------------- denoise


def test_denoise_attention_is_not_causal():
    """In the denoiser a later token changes an earlier position's output; in the standard GPT it does not."""
    x = torch.randint(49, (2, 10))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 49
    for variant, causal in (({"objective": "denoise"}, False), ({}, True)):
        m = model(**variant)
        with torch.no_grad():
            a, b = m(x)[0], m(y)[0]
        assert torch.allclose(a[:, :-1], b[:, :-1]) == causal, variant


def test_denoise_batches_mask_at_a_random_rate_and_the_loss_ignores_unmasked_positions():
    """get_batch with a mask id: every row keeps its own tokens where unmasked (target -1 there) and has the
    original token as the target where masked; rows get different mask rates in (0, 1]. The loss is the mean
    cross-entropy over masked positions only (plain, not MDLM's 1/t weighting)."""
    ids = torch.arange(1000) % 49  # a known stream: row r at position j holds ids[start_r + j]
    gen = torch.Generator().manual_seed(0)
    x, y = gpt.get_batch((ids, None), 256, 16, "cpu", gen, mask_id=49)
    masked = x == 49
    assert torch.equal(y == -1, ~masked)
    restored = torch.where(masked, y, x)  # each row must be a window of the stream: consecutive ids mod 49
    assert torch.equal(restored, (restored[:, :1] + torch.arange(16)) % 49)
    rates = masked.float().mean(1)
    assert rates.std() > 0.2 and 0.4 < rates.mean() < 0.6  # t ~ U(0, 1] per row, not one rate for the batch
    assert masked.any(1).float().mean() > 0.9  # t > 0: rows without a mask are rare (short rows, small t)
    m = model(objective="denoise")
    with torch.no_grad():
        logits, loss = m(x, y)
    expected = F.cross_entropy(logits[masked], y[masked])
    everywhere = F.cross_entropy(logits.flatten(0, 1), torch.where(masked, y, x).flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(loss.item() - everywhere.item()) > 1e-3  # the unmasked positions would have changed it


@pytest.mark.parametrize("n_new, steps", [(10, 4), (12, 12), (9, 1)])
def test_denoise_sampler_unmasks_everything_in_exactly_denoise_steps_steps(n_new, steps):
    """The sampler starts fully masked, calls the model exactly `steps` times, unmasks a fixed share each time (all
    but the last leave masked tokens behind), never draws the mask token, and leaves the prompt alone."""
    m = model(objective="denoise")
    mask_id = m.config.vocab_size - 1
    seen = []
    m.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    prompt = [1, 2, 3]
    tokens, mask = gpt.denoise_generate(m, [prompt] * 2, n_new, steps, temperature=1.0, generator=torch.Generator())
    assert len(seen) == steps
    still_masked = [int((x == mask_id).sum(1)[0]) for x in seen] + [int((tokens == mask_id).sum(1)[0])]
    assert still_masked[0] == n_new and still_masked[-1] == 0
    if steps > 1:
        assert still_masked[-2] > 0  # not done before the last step
    unmasked = [a - b for a, b in zip(still_masked, still_masked[1:])]
    assert sum(unmasked) == n_new and max(unmasked) - min(unmasked) <= 1  # a fixed share per step
    assert all(x[:, :3].tolist() == [prompt] * 2 for x in seen)
    assert tokens.shape == (2, n_new) and mask.sum() == 2 * n_new


def test_denoise_sampler_keeps_the_most_confident_draws_first():
    """Greedy sampling unmasks, at the first step, the positions where the model's top probability is highest."""
    m = model(seed=1, objective="denoise")
    mask_id = m.config.vocab_size - 1
    seen = []
    m.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    gpt.denoise_generate(m, [[7]], 8, 4, temperature=0)
    with torch.no_grad():
        probs = torch.softmax(m(seen[0])[0][0, 1:, :mask_id], -1).max(-1).values  # (8,) over the masked positions
    first = (seen[1][0, 1:] != mask_id).nonzero()[:, 0]
    assert set(first.tolist()) == set(probs.topk(2).indices.tolist())


# --------------------------------------------------------------------------------------------- end to end runs


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["--attention", "mla", "--kv_latent_dim", "16"], ["--objective", "denoise"]])
def test_variant_run_learns_resumes_exactly_and_only_gpt_loads_it(variant, tmp_path, text_file, monkeypatch):
    """A short run of each variant lowers its validation loss and writes the run folder (samples.txt holds text of
    the data's characters); its checkpoint records the variant in model_config; stopped and resumed it gives the
    uninterrupted metrics; gpt.py fine-tunes from it with --init_from, and another script refuses it (one line,
    exit code 2)."""
    common = ["--data", text_file, *RUN, *variant, "--eval_every", "10", "--lr", "1e-2", "--warmup_steps", "5"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_main(gpt, monkeypatch, *common, "--out_dir", full, "--max_steps", "40", "--denoise_steps", "4")
    evals = [r["eval/val_loss"] for r in metrics(full) if "eval/val_loss" in r]
    assert evals[-1] < evals[0] - 0.3, evals  # from ~ln(vocab) at random init
    results = json.loads((full / "final_results.json").read_text())
    assert results["sample_tokens_per_s"] > 0
    samples = (full / "samples.txt").read_text()
    assert len(samples) > 20 and set(samples) <= set(text_file.read_text()) | {"="}
    ckpt = torch.load(full / "ckpt.pt", weights_only=True)
    kind = dict(zip(variant[::2], variant[1::2]))
    assert ckpt["model_config"]["attention" if "--attention" in kind else "objective"] in kind.values()

    stop = ["--max_steps", "20", "--lr_decay_steps", "40", "--denoise_steps", "4"]
    run_main(gpt, monkeypatch, *common, "--out_dir", part, *stop)
    assert_ok(run_script("gpt.py", "--resume", "--out_dir", part, "--max_steps", "40"))  # a fresh interpreter
    assert metrics(part) == metrics(full)
    assert (part / "samples.txt").read_text() == samples

    tuned = ["--data", text_file, *RUN, "--init_from", full / "ckpt.pt", "--max_steps", "2", "--eval_every", "2"]
    run_main(gpt, monkeypatch, *tuned, "--out_dir", tmp_path / "tuned")
    assert torch.load(tmp_path / "tuned" / "ckpt.pt", weights_only=True)["model_config"] == ckpt["model_config"]

    other = run_script("char_grpo.py", "--init_from", full / "ckpt.pt", "--out_dir", tmp_path / "rl", timeout=120)
    assert other.returncode == 2
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and "ckpt.pt" in lines[0] and "Traceback" not in other.stderr
