"""
bench.py: speed and memory of the shared GPT model, as numbers (not pass/fail), one JSON line per measurement.

Measurements (`--only`, comma-separated; all by default), each the median of `--repeats` runs after `--warmup`
warm-up runs, CUDA synchronized around every timed run:
    sample_kv       new tokens/s of generate(..., use_cache=True): batch_size prompts of prompt_len random tokens;
                    beside it prefill_ms (the prompt's forward) and decode_step_ms (the rest of the run, the
                    decode loop, over new_tokens: ms per decode step, one token for every row), medians over the runs.
                    --profile: `repeats` more runs under torch.profiler, the table sorted by self CPU time (the
                    host's share of a decode step) in --profile_out's name with _sample_kv before its suffix
    sample_nocache  the same with use_cache=False (the whole sequence is recomputed for every new token)
    train           training tokens/s of one step (forward with targets, backward, AdamW) at train_batch x
                    train_seq; `mfu` against the GPU's dense bf16 peak (null off CUDA and on unknown GPUs).
                    --profile: `repeats` more steps under torch.profiler, after the timed ones; the table of
                    the 20 ops (CUDA: kernels) with the most self time goes to --profile_out, named in the row
    memory          peak MB (2^20 bytes) over two train steps (the second holds the AdamW state of the first): CUDA
                    max_memory_allocated; CPU the process's peak resident set (ru_maxrss, which includes the
                    Python and torch baseline, reported as `before_mb`), so on CPU it is measured first
    grpo_step       ms per optimizer step of grpo.py: rl_prompts prompts of prompt_len tokens x group_size
                    completions of new_tokens tokens, KL to a reference model (beta 0.04), one update per batch
    ppo_step        ms per PPO iteration of ppo.py on the same number of completions (one per prompt), with its
                    default 4 epochs x 4 minibatches, value model and reference
    dpo_step        ms per optimizer step of dpo.py: `pairs` preference pairs of pair_len tokens, sigmoid loss,
                    frozen reference
    rm_step         ms per optimizer step of reward_model.py on the same pairs (Bradley-Terry)
    rookworld_step  ms per optimizer step of rookworld_grpo.py: rw_prompts chess prompts x rw_samples completions
                    (horizon 96, exact KL to a reference model), its default data made in memory; with peak_mb
                    (the goal on a GPU: 8 x 8 on gpt2 in <= 2 s and <= 3 GB)
                    (the *_step measurements run the scripts themselves; see bench_script_step)
With --vs hf each measurement is repeated with transformers (GPT2LMHeadModel.generate, a training step) or TRL
(GRPOTrainer, DPOTrainer, RewardTrainer) on the same work and weights, and a second line gives `speedup`, how
many times faster ours is (optional: pip install transformers trl; sampling and train need only transformers).
sample_kv gets a second transformers line, impl "hf_static": generate(..., cache_implementation="static"), its
forward compiled on CUDA as transformers documents it (torch.compile(model.forward, mode="reduce-overhead",
fullgraph=True)), on the CPU only with --compile; the peers' sampling lines add `decode_speedup` (their
decode_step_ms over ours).
Models are built from scratch with random weights (nothing is downloaded): tiny (4 layers, 4 heads, 128 wide),
small (6, 6, 384), gpt2 (12, 12, 768, the 124M GPT-2); all with the GPT-2 vocabulary and 1024 positions.

Commands:
    python bench.py --model tiny                                     # CPU, float32, a few minutes on 2 cores
    python bench.py --model tiny --vs hf                             # side by side with transformers / TRL
    python bench.py --model gpt2 --device cuda                       # one GPU, bf16 autocast
    python bench.py --model gpt2 --device cuda --compile --only train,memory --train_batch 16 --train_seq 1024
    python bench.py --model gpt2 --device cuda --compile --only train --profile      # top kernels: bench_profile.txt
    python bench.py --model gpt2 --device cuda --compile --only sample_kv --profile  # bench_profile_sample_kv.txt
The measured tables, with their hardware and dates: docs/performance.md.
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (`--key value`, `--flag` / `--no-flag`); the comment is its help.


@dataclass
class Config:
    model: str = "tiny"  # tiny | small | gpt2 (random weights, GPT-2 vocabulary)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bfloat16 autocast on CUDA if supported, else float32)
    compile: bool = False  # torch.compile the model, and for sample_kv the decode step (reduce-overhead: CUDA graphs)
    batch_size: int = 64  # sampling: prompts per batch
    prompt_len: int = 32  # sampling: random prompt tokens per row
    new_tokens: int = 64  # sampling: tokens generated per row
    train_batch: int = 8  # train and memory: sequences per step
    train_seq: int = 256  # train and memory: tokens per sequence
    rl_prompts: int = 4  # grpo_step, ppo_step: prompts per step (prompt_len tokens of text, new_tokens completions)
    group_size: int = 8  # grpo_step: completions per prompt (ppo_step: rl_prompts * group_size prompts, one each)
    pairs: int = 8  # dpo_step, rm_step: preference pairs per step
    pair_len: int = 96  # dpo_step, rm_step: tokens per sequence (prompt + response)
    rw_prompts: int = 8  # rookworld_step: prompts per step
    rw_samples: int = 8  # rookworld_step: completions per prompt
    warmup: int = 1  # untimed runs before the timed ones
    repeats: int = 3  # timed runs; the median is reported
    only: str = "sample_kv,sample_nocache,train,memory,grpo_step,ppo_step,dpo_step,rm_step,rookworld_step"  # to run
    seed: int = 1337  # seed of the weights, the prompts and the sampler
    vs: str = ""  # hf: also run transformers (TRL for grpo_step, dpo_step, rm_step) on the same work; print speedup
    profile: bool = False  # train, sample_kv: profile `repeats` more runs after the timed ones (torch.profiler)
    profile_out: str = "bench_profile.txt"  # --profile: the file of train's table of top ops (sample_kv: *_sample_kv)


MODELS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "small": dict(n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40": 181e12}


# ----- BEGIN SHARED BLOCK: model (verbatim copy of gpt.py; tests/test_shared_blocks.py) -----
@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence (learned positions)
    vocab_size: int = 50257  # GPT-2 BPE: 50,000 merges + 256 bytes + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2


class KVCache:
    """Keys and values of every layer for all max_len positions, and which positions hold real tokens (False on
    left padding and where nothing is written yet), as gpt-fast keeps them: attention reads all max_len keys, masked
    by position, so every decode step has the same shapes. The keys and values start as zeros, not garbage: a
    masked key's weight is 0, and 0 * NaN would be NaN. pos (a 0-dim tensor, gpt-fast's input_pos) counts the
    positions filled, and at holds the positions of the chunk being written: tensors, so a compiled decode step
    needs no new graph per position and the host never waits for them. With a compiled decode step, generate keeps
    one cache per batch size and length on the model (model_cache), reuses it and marks its tensors as static
    addresses, so a CUDA graph finds them where it recorded them."""

    def __init__(self, config, batch_size, max_len, device):
        self.shape = (config.n_layer, batch_size, config.n_head, max_len, config.n_embd // config.n_head)
        self.k = self.v = None  # allocated on first use, in the dtype attention produces (autocast)
        self.real = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)

    def update(self, layer, k, v):  # k, v: (B, nh, T, hs) written at positions self.at -> (B, nh, max_len, hs)
        if self.k is None or self.k.dtype != k.dtype:
            self.k = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros_like(self.k)
        self.k[layer].index_copy_(2, self.at, k)
        self.v[layer].index_copy_(2, self.at, v)
        return self.k[layer], self.v[layer]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, attn_mask, layer, cache):
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)
        hs = C // self.n_head  # head size
        # each (B, T, C), split into heads: (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, max_len, hs)
        dropout = self.dropout if self.training else 0.0
        # (B, nh, T, hs): each query's weighted sum of the values it may see; no mask (no cache, no padding): plain
        # causal attention over this chunk
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=attn_mask is None)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): the heads side by side
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask, layer, cache):
        x = x + self.attn(self.ln_1(x), attn_mask, layer, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(  # GPT-2's weight names: transformer.wte, .wpe, .h.0..., .ln_f
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied input and output embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections: std 0.02/sqrt(2 * n_layer) (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):  # without the position embeddings (wte counts: it is lm_head's weight too), as nanoGPT
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx, targets=None, attention_mask=None, cache=None, keep_last=0, output="logits", **sampling):
        """idx (B, T) token ids; targets (B, T) with -1 where no loss; attention_mask (B, T), 0 on (left) padding:
        positions count from each row's first real token. With a KVCache, idx continues the cached sequence and only
        the last position's logits are computed (all that sampling needs); keep_last=n computes only the last n
        positions' (the completion's, in RL: the vocabulary projection is the largest matrix). Returns, by output:
          "logits"    (logits (B, T, V), mean cross-entropy over targets != -1, or None without targets)
          "hidden"    (final hidden states (B, T, C), None): for reward and value heads
          "loss"      (None, the same mean cross-entropy), the logits made one chunk at a time (autograd keeps
                      each chunk's log-softmax for backward, as F.cross_entropy keeps its softmax)
          "logprobs"  (log p(targets), entropy or None), each (B, T) float32, under the sampling distribution of
                      temperature and top_k (sampling: linear_logprobs' entropy, temperature and top_k)"""
        B, T = idx.size()
        real = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        q_at = torch.arange(T, device=idx.device)  # (T,) absolute query positions
        if cache is not None:
            q_at = q_at + cache.pos
            cache.at = q_at  # where update writes this chunk's keys and values
            cache.real.index_copy_(1, q_at, real)
            real = cache.real  # (B, max_len): keys are every cached position, written or not
            cache.pos += T
        if real.size(1) > self.config.block_size:  # a cache counts its whole max_len
            raise ValueError(f"sequence of {real.size(1)} tokens is longer than block_size {self.config.block_size}")
        pos = (real.long().cumsum(1) - 1).clamp(min=0)[:, q_at]  # (B, T), counted from each row's first real token
        mask = None
        if cache is not None or attention_mask is not None:  # causal and real keys; a query always sees itself
            k_at = torch.arange(real.size(1), device=idx.device)  # (S,) absolute key position, S = T or max_len
            # (B, 1, T, S): one mask for every head
            mask = ((k_at <= q_at[:, None]) & real[:, None, None, :]) | (k_at == q_at[:, None])
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, mask, layer, cache)
        x = self.transformer.ln_f(x)  # (B, T, C)
        if cache is not None or keep_last:
            x = x[:, -(keep_last or 1) :].contiguous()  # contiguous: one matrix product below, not one per row
        if output == "hidden":
            return x, None
        if output == "logprobs":
            logp, ent = linear_logprobs(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), **sampling)
            return logp.view(targets.shape), None if ent is None else ent.view(targets.shape)
        logits = None if output == "loss" else self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        y = targets.flatten()
        scored = y != -1
        # "loss": the hidden states, projected chunk by chunk; "logits": the logits just made
        scores = x if logits is None else logits
        weight = self.lm_head.weight if logits is None else None
        logp, _ = linear_logprobs(scores.flatten(0, 1), weight, y.clamp(min=0), entropy=False, recompute=False)
        return logits, -(logp * scored).sum() / scored.sum().clamp(min=1)  # no targets: loss 0, not NaN

    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """GPT-2 weights in the Hugging Face layout, read by transformers (as nanoGPT does): a local folder
        (config.json + model.safetensors or pytorch_model.bin) or a hub id (gpt2, gpt2-medium, gpt2-large, gpt2-xl,
        jrahn/RookWorld-LM-124M). transformers accepts both key layouts (save_pretrained's transformer.h.0... and
        the original files' h.0... with attn.bias buffers); a missing or misshapen weight raises ValueError."""
        from transformers import GPT2LMHeadModel

        hf, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True, ignore_mismatched_sizes=True)
        bad = sorted(info["missing_keys"]) + sorted(key for key, *_ in info["mismatched_keys"])
        if bad:
            raise ValueError(f"{name_or_dir}: missing or misshapen GPT-2 weights {bad[:3]}")
        c = hf.config
        hf_sd = hf.state_dict()
        model = cls(GPTConfig(c.n_positions, c.vocab_size, c.n_layer, c.n_head, c.n_embd, dropout))
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        for key, p in model.state_dict().items():  # detached views of the parameters (lm_head is wte)
            p.copy_(hf_sd[key].t() if key.endswith(conv1d) else hf_sd[key])  # GPT-2's Conv1D stores (in, out)
        return model


def sampling_logits(logits, temperature=1.0, top_k=None, keep=None):
    """The float32 logits of the distribution the sampler draws from: logits / temperature, and -inf below the
    top_k-th largest (ties kept). keep (...,) token ids stay in the set even if below it: a token that the policy
    sampled before an update is scored, not excluded (at the sampling policy itself it is always inside)."""
    z = logits.float() if temperature == 1 else logits.float() / temperature  # (..., V); no copy at temperature 1
    if top_k:
        drop = z < torch.topk(z, min(top_k, z.size(-1)), dim=-1).values[..., -1:]
        if keep is not None:
            drop = drop.scatter(-1, keep[..., None], False)
        z = z.masked_fill(drop, float("-inf"))
    return z


def linear_logprobs(h, weight, targets, entropy=True, temperature=1.0, top_k=None, rows=1024, recompute=True):
    """(log p(targets), entropy or None) per row, each (N,) float32, under the sampling distribution
    softmax(sampling_logits(h @ weight.T, temperature, top_k)); with weight None, h already holds the logits
    (N, V). One chunk of rows at a time. With recompute, each chunk is recomputed in backward
    (torch.utils.checkpoint), so only one chunk's (rows, V) tensors exist at a time, not N x V (RL: many long
    completions); without it, autograd keeps each chunk's log-softmax, as F.cross_entropy does (training: no second
    vocabulary projection). The two outputs stay separate tensors: an entropy that is only logged (detached) adds
    nothing to the backward pass."""

    def chunk(x, y):  # (n, C) or (n, V), (n,) -> ((n,),) or ((n,), (n,))
        logq = torch.log_softmax(sampling_logits(x if weight is None else x @ weight.T, temperature, top_k, y), -1)
        logp = logq.gather(1, y[:, None])[:, 0]
        if not entropy:
            return (logp,)
        finite = logq.masked_fill(logq.isinf(), 0) if top_k else logq  # top_k's p = 0 tokens: no 0 * -inf
        return logp, -(logq.exp() * finite).sum(-1)

    parts = []
    for x, y in zip(h.split(rows), targets.split(rows)):
        parts.append(torch.utils.checkpoint.checkpoint(chunk, x, y, use_reentrant=False) if recompute else chunk(x, y))
    out = [torch.cat(p) for p in zip(*parts)]
    return out[0], out[1] if entropy else None


def token_logprobs(logits, targets, temperature=1.0, top_k=None):
    """log p(targets) under the sampling distribution of logits (temperature, top_k as sample_next draws):
    (B, T, V), (B, T) -> (B, T) in float32, all <= 0."""
    logp, _ = linear_logprobs(logits.flatten(0, -2), None, targets.flatten(), False, temperature, top_k)
    return logp.view(targets.shape)


def sample_next(logits, temperature=1.0, top_k=None, generator=None):
    """Draw one token per row from softmax(logits / temperature), restricted to the top_k logits
    (sampling_logits). Inverse-CDF sampling: one uniform per row against the cumulative probabilities. It is
    exact, and much cheaper than torch.multinomial over a 50k vocabulary. Greedy (argmax) when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)  # (B,)
    cdf = torch.softmax(sampling_logits(logits, temperature, top_k), dim=-1).cumsum_(-1)  # (B, V)
    device = generator.device if generator is not None else logits.device
    u = torch.rand(logits.size(0), 1, generator=generator, device=device).to(logits.device)  # (B, 1)
    # first index whose cdf exceeds u: zero-probability tokens (flat cdf steps) are never chosen
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logits.size(-1) - 1).squeeze(-1)


def left_pad(prompts, device):
    """A list of token-id lists as (idx, attention_mask), each (B, T) and left-padded to the longest (pad id 0)."""
    width = max(len(p) for p in prompts)
    idx = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    return idx, torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)


def model_cache(model, batch_size, n, device, keep=True):
    """A KVCache for batch_size rows of n positions on device, n rounded up to a multiple of 32. With keep, the
    model's own, kept on it (a GPT, or a module built around one that has its config) with pos set back to 0: one
    per batch size and rounded length, so a few serve every prompt length, and a compiled decode step replays its
    graph on the same tensors at every call (a new cache would be a new graph). Without keep, a new one, freed
    when the caller lets it go (eager decoding: no memory held between calls)."""
    n = min(-(-n // 32) * 32, model.config.block_size)
    key = (batch_size, n, device)
    caches = model.__dict__.setdefault("kv_caches", {}) if keep else {}
    if key in caches:
        # reused: what the last call left at positions >= pos is never read, since a query sees only keys at or
        # before its own position, and the prefill and each decode step write theirs (real included) first
        caches[key].pos.zero_()
    else:
        caches[key] = KVCache(model.config, *key)
    return caches[key]


def decode_step(model, token, cache):
    """The logits (B, 1, V) after one new token per row (B,): the same shapes at every position, so the step
    compiled with torch.compile(decode_step, mode="reduce-overhead") is one CUDA graph, replayed at each."""
    return model(token[:, None], cache=cache)[0]


@torch.no_grad()
def generate(
    model,
    prompts,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    eos_id=None,
    generator=None,
    use_cache=True,
    decode=decode_step,
):
    """Sample continuations of a batch of prompts (a list of token-id lists, left-padded here, or a (B, T)
    LongTensor). Returns (tokens (B, n), mask (B, n)) with n <= max_new_tokens: the mask is 1.0 on real
    completion tokens, the eos token included, and 0.0 after it; generation stops early once every row has
    produced eos. eos_id may be a list of ids that each end a row (the first is the filler after the end).
    use_cache=False recomputes the whole sequence each step (same tokens, for tests and bench). decode is the
    decode step (rt.decode: compiled under --compile); the prefill stays eager (its length varies)."""
    device = next(model.parameters()).device
    if isinstance(prompts, torch.Tensor):
        idx, attn = prompts.to(device), None
    else:
        idx, attn = left_pad(prompts, device)
        if attn.all():
            attn = None  # no padding: plain causal attention
    B, T = idx.shape
    if T + max_new_tokens > model.config.block_size:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) > block_size {model.config.block_size}")
    # a compiled decode step replays a CUDA graph on fixed memory: the model's cache of this size, kept between
    # calls (model_cache); eager decoding makes a cache of this call's own, and never imports the compiler
    compiled = use_cache and decode is not decode_step
    cache = model_cache(model, B, T + max_new_tokens, device, keep=compiled) if use_cache else None
    stop = None if eos_id is None else torch.tensor(eos_id, device=device).view(-1)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, masks = [], []
    logits, _ = model(idx, attention_mask=attn, cache=cache, keep_last=1)  # prefill; only the last logits are used
    if compiled:  # the prefill allocated k and v: tell torch.compile the cache's tensors never move
        if cache.k is None:  # gpt.py's MLA keeps latents instead (its samples are eager: this is never reached)
            raise ValueError("a compiled decode step needs a KVCache's k and v: decode this model eagerly")
        for t in (cache.k, cache.v, cache.real, cache.pos):
            torch._dynamo.mark_static_address(t)
    for step in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, generator)  # (B,)
        masks.append(~done)
        if stop is not None:
            nxt = nxt.masked_fill(done, stop[0])
            done = done | torch.isin(nxt, stop)
        tokens.append(nxt)
        # checking every 8th token keeps the host from waiting on the device at every step
        if step == max_new_tokens - 1 or (stop is not None and step % 8 == 7 and bool(done.all())):
            break
        if compiled:  # the last step's logits are read: its CUDA graph may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        if use_cache:
            logits = decode(model, nxt, cache)
        else:
            idx = torch.cat([idx, nxt[:, None]], dim=1)
            attn = None if attn is None else F.pad(attn, (0, 1), value=True)  # the new token is real
            logits, _ = model(idx, attention_mask=attn, keep_last=1)
    return torch.stack(tokens, 1), torch.stack(masks, 1).float()


# ----- END SHARED BLOCK: model -----


# ----------------------------------------------------------------------------------------------------------
# Command line


def die(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class _ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, instead of argparse's usage dump
        die(f"{message} (see --help)")


def parse_config(argv=None):
    """Each Config field is a flag; the field's trailing comment is its help."""
    helps = dict(re.findall(r"^\s+(\w+):[^=\n]*=[^#\n]*#\s*(.+)$", inspect.getsource(Config), re.M))
    parser = _ArgParser(
        description=__doc__.strip().split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for f in dataclasses.fields(Config):
        if f.type is bool:
            parser.add_argument(
                f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default, help=helps[f.name]
            )
        else:
            parser.add_argument(f"--{f.name}", type=f.type, default=f.default, help=helps[f.name])
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.model not in MODELS:
        die(f"--model {cfg.model!r}: use {' | '.join(MODELS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        die(f"--device {cfg.device!r}: use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda: no CUDA device is available")
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        die(f"--dtype {cfg.dtype!r}: use auto, float32 or bfloat16")
    if cfg.vs not in ("", "hf"):
        die(f"--vs {cfg.vs!r}: the only comparison is --vs hf (transformers and TRL)")
    unknown = set(cfg.only.split(",")) - set(BENCHES)
    if unknown:
        die(f"--only: unknown measurement(s) {', '.join(sorted(unknown))}; choose from {','.join(BENCHES)}")
    positive = ("batch_size", "prompt_len", "new_tokens", "train_batch", "train_seq", "repeats", "rl_prompts", "pairs")
    positive += ("rw_prompts", "rw_samples")
    for name in positive:
        if getattr(cfg, name) <= 0:
            die(f"--{name} must be positive (got {getattr(cfg, name)})")
    if cfg.profile and not {"train", "sample_kv"} & set(cfg.only.split(",")):
        die("--profile profiles the train and sample_kv measurements: add one of them to --only")
    if cfg.warmup < 0:
        die(f"--warmup must be >= 0 (got {cfg.warmup})")
    if cfg.prompt_len + cfg.new_tokens > 1024 or cfg.train_seq > 1024 or cfg.pair_len > 1024:
        die("--prompt_len + --new_tokens, --train_seq and --pair_len must be at most 1024 (the model's block_size)")
    if cfg.group_size < 2:
        die(f"--group_size must be >= 2: GRPO compares completions within a group (got {cfg.group_size})")
    if cfg.pair_len < 8:
        die(f"--pair_len must be >= 8 tokens (got {cfg.pair_len})")
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Measurements: each takes (model, cfg, env) and returns (value, unit, details).


def flops_per_token(model, seq_len):
    """Forward+backward FLOPs per token: 6N for the weights plus the attention scores (PaLM appendix B)."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_embd * seq_len


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, warmup, repeats):
    """Median wall time of fn() over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)  # kernels are asynchronous: stop the clock when the device is done, not when they are queued
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def generate_seconds(fn, module, device, warmup, repeats):
    """Median wall time of fn(), one whole generation, and of its two parts: the prefill (from the start until the
    first forward of `module`, the prompt's, has returned) and the decode loop (the rest: every new token's
    sampling and forward). A forward hook marks the prefill's end, the device synchronized there once per run, and
    removes itself: a compiled decode step never sees it (it would be traced, and its state guarded).
    Returns (seconds, prefill seconds, decode seconds), each the median over `repeats` runs."""
    marks = []

    def prefill_done(mod, args, out):  # the first forward of a run is the prefill
        sync(device)
        marks.append(time.perf_counter())
        hooks.pop().remove()

    hooks = []
    totals, prefills = [], []
    for i in range(warmup + repeats):
        marks.clear()
        hooks.append(module.register_forward_hook(prefill_done))
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            totals.append(time.perf_counter() - t0)
            prefills.append(marks[0] - t0)
    decodes = [total - prefill for total, prefill in zip(totals, prefills)]
    return statistics.median(totals), statistics.median(prefills), statistics.median(decodes)


def sample_details(cfg, seconds, prefill, decode):
    """The sampling rows' details: prefill_ms, the prompt's forward, and decode_step_ms, the decode loop's time
    over new_tokens (ms per decode step, each step making one token in every row of the batch)."""
    details = dict(batch_size=cfg.batch_size, prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens, seconds=seconds)
    details.update(prefill_ms=1000 * prefill, decode_step_ms=1000 * decode / cfg.new_tokens)
    return details


def bench_sample(model, cfg, env, use_cache):
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(model.config.vocab_size, (cfg.batch_size, cfg.prompt_len), generator=gen)  # (B, T)

    if use_cache:  # the uncompiled model with the compiled decode step (--compile), as the RL scripts sample
        model = env["raw_model"]

    def run():
        sampler = torch.Generator(env["device"]).manual_seed(cfg.seed)  # the same tokens in every run
        with env["autocast"]():
            generate(
                model,
                prompts,
                cfg.new_tokens,
                temperature=1.0,
                generator=sampler,
                use_cache=use_cache,
                decode=env["decode"],
            )

    model.eval()
    seconds, prefill, decode = generate_seconds(run, model, env["device"], cfg.warmup, cfg.repeats)
    details = sample_details(cfg, seconds, prefill, decode)
    if cfg.profile and use_cache:
        details["profile"] = profile_steps(run, cfg, env, "sample_kv")
    return cfg.batch_size * cfg.new_tokens / seconds, "tokens/s", details


def train_setup(model, cfg, env):
    """A fresh AdamW and a step function on a fixed batch of random tokens."""
    device = env["device"]
    gen = torch.Generator().manual_seed(cfg.seed)
    x, y = torch.randint(model.config.vocab_size, (2, cfg.train_batch, cfg.train_seq), generator=gen).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cuda", "cpu"))

    def step():
        with env["autocast"]():
            _, loss = model(x, targets=y, output="loss")  # as gpt.py trains: fused cross-entropy
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    return step


def bench_train(model, cfg, env):
    step = train_setup(model, cfg, env)
    seconds = median_seconds(step, env["device"], cfg.warmup, cfg.repeats)
    tokens = cfg.train_batch * cfg.train_seq
    mfu = None
    if env["peak_flops"]:
        mfu = flops_per_token(env["raw_model"], cfg.train_seq) * tokens / seconds / env["peak_flops"]
    details = dict(train_batch=cfg.train_batch, train_seq=cfg.train_seq, step_ms=1000 * seconds, mfu=mfu)
    if cfg.profile:
        details["profile"] = profile_steps(step, cfg, env, "train")
    return tokens / seconds, "tokens/s", details


def profile_steps(step, cfg, env, name):
    """`repeats` more runs of step (a training step, or a whole generation) under torch.profiler, after the timed
    ones (so compilation and warm-up are not in it, and the profiler's own cost is not in the timing). Writes the
    table of the 20 ops or kernels with the most self time to a file and returns its path: train's, sorted by
    device time on CUDA (CPU time elsewhere), to cfg.profile_out; sample_kv's, sorted by CPU time (a decode step
    on a GPU waits on the host: the compiled region, the sampler's launches), to cfg.profile_out with _sample_kv
    before its suffix. The table's last lines give the self CPU and device totals."""
    from torch.profiler import ProfilerActivity, profile

    device = env["device"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(cfg.repeats):
            step()
        sync(device)
    # self_device_time_total is the current name of self_cuda_time_total
    sort_by = "self_device_time_total" if device.type == "cuda" and name == "train" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=20)
    path = cfg.profile_out
    if name == "train":
        title = f"bench.py train --profile: {cfg.repeats} step(s) of {cfg.train_batch} x {cfg.train_seq} tokens"
    else:
        stem, suffix = os.path.splitext(path)
        path = f"{stem}_{name}{suffix}"
        title = f"bench.py {name} --profile: {cfg.repeats} generation(s) of {cfg.new_tokens} tokens for"
        title += f" {cfg.batch_size} prompts of {cfg.prompt_len}"
    title += f", --model {cfg.model}, {device.type}, {env['dtype']}, compile={cfg.compile}; sorted by {sort_by}"
    with open(path, "w") as f:
        f.write(f"{title}\n{table}\n")
    return path


def rss_peak_mb():
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 2**10  # bytes on macOS, KiB on Linux


def bench_memory(model, cfg, env):
    device = env["device"]
    step = train_setup(model, cfg, env)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 2**20
        for _ in range(2):
            step()
        sync(device)
        peak, what = torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    else:
        before = rss_peak_mb()
        for _ in range(2):
            step()
        peak, what = rss_peak_mb(), "peak resident set size of the process (ru_maxrss)"
    details = dict(train_batch=cfg.train_batch, train_seq=cfg.train_seq, before_mb=before, measure=what)
    return peak, "MB", details


# ----------------------------------------------------------------------------------------------------------
# One optimizer step of each post-training script. The script itself runs (a subprocess, from bench.py's folder)
# on the bench model's random weights saved as a ckpt.pt, with synthetic text or HH-RLHF-shaped pairs, for
# warmup + repeats steps; the median of its own perf/step_ms over the steps after the warm-up is reported. Peak
# memory: on CPU the child process's peak resident set (VmHWM), on CUDA the script's perf/peak_mem_mb if it
# logs one. The GPT-2 tokenizer is needed (tiktoken downloads it once; offline, set TIKTOKEN_CACHE_DIR).

WORDS = "the a of and to in is you that it he was for on are as with his they at be this have from or one had".split()


def write_inputs(cfg, env, folder):
    """The bench model as a checkpoint of this project, a text file, and pairs of dialogues that share a prompt."""
    import random

    rng = random.Random(cfg.seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731  (about one token a word)
    raw = env["raw_model"]
    state = {k: v.detach().cpu() for k, v in raw.state_dict().items()}
    torch.save({"model": state, "model_config": vars(raw.config), "tokenizer": "gpt2", "step": 0}, f"{folder}/init.pt")
    with open(f"{folder}/text.txt", "w") as f:
        f.write(". ".join(words(12) for _ in range(4000)))
    with open(f"{folder}/pairs.jsonl", "w") as f:  # long prompts: the scripts keep the last pair_len tokens
        for _ in range(64):
            prompt = f"\n\nHuman: {words(cfg.pair_len)}\n\nAssistant:"
            record = {
                "chosen": f"{prompt} {words(cfg.pair_len // 4)}",
                "rejected": f"{prompt} {words(cfg.pair_len // 4)}",
            }
            f.write(json.dumps(record) + "\n")


def step_args(name, cfg, folder):
    """The script and its flags for the work of one step (README, Performance)."""
    rl = ["--task", "next_token", "--data_path", f"{folder}/text.txt", "--context_len", cfg.prompt_len]
    rl += ["--horizon", cfg.new_tokens, "--eval_size", 8]
    pairs = ["--data_path", f"{folder}/pairs.jsonl", "--batch_size", cfg.pairs, "--max_len", cfg.pair_len]
    return {
        "grpo_step": (
            "grpo.py",
            rl + ["--batch_size", cfg.rl_prompts, "--group_size", cfg.group_size, "--beta_kl", 0.04],
        ),
        "ppo_step": ("ppo.py", rl + ["--batch_size", cfg.rl_prompts * cfg.group_size]),
        "dpo_step": ("dpo.py", pairs + ["--eval_size", 8, "--num_samples", 1, "--sample_tokens", 8]),
        "rm_step": ("reward_model.py", pairs + ["--task", "preference", "--eval_size", 8]),
        "rookworld_step": (
            "rookworld_grpo.py",
            ["--batch_size", cfg.rw_prompts, "--group_size", cfg.rw_samples, "--eval_size", 0],
        ),
    }[name]


def child_peak_kb(proc):
    """Wait for a child process and return its peak resident set in KiB (Linux; None elsewhere). Read from
    /proc/PID/status (VmHWM) while it runs: the child's ru_maxrss would include bench.py's own size, which the
    kernel counts for a child forked from it."""
    peak = None
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                peak = max(peak or 0, int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)))
        except (OSError, AttributeError):  # no /proc (macOS), or the child is exiting
            pass
        time.sleep(0.05)
    return peak


def bench_script_step(name, cfg, env):
    import subprocess

    folder = env["inputs"]  # write_inputs' files, shared by every measurement of the run
    script, args = step_args(name, cfg, folder)
    steps = cfg.warmup + cfg.repeats
    args += ["--init_from", f"{folder}/init.pt", "--out_dir", f"{folder}/{name}", "--max_steps", steps]
    args += ["--log_every", 1, "--eval_every", 10**6, "--save_every", 10**6, "--seed", cfg.seed]
    args += ["--device", env["device"].type, "--dtype", env["dtype"]] + (["--compile"] if cfg.compile else [])
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script), *map(str, args)]
    with open(f"{folder}/{name}.stderr", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        peak_kb = child_peak_kb(proc)
        err.seek(0)
        last = [line for line in err.read().splitlines() if line.strip()][-1:] or ["no output"]
    if proc.returncode != 0:
        die(f"{name}: {script} failed: {last[0].removeprefix('error: ')}")
    with open(f"{folder}/{name}/metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if "perf/step_ms" in r]
    step_ms = statistics.median(r["perf/step_ms"] for r in rows[cfg.warmup :])
    if env["device"].type == "cuda":
        peak = max((r.get("perf/peak_mem_mb", 0) for r in rows), default=0) or None
    else:
        peak = peak_kb / 2**10 if peak_kb else None
    details = dict(script=script, args=" ".join(map(str, step_args(name, cfg, "DIR")[1])), peak_mb=peak)
    return step_ms, "ms", details


# memory first: on CPU the peak resident set never goes down, and sampling without a cache holds (B, T, V) logits
BENCHES = {
    "memory": bench_memory,
    "train": bench_train,
    "sample_kv": lambda model, cfg, env: bench_sample(model, cfg, env, use_cache=True),
    "sample_nocache": lambda model, cfg, env: bench_sample(model, cfg, env, use_cache=False),
    **{
        name: lambda model, cfg, env, name=name: bench_script_step(name, cfg, env)
        for name in ("grpo_step", "ppo_step", "dpo_step", "rm_step", "rookworld_step")
    },
}


# ----------------------------------------------------------------------------------------------------------
# transformers / TRL on the same work (--vs hf). Optional: transformers and trl are imported only here. Each
# HF_BENCHES entry takes (model, cfg, env, folder), folder holding write_inputs' files, and returns its figure in the
# unit of the measurement of the same name. The model is transformers' GPT-2 with the bench model's weights, no
# dropout, float32 on the bench device (bf16 autocast on CUDA, as ours: the trainers' bf16=True is the same
# autocast). Sampling: exactly new_tokens tokens (min_new_tokens keeps <|endoftext|> from ending a row early) from
# the full distribution (temperature 1, top_k 0). TRL's steps are timed by a callback from on_step_begin to
# on_step_end (generation, reference model, backward and AdamW step included; the trainer's batch fetch and logging
# not), median over the steps after the warm-up. TRL 1.16 has no PPO trainer any more, so there is no ppo_step.


TRL_BENCHES = ("grpo_step", "dpo_step", "rm_step")  # the only measurements whose peer needs TRL


def hf_transformers():
    try:
        import transformers
    except ImportError:
        die("--vs hf needs transformers: pip install transformers")
    transformers.logging.set_verbosity_error()  # their warnings and progress bars, not the bench's lines
    transformers.logging.disable_progress_bar()
    return transformers


def hf_modules():
    transformers = hf_transformers()
    try:
        import datasets
        import trl
    except ImportError:
        die(f"--vs hf with {', '.join(TRL_BENCHES)} needs TRL: pip install trl (or leave them out of --only)")
    datasets.disable_progress_bars()
    return transformers, trl, datasets


def hf_model(cfg, env, reward_head=False):
    """transformers' GPT2LMHeadModel (GPT2ForSequenceClassification with one label, its head random, for
    reward_head) with the bench model's weights: our nn.Linear weights are the transpose of GPT-2's Conv1D."""
    transformers = hf_transformers()
    config = transformers.GPT2Config(
        vocab_size=50257, n_positions=1024, **MODELS[cfg.model], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    config.num_labels, config.pad_token_id = 1, 50256
    torch.manual_seed(cfg.seed)
    cls = transformers.GPT2ForSequenceClassification if reward_head else transformers.GPT2LMHeadModel
    model = cls(config)
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    ours = {k: v.t() if k.endswith(conv1d) else v for k, v in env["raw_model"].state_dict().items()}
    del ours["lm_head.weight"]  # tied to wte in both
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight", "score.weight"}, (missing, unexpected)
    return model.to(env["device"])


def hf_sample(model, cfg, env, folder, use_cache, static=False):
    """generate() on the same prompts. static: a static KV cache (cache_implementation="static", preallocated for
    prompt_len + new_tokens), and on CUDA the forward compiled as transformers' docs on the static cache write it,
    torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) (CUDA graphs); on CPU compiled only with
    --compile (default mode), else eager. generate's own compilation is then switched off (disable_compile), so the
    forward is compiled once. Returns None, after one line on stderr, when transformers cannot do it on GPT-2."""
    transformers = hf_transformers()
    device = env["device"]
    hf = hf_model(cfg, env).eval()
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(50257, (cfg.batch_size, cfg.prompt_len), generator=gen).to(device)  # ours too
    n = cfg.new_tokens
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n)
    if static:
        kwargs.update(cache_implementation="static", disable_compile=True)
        try:  # two prompt tokens, one new token, eager: can this transformers do it at all?
            with torch.no_grad():
                hf.generate(prompts[:1, :2], **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
        except Exception as e:
            reason = " ".join(str(e).split())[:200]
            print(
                f"--vs hf: transformers {transformers.__version__} cannot sample GPT-2 with a static cache "
                f"({type(e).__name__}: {reason}); no hf_static row",
                file=sys.stderr,
                flush=True,
            )
            return None
        if device.type == "cuda":
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        elif cfg.compile:
            hf.forward = torch.compile(hf.forward, fullgraph=True)

    def run():
        torch.manual_seed(cfg.seed)
        with env["autocast"](), torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), use_cache=use_cache, **kwargs)
        assert out.shape == (cfg.batch_size, cfg.prompt_len + n)

    seconds, prefill, decode = generate_seconds(run, hf, device, cfg.warmup, cfg.repeats)
    details = sample_details(cfg, seconds, prefill, decode)
    if static:
        details["compiled"] = device.type == "cuda" or cfg.compile
    return cfg.batch_size * n / seconds, "tokens/s", details


def hf_train(model, cfg, env, folder):
    device = env["device"]
    hf = hf_model(cfg, env).train()
    step_model = torch.compile(hf) if cfg.compile else hf
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(50257, (cfg.train_batch, cfg.train_seq), generator=gen).to(device)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=device.type in ("cuda", "cpu"))  # as ours

    def step():
        with env["autocast"]():
            loss = step_model(input_ids=x, labels=x).loss  # the model shifts the labels
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = median_seconds(step, device, cfg.warmup, cfg.repeats)
    details = dict(train_batch=cfg.train_batch, train_seq=cfg.train_seq, step_ms=1000 * seconds)
    return cfg.train_batch * cfg.train_seq / seconds, "tokens/s", details


def hf_tokenizer():
    """GPT-2's tokenizer without the hub: from the encoder.json and vocab.bpe that tiktoken caches (and downloads
    when it has to), as our scripts' tokenizer does."""
    from tiktoken.load import read_file_cached

    transformers = hf_transformers()
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    vocab = json.loads(read_file_cached(url + "encoder.json"))
    merges = [tuple(line.split()) for line in read_file_cached(url + "vocab.bpe").decode().splitlines()[1:] if line]
    return transformers.GPT2Tokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")


def trl_args(cfg, env, folder, **extra):
    """Trainer settings that leave only the step: no eval, saving, logging, checkpointing, workers."""
    return dict(
        output_dir=f"{folder}/trl",
        max_steps=cfg.warmup + cfg.repeats,
        gradient_accumulation_steps=1,
        bf16=env["dtype"] == "bfloat16",  # TRL's default is True, even on CPU
        use_cpu=env["device"].type == "cpu",
        torch_compile=cfg.compile,
        gradient_checkpointing=False,  # TRL's default is True
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.seed,
        **extra,
    )


def trl_step_ms(trainer, cfg, env, sizes):
    """Train and return (median ms per optimizer step after the warm-up, details)."""
    transformers = hf_transformers()
    times = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync(env["device"])
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(env["device"])
            times.append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    trainer.remove_callback(transformers.PrinterCallback)  # it prints the trainer's logs on stdout
    trainer.train()
    assert len(times) == cfg.warmup + cfg.repeats, times
    return 1000 * statistics.median(times[cfg.warmup :]), "ms", dict(trainer=type(trainer).__name__, **sizes)


def trl_pairs(cfg, tok, folder):
    """pairs.jsonl split at the last "\\n\\nAssistant:" into prompt / chosen / rejected, the prompt cut from the left
    so that prompt + response + <|endoftext|> is pair_len tokens, as in our scripts (TRL's RewardTrainer drops longer
    rows, and its DPOTrainer would cut the response)."""
    rows = []
    with open(f"{folder}/pairs.jsonl") as f:
        for record in map(json.loads, f):
            cut = record["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")
            prompt, chosen, rejected = record["chosen"][:cut], record["chosen"][cut:], record["rejected"][cut:]
            longest = max(len(tok.encode(chosen)), len(tok.encode(rejected))) + 1
            prompt = tok.decode(tok.encode(prompt)[-(cfg.pair_len - longest) :])
            rows.append(dict(prompt=prompt, chosen=chosen, rejected=rejected))
    return rows


def hf_grpo(model, cfg, env, folder):
    _, trl, datasets = hf_modules()
    tok = hf_tokenizer()
    tok.padding_side = "left"
    with open(f"{folder}/text.txt") as f:
        ids = tok.encode(f.read())
    n = 4 * cfg.rl_prompts * (cfg.warmup + cfg.repeats)  # more prompts than the steps take
    prompts = [tok.decode(ids[i : i + cfg.prompt_len]) for i in range(0, len(ids) - cfg.prompt_len, len(ids) // n)]
    # TRL builds the reference model from the policy's path: both load the converted weights from there
    hf_model(cfg, env).save_pretrained(f"{folder}/hf_lm")

    def words(completions, **kwargs):  # a cheap reward: distinct words per completion
        return [float(len(set(c.split()))) for c in completions]

    args = trl.GRPOConfig(
        **trl_args(cfg, env, folder, per_device_train_batch_size=cfg.rl_prompts * cfg.group_size),
        num_generations=cfg.group_size,
        max_completion_length=cfg.new_tokens,
        generation_kwargs=dict(min_new_tokens=cfg.new_tokens),  # every completion full length, as ours
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.04,
        num_iterations=1,
        model_init_kwargs=dict(dtype=torch.float32),
    )
    dataset = datasets.Dataset.from_dict(dict(prompt=prompts))
    trainer = trl.GRPOTrainer(f"{folder}/hf_lm", words, args=args, train_dataset=dataset, processing_class=tok)
    return trl_step_ms(trainer, cfg, env, dict(prompts=cfg.rl_prompts, group_size=cfg.group_size))


def hf_dpo(model, cfg, env, folder):
    import copy

    _, trl, datasets = hf_modules()
    tok = hf_tokenizer()
    hf = hf_model(cfg, env)
    args = trl.DPOConfig(
        **trl_args(cfg, env, folder, per_device_train_batch_size=cfg.pairs),
        max_length=cfg.pair_len,
        loss_type=["sigmoid"],
        beta=0.1,
        precompute_ref_log_probs=False,  # the reference model runs in every step, as ours
    )
    dataset = datasets.Dataset.from_list(trl_pairs(cfg, tok, folder))
    trainer = trl.DPOTrainer(hf, copy.deepcopy(hf), args=args, train_dataset=dataset, processing_class=tok)
    return trl_step_ms(trainer, cfg, env, dict(pairs=cfg.pairs, pair_len=cfg.pair_len))


def hf_rm(model, cfg, env, folder):
    _, trl, datasets = hf_modules()
    tok = hf_tokenizer()
    args = trl.RewardConfig(
        **trl_args(cfg, env, folder, per_device_train_batch_size=cfg.pairs), max_length=cfg.pair_len
    )
    dataset = datasets.Dataset.from_list(trl_pairs(cfg, tok, folder))
    hf = hf_model(cfg, env, reward_head=True)
    trainer = trl.RewardTrainer(hf, args=args, train_dataset=dataset, processing_class=tok)
    return trl_step_ms(trainer, cfg, env, dict(pairs=cfg.pairs, pair_len=cfg.pair_len))


# measurement -> {impl: the peer}: each peer is one row labelled by its impl
HF_BENCHES = {
    "train": {"hf": hf_train},
    "sample_kv": {
        "hf": lambda model, cfg, env, folder: hf_sample(model, cfg, env, folder, use_cache=True),
        "hf_static": lambda model, cfg, env, folder: hf_sample(model, cfg, env, folder, use_cache=True, static=True),
    },
    "sample_nocache": {"hf": lambda model, cfg, env, folder: hf_sample(model, cfg, env, folder, use_cache=False)},
    "grpo_step": {"hf": hf_grpo},
    "dpo_step": {"hf": hf_dpo},
    "rm_step": {"hf": hf_rm},
}


# ----------------------------------------------------------------------------------------------------------


def main():
    cfg = parse_config()
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto_device if cfg.device == "auto" else cfg.device)
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    raw_model = GPT(GPTConfig(block_size=1024, vocab_size=50257, **MODELS[cfg.model])).to(device)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    decode = decode_step
    if cfg.compile:  # as wrap_model compiles it in the scripts: CUDA graphs on a GPU
        decode = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    env = dict(
        device=device,
        dtype=dtype,
        raw_model=raw_model,
        decode=decode,
        autocast=lambda: (
            nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
        ),
        peak_flops=next((v for k, v in PEAK_FLOPS.items() if k in gpu), None) if gpu else None,
    )
    common = dict(model=cfg.model, device=device.type, dtype=dtype)
    extra = dict(compile=cfg.compile, params=raw_model.num_params(), gpu=gpu, threads=torch.get_num_threads())
    wanted = set(cfg.only.split(","))
    if cfg.vs == "hf" and wanted & set(TRL_BENCHES):
        hf_modules()  # one line and exit 2 now, not after our measurements, when transformers or TRL is missing
    elif cfg.vs == "hf":
        hf_transformers()
    inputs = tempfile.TemporaryDirectory()  # the scripts' and TRL's inputs, written once (removed at exit)
    if cfg.vs == "hf" or any(name.endswith("_step") for name in wanted):
        write_inputs(cfg, env, inputs.name)
    env["inputs"] = inputs.name
    for name, bench in BENCHES.items():
        if name not in wanted:
            continue
        value, unit, details = bench(model, cfg, env)
        emit({"bench": name, "impl": "ours", **common, "value": value, "unit": unit, **details, **extra})
        if cfg.vs != "hf":
            continue
        for impl, peer in HF_BENCHES.get(name, {}).items():
            result = peer(model, cfg, env, env["inputs"])
            if result is None:  # the peer cannot run here (it said why on stderr)
                continue
            hf_value, _, hf_details = result
            speedup = value / hf_value if unit == "tokens/s" else hf_value / value  # > 1: ours is faster
            if "decode_step_ms" in hf_details:  # > 1: our decode step is faster
                hf_details["decode_speedup"] = hf_details["decode_step_ms"] / details["decode_step_ms"]
            row = {"bench": name, "impl": impl, **common, "value": hf_value, "unit": unit, "speedup": speedup}
            emit({**row, **hf_details})


def emit(row):
    """One JSON line, floats to 4 significant digits."""
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
