"""
gpt.py: the GPT-2 model, its tokenizers, and supervised training (pretraining and SFT) in one file.

Training minimises next-token cross-entropy, summed over every target token of the optimizer step and divided
by their count (all micro-batches and ranks together), so the loss does not depend on how the batch is split.
For SFT data (`--data hh_sft`, `--data arithmetic`) only response tokens are targets: Assistant turns of
HH-RLHF dialogues, the answer after `=` of arithmetic problems.

The model is hand-written on purpose (reading it is the point): GPT-2 with pre-LN blocks, GELU (tanh) MLP,
learned positions, tied embeddings, attention through scaled_dot_product_attention, left padding with
position ids counted from each row's first real token, a preallocated KV cache and an exact inverse-CDF
sampler. The code between the SHARED BLOCK markers is copied verbatim into every script of this project
(tests/test_shared_blocks.py checks it), so each script can be forked on its own.

Two variants of the model, to compare with the standard GPT on the same data and budget (gpt.py only; see
VariantAttention, make_model and the comparison in docs/gpt.md):
    --attention mla       multi-head latent attention (DeepSeek-V2): keys and values come from a latent c_kv of
                          --kv_latent_dim numbers per token, and the KV cache stores only c_kv (no decoupled RoPE:
                          GPT-2's positions are learned). Same objective, same sampler.
    --objective denoise   masked diffusion language modelling in miniature (MDLM, LLaDA): a mask token is added
                          to the vocabulary and attention is bidirectional; each sequence draws a mask rate
                          t ~ U(0, 1] and the loss is the cross-entropy on the masked positions only, plain (every
                          masked token counts once), not MDLM's 1/t weighting, so train/loss and eval/ losses are
                          masked-token NLLs. Sampling starts fully masked and unmasks the most confident draws over
                          --denoise_steps steps (denoise_generate).
Their checkpoints record the variant in model_config; gpt.py resumes, fine-tunes and samples from them, the other
scripts refuse them with one line (exit code 2).

Commands:
    python gpt.py                                                    # tiny Shakespeare, char-level: ~6 min on 2 cores
    python gpt.py --data shakespeare --init_from gpt2 --device cuda  # fine-tune GPT-2 124M on one GPU
    torchrun --standalone --nproc_per_node=8 gpt.py --data hh_sft --init_from gpt2 --parallel fsdp
    python gpt.py --data arithmetic --digits 2                       # warm start for grpo.py --task arithmetic
    python gpt.py --attention mla                                    # the variants, each a few minutes on a CPU
    python gpt.py --objective denoise
    python gpt.py --export_hf out/hf --init_from out/run/ckpt.pt     # for transformers, vLLM, the hub

Data (`--data`): shakespeare_char (default, char-level), shakespeare (GPT-2 BPE), hh_sft (HH-RLHF "chosen"
dialogues; the hub through `datasets`, or `--data_path` to a local .jsonl/.jsonl.gz), arithmetic
(procedurally generated `12+345=357` lines, or with `--steps K` expressions of K operations evaluated left to right
and solved one step a line, `17+25-9=17+25=42\\n42-9=33\\n`; the validation split holds only the held-out problems of
held_out's rule, which the training split and every later stage never see), reasoning (documents of 1..--steps
operations, direct `Q:7+2-5;A:4`, worked `7+2-5;7+2=9-5;9-5=4`, and --bridge_frac of the Q documents with their
steps before the answer: a base for RL to find the steps in; held out by the same rule), or the path of any text
file (`--tokenizer char|gpt2`).

The page docs/gpt.md holds the rest: formulas, implementation details, flags, results.

Metrics (metrics.jsonl, one object per logged step):
    train/loss        mean token cross-entropy of the optimizer step (nats)
    train/lr          learning rate of the step
    train/grad_norm   gradient norm before clipping
    eval/train_loss   mean loss on --eval_iters fixed train batches
    eval/val_loss     the same on the validation split (denoise: on fixed masked batches, the masked-token NLL)
    eval/accuracy     --data arithmetic: share of exact greedy answers to the held-out problems grpo.py evaluates
                      (its --eval_size 1000 draws with seed 1234, repeats dropped); samples.txt holds those answers
    eval/n_problems   --data arithmetic: how many distinct held-out problems that is
    perf/tokens_per_s target tokens processed per second (all ranks)
    perf/step_ms      wall time of the optimizer step
    perf/mfu          model FLOPs utilisation (CUDA only)
"""

import argparse
import dataclasses
import gzip
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import tiktoken
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

# ----------------------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (`--key value`, `--flag` / `--no-flag`); the comment is its help.


@dataclass
class Config:
    # data
    out_dir: str = ""  # run folder; default out/gpt-<YYYYmmdd-HHMMSS>
    data: str = "shakespeare_char"  # shakespeare_char | shakespeare | hh_sft | arithmetic | reasoning | a text file
    data_path: str = ""  # local copy of the named dataset (text file, or .jsonl/.jsonl.gz for hh_sft)
    tokenizer: str = "auto"  # auto | char | gpt2 (auto: char for shakespeare_char and text files, else gpt2)
    digits: int = 2  # arithmetic: largest number of digits of an operand
    ops: str = "+-*"  # arithmetic: operators to draw from
    steps: int = 1  # arithmetic: operations per problem, left to right, one step a line; reasoning: the most (1..K)
    worked_frac: float = 0.5  # reasoning: share of the documents that are worked steps, with no Q
    bridge_frac: float = 0.02  # reasoning: share of the Q documents that write their steps before the answer
    # model: a checkpoint, GPT-2 weights, or a new GPT of these sizes
    init_from: str = "scratch"  # scratch | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | hub id | ckpt.pt | HF folder
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    export_hf: str = ""  # write --init_from's model to this folder in the Hugging Face GPT-2 layout, then stop
    n_layer: int = 4  # transformer blocks (scratch only)
    n_head: int = 4  # attention heads (scratch only)
    n_embd: int = 128  # embedding width (scratch only)
    block_size: int = 128  # context length in tokens
    dropout: float = 0.0  # dropout probability
    bias: bool = True  # biases in Linear and LayerNorm layers (scratch only)
    # the variants (gpt.py only; a new model: see VariantAttention)
    attention: str = "mha"  # mha (GPT-2's multi-head attention) | mla (multi-head latent attention) (scratch only)
    kv_latent_dim: int = 0  # mla: latent numbers per token and layer (0: 2*n_embd//3, about mha's parameters)
    objective: str = "causal"  # causal (next token) | denoise (masked diffusion: bidirectional) (scratch only)
    denoise_steps: int = 60  # denoise: unmasking steps of the sampler
    # optimisation
    batch_size: int = 32  # sequences per micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 1500  # optimizer steps
    lr: float = 2e-3  # peak learning rate
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 100  # linear warm-up steps
    lr_decay_steps: int = 0  # steps of cosine decay (0: max_steps)
    weight_decay: float = 0.1  # AdamW weight decay on matrices
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    # evaluation, logging, checkpoints
    eval_every: int = 250  # steps between evaluations
    eval_iters: int = 20  # batches per evaluation
    log_every: int = 50  # steps between log lines
    save_every: int = 500  # steps between checkpoints (one is always written at the end)
    # the samples written at the end
    num_samples: int = 3  # samples written to samples.txt at the end (arithmetic: every held-out problem, greedy)
    sample_tokens: int = 120  # tokens per sample
    sample_prompt: str = "\n"  # prompt of the samples
    temperature: float = 0.8  # sampling temperature (0: greedy)
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    # system
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA if supported)
    compile: bool = False  # torch.compile the model
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank)
    deterministic: bool = False  # torch.use_deterministic_algorithms
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rlhf-gpt"  # wandb project


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: batches of the token stream, and the training step.
#
# A split is a pair (ids, mask): ids (N,) LongTensor, the whole split's tokens laid end to end; mask (N,) BoolTensor,
# True on the tokens that are targets (SFT: Assistant turns, arithmetic answers), or None when every token is one.
# A batch, from get_batch, is a pair of LongTensors:
#   x   (B, T)  input tokens; --objective denoise: the window with its noised positions replaced by the mask token
#   y   (B, T)  targets: the next token (causal) or the original token at a noised position (denoise); -1 where a
#               position is no target (mask False, or a position the noise left alone), which the loss skips


def get_batch(data, batch_size, block_size, device, generator=None, mask_id=None):
    """Random windows of the stream: inputs x and next-token targets y, with -1 where y is not a target.

    With mask_id (--objective denoise), MDLM's forward process on the window instead: each row draws a mask rate
    t ~ U(0, 1], each token is replaced by mask_id with probability t, and the targets are the original tokens at
    the masked positions only (y = -1 elsewhere, so the loss ignores them). SFT target masks do not apply here: the
    denoiser learns the whole text."""
    ids, mask = data
    ix = torch.randint(len(ids) - block_size - 1, (batch_size,), generator=generator)  # (B,) window starts
    x = torch.stack([ids[i : i + block_size] for i in ix])  # (B, T)
    y = torch.stack([ids[i + 1 : i + 1 + block_size] for i in ix])  # (B, T)
    if mask is not None:
        is_target = torch.stack([mask[i + 1 : i + 1 + block_size] for i in ix])  # (B, T)
        y = y.masked_fill(~is_target, -1)
    if mask_id is not None:
        t = 1 - torch.rand(batch_size, 1, generator=generator)  # (B, 1) mask rate in (0, 1]
        noised = torch.rand(x.shape, generator=generator) < t  # (B, T)
        y = x.masked_fill(~noised, -1)  # the denoiser predicts the original tokens where it sees the mask
        x = x.masked_fill(noised, mask_id)
    return x.to(device), y.to(device)


def train_step(model, optimizer, scaler, batches, rt, grad_clip):
    """ALGO LOGIC: one optimizer step. The loss is the sum of token losses over every micro-batch and rank divided
    by the global target count, so it does not depend on how the batch is split. Returns (loss, grad norm)."""
    n_targets = sum((y != -1).sum() for _, y in batches).float()  # this rank's targets
    n_targets = all_reduce(n_targets, rt).clamp(min=1)  # every rank's: the step's normaliser
    loss_sum = torch.zeros((), device=rt.device)
    for micro, (x, y) in enumerate(batches):
        grad_sync(model, micro == len(batches) - 1)  # ranks exchange gradients once, after the last micro-batch
        with rt.autocast():
            _, loss = model(x, y, output="loss")  # mean over this micro-batch's targets; no (B, T, V) logits held
        token_loss_sum = loss * (y != -1).sum()
        # ranks' gradients are averaged, so each rank's share is scaled by world_size
        scaler.scale(token_loss_sum * rt.world_size / n_targets).backward()
        loss_sum += token_loss_sum.detach()
    scaler.unscale_(optimizer)  # clip the true gradients, not float16's scaled ones
    grad_norm = clip_grad_norm(model, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    loss = all_reduce(loss_sum, rt) / n_targets
    return loss.item(), grad_norm.item()


@torch.no_grad()
def evaluate(model, eval_batches, rt):
    """eval/train_loss and eval/val_loss: the mean token loss of each split's fixed batches (token losses summed,
    then divided by the target count). Every rank evaluates the same batches (under FSDP the forward is
    collective), so every rank gets the same numbers without a reduction."""
    model.eval()
    out = {
        "eval/train_loss": mean_loss(model, eval_batches["train"], rt),
        "eval/val_loss": mean_loss(model, eval_batches["val"], rt),
    }
    model.train()
    return out


def mean_loss(model, batches, rt):
    """The token losses of the batches summed, over their target count (evaluate calls it under no_grad)."""
    loss_sum = torch.zeros((), device=rt.device)
    n_targets = torch.zeros((), device=rt.device)
    for x, y in batches:
        x = x.to(rt.device)
        y = y.to(rt.device)
        with rt.autocast():
            _, loss = model(x, y, output="loss")  # mean over this batch's targets
        count = (y != -1).sum()
        loss_sum += loss * count
        n_targets += count
    return (loss_sum / n_targets.clamp(min=1)).item()


# ----------------------------------------------------------------------------------------------------------
# Two variants of the model, for comparison with the standard GPT on the same data and budget. Each is the block's GPT
# with every block's attention swapped once it is built, so the RL scripts do not carry them. A variant's checkpoint
# records it in model_config, in fields GPTConfig lacks: other scripts refuse it (load_model), make_model builds it.

VARIANT_FIELDS = ("attention", "kv_latent_dim", "objective")


class VariantAttention(nn.Module):
    """The block's attention in either variant (or both), same signature and role as CausalSelfAttention.

    --attention mla: multi-head latent attention (DeepSeek-V2, arXiv:2405.04434). Keys and values are up-projected
    from one compressed latent per token, c_kv = W_DKV x (kv_latent_dim numbers), k = W_UK c_kv, v = W_UV c_kv, and
    the KV cache stores only c_kv: kv_latent_dim numbers per token and layer instead of the 2 * n_embd of k and v.
    That is what bounds RL rollouts: more and longer sequences fit in memory. GPT-2's positions are learned and
    added to the input, so no decoupled RoPE key is needed (DeepSeek-V2 adds one because a rotation between W_UK and
    the query would stop W_UK from being absorbed). Queries are not compressed (in DeepSeek-V2 that saves training
    activations, not cache). The cached latents are up-projected again at every step, which reads best; absorbing
    W_UK into the query and W_UV into c_proj would attend in the latent space directly, the same numbers.
    As in DeepSeek-V2, c_kv is RMS-normalised after the down-projection (the cache keeps the normalised latent):
    without it, c_kv of a GPT-2 initialisation has std 0.02 * sqrt(n_embd), and k and v start about 5x smaller
    than standard attention's.
    kv_latent_dim None (--objective denoise alone): standard attention's keys and values, k, v = W_KV x.

    --objective denoise: causal=False, every position sees the whole sequence (the denoiser never pads nor caches)."""

    def __init__(self, config, kv_latent_dim, causal):
        super().__init__()
        self.n_head = config.n_head
        self.n_layer = config.n_layer
        self.dropout = config.dropout
        self.causal = causal
        C = config.n_embd
        L = kv_latent_dim
        # registered in this order, which the weight initialisation draws in
        self.q_proj = nn.Linear(C, C, bias=config.bias)  # W_Q
        self.c_proj = nn.Linear(C, C, bias=config.bias)  # the output projection, as in CausalSelfAttention
        self.kv_down = nn.Linear(C, L, bias=config.bias) if L else nn.Identity()  # W_DKV
        self.kv_norm = nn.RMSNorm(L) if L else nn.Identity()  # DeepSeek-V2's kv_a_layernorm
        self.kv_up = nn.Linear(L or C, 2 * C, bias=config.bias)  # W_UK and W_UV side by side
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, attn_mask, layer, cache):
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)
        hs = C // self.n_head  # head size
        c_kv = self.kv_norm(self.kv_down(x))  # (B, T, L): all the cache keeps of a token (L = C without MLA)
        if cache is not None:  # the block's KVCache keeps positions and padding; its k and v are never allocated
            if not hasattr(cache, "latent"):
                cache.latent = c_kv.new_zeros(self.n_layer, B, cache.real.size(1), c_kv.size(-1))  # (nl, B, max, L)
            cache.latent[layer].index_copy_(1, cache.at, c_kv)
            c_kv = cache.latent[layer]  # (B, max_len, L): all positions, as KVCache.update returns them
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k, v = self.kv_up(c_kv).split(C, dim=2)  # each (B, S, C), S = T, or max_len with a cache
        k = k.view(B, -1, self.n_head, hs).transpose(1, 2)  # (B, nh, S, hs)
        v = v.view(B, -1, self.n_head, hs).transpose(1, 2)  # (B, nh, S, hs)
        # as in CausalSelfAttention: attn_mask None is plain causal attention over this chunk; denoise: none at all
        causal = self.causal and attn_mask is None and k.size(2) == T and T > 1
        dropout = self.dropout if self.training else 0.0
        # (B, nh, T, hs): each query's weighted sum of the values it may see
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): the heads side by side
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


def make_model(model_config):
    """A GPT from a model_config dict. Its variant fields swap every block's attention for a VariantAttention,
    initialised as GPT-2 initialises the block's; model.variant keeps them for the checkpoint. A standard
    model_config builds exactly the block's GPT."""
    variant = {k: v for k, v in model_config.items() if k in VARIANT_FIELDS}
    sizes = {k: v for k, v in model_config.items() if k not in VARIANT_FIELDS}
    model = GPT(GPTConfig(**sizes))
    model.variant = variant
    if not variant:
        return model
    causal = variant.get("objective", "causal") == "causal"
    latent = variant["kv_latent_dim"] if variant.get("attention") == "mla" else None
    for block in model.transformer.h:
        block.attn = VariantAttention(model.config, latent, causal)
        block.attn.apply(model._init_weights)
        nn.init.normal_(block.attn.c_proj.weight, std=0.02 / math.sqrt(2 * model.config.n_layer))
    return model


@torch.no_grad()
def denoise_generate(model, prompts, n_new, steps, temperature=1.0, top_k=None, generator=None):
    """Masked-diffusion sampling (MDLM, with LLaDA's low-confidence remasking). The n_new positions after each
    prompt (token-id lists of one length) start as the mask token, the vocabulary's last id. Each of `steps` steps
    predicts every position at once, draws a token for each masked one (sample_next: temperature, top_k) and keeps
    the most confident draws (by the model's probability of the drawn token), a fixed share of n_new per step; the
    rest stay masked. The last step unmasks what is left. Returns (tokens (B, n_new), mask of ones) as generate()."""
    mask_id = model.config.vocab_size - 1
    device = next(model.parameters()).device
    x = torch.tensor([list(p) + [mask_id] * n_new for p in prompts], device=device)  # (B, T + n_new)
    for step in range(steps):
        logits, _ = model(x)  # (B, T + n_new, V)
        logits[..., mask_id] = float("-inf")  # never draw the mask token itself
        draw = sample_next(logits.flatten(0, 1), temperature, top_k, generator).view(x.shape)  # (B, T + n_new)
        p = torch.softmax(logits.float(), -1).gather(-1, draw[..., None])[..., 0]  # (B, T + n_new) confidence
        # after this step n_new * (step + 1) // steps positions are unmasked: after the last, all of them
        n_keep = n_new * (step + 1) // steps - n_new * step // steps
        keep = p.masked_fill(x != mask_id, -1.0).topk(n_keep).indices  # (B, n_keep)
        x = x.scatter(1, keep, draw.gather(1, keep))  # only masked positions compete: p of the others is -1
    tokens = x[:, -n_new:]  # (B, n_new)
    return tokens, torch.ones_like(tokens, dtype=torch.float)


# ----------------------------------------------------------------------------------------------------------
# Data: every dataset becomes one token stream per split, with a mask of the tokens that are targets.

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# tiny Shakespeare ships with the repository (data/ beside the scripts); a script forked alone downloads it there
SHAKESPEARE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")


ARITHMETIC_CHARS = "\n*+-0123456789="  # the char vocabulary of --data arithmetic --tokenizer char
REASONING_CHARS = "\n*+-0123456789:;=AQ"  # --data reasoning's


def load_splits(cfg, tok):
    """(train, val) as pairs of (ids LongTensor, target mask BoolTensor or None)."""
    if cfg.data in ("arithmetic", "reasoning"):
        check(
            min(cfg.digits, cfg.steps) >= 1 and cfg.ops and set(cfg.ops) <= set("+-*"),
            "--digits, --steps >= 1 and --ops from +-*",
        )
        splits = []
        # train, then val: the train split has no held-out problem, val only held-out ones (held_out's rule)
        for seed, n, held in ((cfg.seed, 20000, False), (cfg.seed + 1, 1000, True)):
            rng = random.Random(seed)
            examples = []
            for _ in range(n):
                if cfg.data == "reasoning":
                    prompt, answer = reasoning_document(rng, cfg, held)
                else:
                    prompt, answer = draw_problem(rng, cfg.digits, cfg.ops, held, cfg.steps)
                p = tok.encode(prompt)
                a = tok.encode(answer)
                examples.append((p + a, [False] * len(p) + [True] * len(a)))  # only the answer is a target
            splits.append(stream(examples))
        return splits
    if cfg.data == "hh_sft":
        if cfg.data_path:
            texts = [r["chosen"] for r in read_jsonl(cfg.data_path, ["chosen"])]
            order = random.Random(0).sample(range(len(texts)), len(texts))  # fixed split, whatever --seed
            n_val = max(1, len(texts) // 20)
            train_texts = [texts[i] for i in order[n_val:]]
            val_texts = [texts[i] for i in order[:n_val]]
        else:
            try:
                import datasets
                import huggingface_hub

                if not huggingface_hub.constants.HF_HUB_OFFLINE:  # one quick request: datasets retries for a minute
                    huggingface_hub.dataset_info("Anthropic/hh-rlhf", timeout=10)
                hub = datasets.load_dataset("Anthropic/hh-rlhf")
                train_texts = hub["train"]["chosen"]
                val_texts = hub["test"]["chosen"]
            except Exception as e:
                die(f"cannot load Anthropic/hh-rlhf from the hub ({type(e).__name__}); pass --data_path FILE.jsonl.gz")
        train = stream([hh_dialogue(text, tok) for text in train_texts])
        val = stream([hh_dialogue(text, tok) for text in val_texts])
        return [train, val]
    path = text_path(cfg)
    text = read_text(path)
    if isinstance(tok, CharTokenizer):
        unknown = sorted(set(text) - set(tok.chars))
        check(not unknown, f"{path} has characters {''.join(unknown[:10])!r} outside the model's char vocabulary")
    ids = torch.tensor(tok.encode(text))
    n = int(0.9 * len(ids))  # the first 90% trains, the rest validates
    return [(ids[:n], None), (ids[n:], None)]


def stream(examples):
    """One token stream and its target mask from (ids, mask) examples laid end to end."""
    ids = torch.tensor([t for example_ids, _ in examples for t in example_ids])
    mask = torch.tensor([m for _, example_mask in examples for m in example_mask])
    return ids, mask


def arithmetic_problem(rng, digits, ops, steps=1):
    """One problem as (prompt, answer): an expression of `steps` operations on numbers of 1..digits digits, evaluated
    left to right (so "2+3*4=" is (2+3)*4 = 20), and its solution, one step a line "x op y=r" whose x is the previous
    step's result: ("17+25-9=", "17+25=42\\n42-9=33\\n"). With one operation the answer is its result alone:
    ("12+345=", "357\\n"). Drawn in this order: the first number, then each operation's number and operator."""
    x = draw_number(rng, digits)
    prompt = f"{x}"
    solution = ""
    for _ in range(steps):
        y = draw_number(rng, digits)
        op = rng.choice(ops)
        result = operate(x, op, y)
        prompt += f"{op}{y}"
        solution += f"{x}{op}{y}={result}\n"
        x = result
    if steps == 1:
        solution = f"{x}\n"
    return f"{prompt}=", solution


def reasoning_document(rng, cfg, held):
    """One document of --data reasoning as (context, target), the loss on the target only: a problem of 1..--steps
    operations, drawn until held_out(its arithmetic prompt) is held, written direct ("Q:7+2-5;", "A:4\n") or worked
    ("7+2-5;", "7+2=9-5;9-5=4\n"), --worked_frac of them worked; --bridge_frac of the Q documents write their
    steps first ("Q:7+2-5;", "7+2=9-5;9-5=4;A:4\n"). A step computes the first operation and copies the rest of
    the expression after its result, so the next step starts from a copy. Only a bridge document writes steps
    after a Q."""
    prompt, solution = draw_problem(rng, cfg.digits, cfg.ops, held, rng.randint(1, cfg.steps))
    expr = prompt[:-1]
    lines = solution.split()  # "x op y=r", one an operation (one operation: the result alone)
    if "=" not in lines[0]:
        lines = [f"{expr}={lines[0]}"]
    rest = re.findall(r"[-+*]\d+", expr)  # each operation: "+2", "-5"
    steps = ";".join(line + "".join(rest[i + 1 :]) for i, line in enumerate(lines))
    answer = lines[-1].split("=")[1]
    if rng.random() < cfg.worked_frac:
        return f"{expr};", f"{steps}\n"
    if rng.random() < cfg.bridge_frac:
        return f"Q:{expr};", f"{steps};A:{answer}\n"
    return f"Q:{expr};", f"A:{answer}\n"


def draw_number(rng, digits):
    """A number of 1..digits digits: how many digits is drawn first, then the number, so every length is as likely."""
    return rng.randint(0, 10 ** rng.randint(1, digits) - 1)


def operate(x, op, y):
    """x op y, for op one of + - *."""
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    return x * y


def held_out(prompt):
    """An arithmetic problem is held out of every stage iff the crc32 of its whole prompt is 0 mod 10."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def draw_problem(rng, digits, ops, held, steps=1):
    """An arithmetic problem drawn until it is held out (held=True) or not (held=False) by held_out's rule."""
    while True:
        prompt, answer = arithmetic_problem(rng, digits, ops, steps)
        if held_out(prompt) == held:
            return prompt, answer


def held_out_problems(digits, ops, draws, steps=1):
    """The held-out problems an arithmetic evaluation asks: `draws` draws of a generator seeded 1234 (the same problems
    in every run, whatever --seed), repeats dropped, sorted."""
    rng = random.Random(1234)
    return sorted({draw_problem(rng, digits, ops, True, steps) for _ in range(draws)})


def arithmetic_reward(text, answer, format_reward=0.0):
    """Reward of a decoded completion: 1.0 when it is well formed and its final result is the answer's (e.g. "357");
    format_reward when it is well formed with another result; 0.0 otherwise (no end within the horizon, anything else
    before the end). Well formed: as many lines as the answer has, each a number (one operation) or a step "x op y=r"
    (several), each ended by a newline, the last one by a newline or <|endoftext|>. Only the final result is checked,
    not the steps (grpo.py's step_correct judges them)."""
    steps = len(answer.splitlines())  # the answer's lines (its newline may be left off)
    step = r"-?\d+[-+*]\d+=" if steps > 1 else ""  # one operation: a line is its result alone
    m = re.fullmatch(rf"(?:{step}-?\d+\n){{{steps - 1}}}{step}(-?\d+)(?:\n|<\|endoftext\|>)", text)
    if m is None:
        return 0.0
    if m.group(1) == answer.split("=")[-1].strip():
        return 1.0
    return format_reward


def answer_tokens(digits, steps):
    """Most tokens a right answer takes, its newlines included, and one more: its characters (a BPE token holds one
    or more). One operation: a result of up to 2 * digits digits (or a sign), a newline. Several: step i's line
    "x op y=r" with x of up to i * digits digits and r of up to (i + 1) * digits, each maybe signed."""
    if steps == 1:
        return 2 * digits + 2
    return digits * steps * (steps + 3) + 5 * steps + 1  # the sum over i of (2 i + 2) * digits + 5, and one


@torch.no_grad()
def arithmetic_answers(model, tok, problems, cfg, rt):
    """The model's greedy answers to arithmetic problems: (answers, exact). An answer is the text written after the
    prompt up to the end token: a newline or <|endoftext|>, or with --steps K > 1 the K-th newline (one step a line);
    exact is True where it ends so and arithmetic_reward scores it 1.0 (the result, well formed). Every rank answers
    every problem (FSDP: the forward is collective)."""
    ends = tok.encode("\n") + ([tok.eot_id] if tok.eot_id is not None else [])
    prompts = [tok.encode(p) for p, _ in problems]
    n_new = answer_tokens(cfg.digits, cfg.steps)  # more than any right answer takes
    model.eval()
    with rt.autocast():
        if cfg.steps == 1:
            tokens, mask = generate(model, prompts, n_new, 0.0, None, ends)
        else:  # generate() stops at the first end token: here every token is written, and the mask cut after the K-th
            tokens, _ = generate(model, prompts, n_new, 0.0)
            ends = ends[:1]  # a newline (not <|endoftext|>, as grpo.py's rollouts)
            is_end = (tokens == ends[0]).float()  # (B, n_new)
            mask = ((is_end.cumsum(1) - is_end) < cfg.steps).float()  # (B, n_new): up to the K-th newline
    model.train()
    answers = []
    exact = []
    for row, row_mask, (_, answer) in zip(tokens.tolist(), mask.tolist(), problems):
        ids = [t for t, m in zip(row, row_mask) if m > 0]
        ended = ids[-1] in ends
        text = tok.decode(ids[:-1] if ended else ids)
        answers.append(text)
        exact.append(ended and arithmetic_reward(text + "\n", answer) == 1.0)
    return answers, exact


def hh_dialogue(text, tok):
    """Token ids of one HH-RLHF dialogue and the mask of its Assistant turns (the SFT targets), then <eot>."""
    ids = []
    mask = []
    speaker = None
    for part in filter(None, re.split(r"(\n\nHuman:|\n\nAssistant:)", text)):
        is_marker = part in ("\n\nHuman:", "\n\nAssistant:")
        if is_marker:
            speaker = part
        piece = tok.encode(part)
        ids += piece
        mask += [speaker == "\n\nAssistant:" and not is_marker] * len(piece)  # a turn's text, not its marker
    return ids + [tok.eot_id], mask + [True]


def text_path(cfg):
    """The text file of --data: tiny Shakespeare (downloaded once, or --data_path) or the file named."""
    if cfg.data in ("shakespeare_char", "shakespeare"):
        return cfg.data_path or download(SHAKESPEARE_URL, SHAKESPEARE_PATH)
    return cfg.data


def make_tokenizer(cfg, model_spec):
    """The tokenizer of the model being trained (model_spec from a checkpoint), else the data's default."""
    default = "gpt2" if cfg.data in ("shakespeare", "hh_sft", "arithmetic") else "char"
    wanted = default if cfg.tokenizer == "auto" else cfg.tokenizer
    check(wanted in ("char", "gpt2"), f"--tokenizer {cfg.tokenizer!r}: use auto, char or gpt2")
    if model_spec is not None:
        kind = "gpt2" if model_spec == "gpt2" else "char"
        check(cfg.tokenizer in ("auto", kind), f"--tokenizer {cfg.tokenizer}: the model's tokenizer is {kind}")
        return get_tokenizer(model_spec)
    if wanted == "gpt2":
        return BPETokenizer()
    if cfg.data in ("arithmetic", "reasoning"):
        return CharTokenizer(ARITHMETIC_CHARS if cfg.data == "arithmetic" else REASONING_CHARS)
    check(cfg.data != "hh_sft", "--data hh_sft needs --tokenizer gpt2 (its <|endoftext|> ends each dialogue)")
    return CharTokenizer(sorted(set(read_text(text_path(cfg)))))


def read_jsonl(path, required):
    """Records of a .jsonl or .jsonl.gz file that hold every required string field. Bad lines are counted and
    skipped with a summary line; a file with no usable record is an error."""
    check(os.path.isfile(path), f"data file {path} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, EOFError) as e:
        die(f"cannot read {path} ({type(e).__name__}: {e})")
    check(lines, f"data file {path} is empty")
    parsed = map(json_or_none, lines)  # {} for a line that is not a JSON object
    records = [r for r in parsed if all(isinstance(r.get(k), str) and r[k] for k in required)]
    bad = len(lines) - len(records)
    check(records, f"{path}: no usable line ({bad} malformed; each line must be JSON with {', '.join(required)})")
    if bad:
        print(f"{path}: skipped {bad} malformed line(s), kept {len(records)}", file=sys.stderr)
    return records


def download(url, path):
    """Fetch url to path once (torch.hub writes a temporary file and renames it), for the default data."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, path)
        except Exception as e:
            die(f"cannot download {url} ({type(e).__name__}); offline, pass a local copy with --data_path")
    return path


# ----------------------------------------------------------------------------------------------------------
# Setup and main: flags checked, model and tokenizer, the training loop, samples.


def validate(cfg):
    """Impossible flags end the run with one line (exit code 2) before anything is written."""
    positive = (
        "batch_size",
        "grad_accum",
        "max_steps",
        "block_size",
        "eval_every",
        "eval_iters",
        "log_every",
        "save_every",
        "denoise_steps",
    )
    for name in positive:
        check(getattr(cfg, name) > 0, f"--{name} must be positive (got {getattr(cfg, name)})")
    check(cfg.num_samples >= 0, f"--num_samples must be >= 0 (got {cfg.num_samples})")
    check(cfg.lr > 0, f"--lr must be positive (got {cfg.lr})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    check(0 <= cfg.dropout < 1, f"--dropout must be in [0, 1) (got {cfg.dropout})")
    check(cfg.warmup_steps >= 0 and cfg.lr_decay_steps >= 0, "--warmup_steps and --lr_decay_steps must be >= 0")
    check(cfg.grad_clip >= 0 and cfg.weight_decay >= 0, "--grad_clip and --weight_decay must be >= 0")
    check(min(cfg.temperature, cfg.top_k, cfg.kv_latent_dim) >= 0, "--temperature, --top_k, --kv_latent_dim: >= 0")
    check(cfg.attention in ("mha", "mla"), f"--attention {cfg.attention!r}: use mha or mla")
    check(cfg.objective in ("causal", "denoise"), f"--objective {cfg.objective!r}: use causal or denoise")
    check(cfg.n_embd % cfg.n_head == 0, f"--n_embd {cfg.n_embd} must be a multiple of --n_head {cfg.n_head}")
    check(cfg.attention == "mla" or not cfg.kv_latent_dim, "--kv_latent_dim needs --attention mla")
    check(cfg.steps == 1 or cfg.data in ("arithmetic", "reasoning"), "--steps is for --data arithmetic, reasoning")
    for name in ("worked_frac", "bridge_frac"):
        check(0 <= getattr(cfg, name) <= 1, f"--{name} must be in [0, 1] (got {getattr(cfg, name)})")
    is_variant = (cfg.attention, cfg.objective, cfg.kv_latent_dim) != ("mha", "causal", 0)
    check(not cfg.export_hf or cfg.init_from != "scratch", "--export_hf needs --init_from, the model to export")
    # a checkpoint or GPT-2's weights keep their own kind of model
    check(
        cfg.init_from == "scratch" or not is_variant,
        "--attention, --objective, --kv_latent_dim build a new model (scratch)",
    )


def model_and_tokenizer(cfg, ckpt):
    """(model, tokenizer): a resumed run's, a checkpoint's (--init_from ckpt.pt, gpt.py's variants too), GPT-2 weights
    (--init_from gpt2 or a folder), or a new model (the flags; --attention, --objective)."""
    if ckpt is None and os.path.isfile(cfg.init_from):  # here, not load_model: that refuses gpt.py's variants
        ckpt = load_checkpoint(cfg.init_from)
    if ckpt is not None:
        try:  # TypeError: model_config fields neither GPTConfig nor the variants know; RuntimeError: other weights
            model = make_model({**ckpt["model_config"], "dropout": cfg.dropout})
            model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
        except (RuntimeError, TypeError) as e:
            die(f"--init_from {cfg.init_from}: not a checkpoint of gpt.py's GPT ({str(e).splitlines()[0]})")
        return model, make_tokenizer(cfg, ckpt["tokenizer"])
    if cfg.init_from != "scratch":
        model, spec, _ = load_model(cfg.init_from, cfg.dropout)
        model.variant = {}
        return model, make_tokenizer(cfg, spec)
    tok = make_tokenizer(cfg, None)
    model_config = {k: getattr(cfg, k) for k in ("block_size", "n_layer", "n_head", "n_embd", "dropout", "bias")}
    model_config["vocab_size"] = tok.vocab_size
    if cfg.attention == "mla":
        model_config["attention"] = "mla"
        model_config["kv_latent_dim"] = cfg.kv_latent_dim or 2 * cfg.n_embd // 3  # see Config.kv_latent_dim
    if cfg.objective == "denoise":
        model_config["objective"] = "denoise"
        model_config["vocab_size"] += 1  # the mask token
    return make_model(model_config), tok


def write_samples(model, tok, cfg, rt, out_dir, problems):
    """samples.txt: --num_samples continuations of --sample_prompt (every rank takes part: under FSDP the forward
    is collective), by generate() or, for a denoiser, denoise_generate(); with held-out arithmetic problems, each
    problem and the model's greedy answer instead, one a line ("17+25=42"), under a header line; a wrong answer is
    followed by "  # wrong: " and the right one. Returns the texts and the sampling speed (generated tokens per
    second)."""
    if problems:
        t0 = time.time()
        answers, exact = arithmetic_answers(model, tok, problems, cfg, rt)
        n_tokens = sum(len(tok.encode(a)) + 1 for a in answers)  # each answer and its end token
        texts = [p + a.replace("\n", "\\n") for (p, _), a in zip(problems, answers)]  # one a line: BPE has "\n\n"
        for i, (_, answer) in enumerate(problems):
            if not exact[i]:
                texts[i] += "  # wrong: " + answer.strip().replace("\n", "\\n")
        if rt.master:
            with open(os.path.join(out_dir, "samples.txt"), "w") as f:
                f.write(f"# greedy answers to the {len(problems)} held-out problems, sorted; {sum(exact)} right\n")
                f.write("\n".join(texts) + "\n")
        return texts, n_tokens / (time.time() - t0)
    if cfg.num_samples == 0:  # none asked for: no samples.txt
        return [], None
    prompt = tok.encode(cfg.sample_prompt)
    if not prompt:  # an empty prompt: start from <|endoftext|>, or from token 0 of a char vocabulary
        prompt = [tok.eot_id] if tok.eot_id is not None else [0]
    prompt = prompt[-(model.config.block_size // 2) :]  # at most half the context: the rest is for the sample
    n_new = min(cfg.sample_tokens, model.config.block_size - len(prompt))
    prompts = [prompt] * cfg.num_samples
    top_k = cfg.top_k or None
    gen = torch.Generator(rt.device).manual_seed(cfg.seed)
    model.eval()
    t0 = time.time()
    with rt.autocast():
        if model.variant.get("objective") == "denoise":
            tokens, mask = denoise_generate(model, prompts, n_new, cfg.denoise_steps, cfg.temperature, top_k, gen)
        else:
            tokens, mask = generate(model, prompts, n_new, cfg.temperature, top_k, tok.eot_id, gen)
    speed = mask.sum().item() / (time.time() - t0)
    texts = [tok.decode(prompt + t[m > 0].tolist()) for t, m in zip(tokens.cpu(), mask.cpu())]
    if rt.master:
        with open(os.path.join(out_dir, "samples.txt"), "w") as f:
            f.write("\n\n==========\n\n".join(texts) + "\n")
    return texts, speed


def export_hf(init_from, folder):
    """--export_hf DIR: the model of --init_from (a ckpt.pt of any script, a GPT-2 folder or hub id) in the Hugging
    Face GPT-2 layout: config.json and model.safetensors, which transformers.GPT2LMHeadModel.from_pretrained(DIR)
    loads, and the tokenizer, which AutoTokenizer.from_pretrained(DIR) loads offline: GPT-2 BPE from the two files
    tiktoken downloaded (encoder.json and vocab.bpe are GPT-2's vocab.json and merges.txt), a char vocabulary as
    one WordLevel token per character. A reward model exports its GPT body: GPT2LMHeadModel has no place for the
    head. MLA and the denoiser have no GPT-2 layout and are refused."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, PreTrainedTokenizerFast

    check(not os.path.isdir(folder) or not os.listdir(folder), f"--export_hf {folder}: the folder is not empty")
    ckpt = load_checkpoint(init_from) if os.path.isfile(init_from) else {"model_config": {}}
    variant = {k: v for k, v in ckpt["model_config"].items() if k in ("attention", "objective")}
    check(not variant, f"--export_hf: {init_from} is a {variant} model; GPT-2's layout has neither")
    model, spec, ckpt = load_model(init_from)
    c = model.config
    # the token that ends an answer, where transformers' generate() stops: GPT-2's <|endoftext|>, a char model's newline
    eot = 50256 if spec == "gpt2" else None
    if spec != "gpt2" and "\n" in spec["chars"]:
        eot = spec["chars"].index("\n")
    hf_config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    hf = GPT2LMHeadModel(hf_config)
    hf.generation_config.eos_token_id = eot
    hf.generation_config.pad_token_id = eot
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for key, value in model.state_dict().items():
        state[key] = value.t() if key.endswith(conv1d) else value  # GPT-2's Conv1D stores (in, out)
    result = hf.load_state_dict(state, strict=False)
    check(not result.unexpected_keys, f"--export_hf: weights GPT-2 has no place for: {result.unexpected_keys[:3]}")
    with torch.no_grad():
        for key in result.missing_keys:  # a model without biases (--no-bias): GPT-2's biases are zero
            hf.get_parameter(key).zero_()
    os.makedirs(folder, exist_ok=True)
    hf.save_pretrained(folder)
    if spec == "gpt2":
        from tiktoken.load import read_file_cached

        url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
        vocab = os.path.join(folder, "vocab.json")
        merges = os.path.join(folder, "merges.txt")
        with open(vocab, "wb") as f:
            f.write(read_file_cached(url + "encoder.json"))
        with open(merges, "wb") as f:
            f.write(read_file_cached(url + "vocab.bpe"))
        GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(folder)
    else:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        char = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(spec["chars"])}, unk_token=None))
        char.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one piece a character
        char.decoder = decoders.Fuse()  # joined back with nothing between them
        PreTrainedTokenizerFast(tokenizer_object=char).save_pretrained(folder)
    print(f"wrote {folder}: GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained load it")
    if ckpt is not None and "reward_head" in ckpt:
        print("a reward model: only its GPT body was exported (the reward head stays in the checkpoint)")


def main():
    cfg = parse_config(Config)
    validate(cfg)
    if cfg.export_hf:
        export_hf(cfg.init_from, cfg.export_hf)
        return
    rt = setup_runtime(cfg)
    out_dir = prepare_out_dir(cfg, "gpt", rt)
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    stop = GracefulExit()
    ckpt = load_checkpoint(ckpt_path) if cfg.resume else None
    raw_model, tok = model_and_tokenizer(cfg, ckpt)
    block_size = raw_model.config.block_size
    check(cfg.block_size <= block_size, f"--block_size {cfg.block_size} is longer than the model's {block_size}")
    check(tok.vocab_size <= raw_model.config.vocab_size, "the tokenizer has more tokens than the model's vocabulary")
    train_split, val_split = load_splits(cfg, tok)
    splits = {"train": train_split, "val": val_split}
    for name, (ids, _) in splits.items():
        check(len(ids) > cfg.block_size + 1, f"the {name} split has {len(ids)} tokens; it needs > --block_size + 1")
    model = wrap_model(raw_model.to(rt.device), rt, cfg.compile)
    optimizer = make_optimizer(raw_model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    start_step = 0
    if ckpt is not None:
        start_step = ckpt["step"]
        load_optimizer_state(raw_model, optimizer, ckpt["optimizer"], rt)
        restore_rng(ckpt, rt)
        if ckpt.get("scaler"):  # float16: the loss scale the run had reached, not 65536 again
            scaler.load_state_dict(ckpt["scaler"])
        del ckpt
    # --objective denoise: masked batches (get_batch), the mask token being the vocabulary's last id
    mask_id = raw_model.config.vocab_size - 1 if raw_model.variant.get("objective") == "denoise" else None

    # --data arithmetic: greedy answers to held-out problems too (a denoiser has no left-to-right greedy answer)
    problems = []
    if cfg.data == "arithmetic" and mask_id is None:
        problems = held_out_problems(
            cfg.digits, cfg.ops, 1000, cfg.steps
        )  # 461 at --digits 2 (grpo.py --eval_size 1000)
        longest = (cfg.steps + 1) * (cfg.digits + 1) + answer_tokens(cfg.digits, cfg.steps)  # the longest prompt too
        check(
            longest <= block_size,
            f"--digits {cfg.digits} --steps {cfg.steps}: a problem and its answer exceed the context",
        )

    def batch(data, device, generator=None):
        return get_batch(data, cfg.batch_size, cfg.block_size, device, generator, mask_id)

    fixed = torch.Generator().manual_seed(0)  # the same evaluation batches at every evaluation
    eval_batches = {name: [batch(data, "cpu", fixed) for _ in range(cfg.eval_iters)] for name, data in splits.items()}
    if rt.master:
        print_start(raw_model, rt, out_dir, f"vocab {tok.vocab_size}, data {cfg.data}")

    model_config = {**dataclasses.asdict(raw_model.config), **raw_model.variant}  # a variant's fields: see make_model

    def checkpoint(step):
        model_sd, optim_sd = training_state(raw_model, optimizer, rt)  # collective under FSDP: every rank calls it
        rngs = all_rng_states(rt)
        if rt.master:
            state = {
                "model": model_sd,
                "model_config": model_config,
                "tokenizer": tok.spec,
                "step": step,
                "optimizer": optim_sd,
                "scaler": scaler.state_dict(),
                "rng": rngs[0],
                "rng_ranks": rngs,
                "config": dataclasses.asdict(cfg),
            }
            save_checkpoint(ckpt_path, state)

    save_config(cfg, out_dir, rt)  # every input is checked: from here on the run folder is written
    logger = Logger(cfg, out_dir, rt, cfg.max_steps, start_step)
    t_start = time.time()
    evals = []
    last_eval = {}
    n_tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum * rt.world_size
    for step in range(start_step, cfg.max_steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            last_eval = evaluate(model, eval_batches, rt)
            if problems:
                _, exact = arithmetic_answers(raw_model, tok, problems, cfg, rt)
                last_eval["eval/accuracy"] = sum(exact) / len(exact)
                last_eval["eval/n_problems"] = len(exact)  # distinct held-out problems
            evals.append(last_eval["eval/val_loss"])
            logger.log(step, last_eval)
        if step == cfg.max_steps:
            break
        t0 = time.time()
        lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = [batch(splits["train"], rt.device) for _ in range(cfg.grad_accum)]
        train_loss, grad_norm = train_step(model, optimizer, scaler, batches, rt, cfg.grad_clip)
        stop_requested = stop.requested(step + 1, rt)
        stop_if_not_finite(train_loss, step, ckpt_path, rt)
        dt = time.time() - t0
        logger.bar.update(1)
        logger.bar.set_postfix(loss=f"{train_loss:.4f}")
        metrics = {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": grad_norm}
        perf = {
            "perf/tokens_per_s": n_tokens / dt,
            "perf/step_ms": 1000 * dt,
            "perf/mfu": mfu(raw_model, cfg.block_size, n_tokens, dt, rt),
        }
        logger.log(step, {**metrics, **perf}, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested:
            checkpoint(step + 1)
        if stop_requested:
            stop.exit(step + 1, out_dir, rt)
    checkpoint(cfg.max_steps)
    logger.close()
    texts, sample_speed = write_samples(raw_model, tok, cfg, rt, out_dir, problems)
    if rt.master:
        results = {
            "final_val_loss": last_eval["eval/val_loss"],
            "final_train_loss": last_eval["eval/train_loss"],
            "best_val_loss": min(evals),
            "steps": cfg.max_steps,
            "wall_time_s": time.time() - t_start,
            "params": raw_model.num_params(),
            "tokens_per_step": n_tokens,
            "sample_tokens_per_s": sample_speed,
        }
        if problems:
            results["final_accuracy"] = last_eval["eval/accuracy"]
            results["n_problems"] = len(problems)
        with open(os.path.join(out_dir, "final_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        print("\n".join(texts[:5] if problems else texts[:1]))  # the first of samples.txt
        summary = f"val loss {results['final_val_loss']:.4f}"
        if problems:
            summary += f", accuracy {results['final_accuracy']:.3f} on {len(problems)} held-out problems"
        print_end(summary, out_dir, results["wall_time_s"])
    cleanup(rt)


def mfu(model, seq_len, tokens, seconds, rt):
    """Model FLOPs utilisation against the GPU's dense bf16 peak (None off CUDA or on an unknown GPU). FLOPs per
    token: 6N for the weights plus the attention scores, forward and backward (PaLM appendix B)."""
    c = model.config
    flops = (6 * model.num_params() + 12 * c.n_layer * c.n_embd * seq_len) * tokens
    name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else ""
    peaks = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40": 181e12}
    peak = next((v for k, v in peaks.items() if k in name), None)
    return None if peak is None else flops / (seconds * peak * rt.world_size)


# Everything below is copied verbatim from gpt.py, where it is read: the GPT-2 model, sampling and log-probs
# (model), then the command line, runtime, checkpoints, tokenizers and logging (train). tests/test_shared_blocks.py
# checks that every copy equals gpt.py's; `python tests/test_shared_blocks.py --fix` copies gpt.py's into each script.


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


# ----- BEGIN SHARED BLOCK: train (verbatim copy of gpt.py; tests/test_shared_blocks.py) -----
class _ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, instead of argparse's usage dump
        die(f"{message} (see --help)")


def parse_config(cls, argv=None):
    """Build the command line from a Config dataclass: each field is a flag and its comment is the help. With
    --resume, the run's saved settings (out_dir/config.json), overridden by the flags given now."""
    helps = dict(re.findall(r"^\s+(\w+):[^=\n]*=[^#\n]*#\s*(.+)$", inspect.getsource(cls), re.M))
    doc = (sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0]  # the first paragraph (argparse rewraps it)
    parser = _ArgParser(description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    for f in dataclasses.fields(cls):
        kw = dict(default=f.default, help=helps.get(f.name, " "))
        if f.type is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=f.type, metavar=f.type.__name__.upper(), **kw)
    cfg = cls(**vars(parser.parse_args(argv)))
    if not getattr(cfg, "resume", False):
        return cfg
    check(cfg.out_dir, "--resume needs --out_dir, the folder of the run to continue")
    path = os.path.join(cfg.out_dir, "config.json")
    check(os.path.isfile(path), f"--resume: no run at {cfg.out_dir} (config.json is missing)")
    with open(path, errors="replace") as f:  # a file cut short or not text: no settings, not a traceback
        saved = json_or_none(f.read())
    check(saved, f"--resume: {path} does not hold the settings of a run; restore it or start a new run")
    foreign = sorted(saved.keys() - vars(cfg).keys())  # vars(cfg): the fields
    check(not foreign, f"--resume: {cfg.out_dir} holds a run of another script (it has --{', --'.join(foreign[:3])})")
    parser.set_defaults(**saved)  # the run's settings are the defaults now: the flags given override them
    return cls(**vars(parser.parse_args(argv)))


def die(message):
    """Bad input: one clear line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check(condition, message):
    if not condition:
        die(message)


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    parallel: str = "ddp"
    decode: object = decode_step  # generate's decode step: wrap_model compiles it under --compile

    def __post_init__(self):
        self.master = self.rank == 0
        self.distributed = self.world_size > 1

    def autocast(self):  # mixed precision for forward passes; float32 runs without autocast
        return nullcontext() if self.dtype == torch.float32 else torch.autocast(self.device.type, dtype=self.dtype)


def setup_runtime(cfg):
    """Pick device and dtype, join the torchrun process group if there is one, seed every generator."""
    check(cfg.device in ("auto", "cpu", "cuda", "mps"), f"--device {cfg.device!r}: use auto, cpu, cuda or mps")
    check(cfg.dtype in ("auto", "float32", "bfloat16", "float16"), f"--dtype {cfg.dtype!r}: unknown dtype")
    check(cfg.parallel in ("ddp", "fsdp"), f"--parallel {cfg.parallel!r}: use ddp or fsdp")
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    device = next(d for d in available if available[d]) if cfg.device == "auto" else cfg.device
    check(available[device], f"--device {device}: it is not available")
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if "RANK" in os.environ:  # launched by torchrun
        if device == "cuda":
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    device = torch.device(device)
    dtype = cfg.dtype
    if dtype == "auto":  # float32 off a GPU; on one, bfloat16 where it has it, float16 on an older one
        dtype = "float32"
        if device.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on a GPU that has them (cuDNN's are on by default)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    seed_everything(cfg.seed + rank)
    return Runtime(device, getattr(torch, dtype), rank, local_rank, world_size, cfg.parallel)


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def all_reduce(tensor, rt, op="sum"):
    """Sum (or max) a tensor over ranks in place; a no-op in a single process."""
    if rt.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def broadcast_object(obj, rt):
    """Rank 0's value of a picklable object on every rank."""
    box = [obj]
    if rt.distributed:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def cleanup(rt):
    """Leave the process group once every rank is done: a rank that tears down its connections while another still
    has a collective in flight can abort that rank (gloo ends it with std::terminate)."""
    if rt.distributed:
        dist.barrier()
        dist.destroy_process_group()


def broadcast_weights(model, rt):
    """Rank 0's parameters and buffers on every rank. A model built from scratch differs per rank (each rank seeds
    with its rank); DDP copies rank 0's weights when it wraps a model, FSDP2 does not."""
    if rt.distributed:
        for t in model.state_dict().values():  # detached views of the weights: broadcast writes into them in place
            dist.broadcast(t, src=0)


def wrap_model(model, rt, compile=False):
    """DDP or FSDP2 (fully_shard per transformer Block, then the root) under torchrun; optional torch.compile.
    model is a GPT or any module built around GPTs (a value or reward head, a separate value model).
    Returns the model to train; keep the unwrapped one for checkpoints, sampling and frozen copies. compile also
    compiles generate's decode step, rt.decode (CUDA graphs on a GPU; under FSDP sampling stays eager)."""
    broadcast_weights(model, rt)
    if rt.distributed and rt.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in [m for m in model.modules() if isinstance(m, Block)]:
            fully_shard(block)
        fully_shard(model)  # the root holds the rest: embeddings (tied to lm_head), ln_f, any head
    elif compile:
        rt.decode = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    model = torch.compile(model) if compile else model
    if rt.distributed and rt.parallel == "ddp":
        device_ids = [rt.local_rank] if rt.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def grad_sync(model, enabled):
    """Gradients are all-reduced only on the last micro-batch of an optimizer step: the others accumulate
    locally, which saves one communication per micro-batch."""
    if hasattr(model, "require_backward_grad_sync"):  # DDP
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)


def make_optimizer(model, lr, weight_decay, betas, device):
    """AdamW; matrices decay, biases and LayerNorm gains do not. The fused kernel (CUDA and CPU) updates each
    parameter in one pass, without temporaries the size of the 50k-token embedding."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type in ("cuda", "cpu"))


def cosine_lr(step, lr, min_lr, warmup_steps, decay_steps):
    """Linear warm-up to lr, then cosine decay to min_lr at decay_steps, constant after. min_lr None means lr / 10
    (nanoGPT's rule), so a smaller --lr never leaves the schedule climbing to a default floor above it."""
    if min_lr is None:
        min_lr = lr / 10
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def clip_grad_norm(model, max_norm):
    """Clip and return the gradient norm before clipping (max_norm 0: measure only)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 returns a DTensor


class GracefulExit:
    """SIGTERM and Ctrl-C set a flag instead of killing the process: the training loop notices it at the next
    step boundary (all ranks agree through all_reduce), writes a checkpoint, and exits 143 or 130.
    Test hooks: FAULT_SIGTERM_AT_STEP=N acts as a SIGTERM after N completed steps; FAULT_RAISE_AT_STEP=N raises an
    error on rank FAULT_RAISE_RANK (default 0) after N completed steps, as a crashing rank would."""

    def __init__(self):
        self.signum = 0
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: setattr(self, "signum", signum))

    def requested(self, completed_steps, rt):
        if fault_at("FAULT_SIGTERM_AT_STEP", completed_steps):
            self.signum = signal.SIGTERM
        if fault_at("FAULT_RAISE_AT_STEP", completed_steps) and rt.rank == int(os.environ.get("FAULT_RAISE_RANK", 0)):
            raise RuntimeError(f"FAULT_RAISE_AT_STEP: injected error on rank {rt.rank} after step {completed_steps}")
        # the signal any rank got (self.signum itself is left to the handler: writing it here could erase a signal
        # that arrives during the all_reduce)
        self.agreed = int(all_reduce(torch.tensor(float(self.signum), device=rt.device), rt, op="max").item())
        return self.agreed > 0

    def exit(self, step, out_dir, rt):
        """Once the checkpoint of step is saved: one line saying how to continue, then exit 143 or 130."""
        if rt.master:
            name = signal.Signals(self.agreed).name
            note(f"stopped by {name} at step {step}; checkpoint saved. Continue with: --resume --out_dir {out_dir}")
        cleanup(rt)
        sys.exit(128 + self.agreed)


def fault_at(name, step):
    """Test hooks: whether the environment variable name (FAULT_..._AT_STEP) names step."""
    return step == int(os.environ.get(name, -1))


def print_start(model, rt, out_dir, details):
    """A run's first line, alike in every script: the model's size, the processes and device, what the run does, and
    its run folder."""
    print(f"{model.num_params() / 1e6:.2f}M parameters, {rt.world_size} x {rt.device}, {details}; run folder {out_dir}")


def print_end(summary, out_dir, seconds):
    """A run's last line, alike in every script: its headline metrics, its run folder and its wall time."""
    print(f"{summary}; run folder {out_dir}; {seconds:.0f} s")


def note(message):
    """One line on stderr, above tqdm's progress bar when one is showing rather than glued to its end."""
    tqdm.write(message, file=sys.stderr)


def stop_if_not_finite(loss, step, ckpt_path, rt):
    """A NaN or infinite loss ends the run with exit code 1 before this step can be saved, so ckpt.pt stays the last
    good checkpoint. The loss is all-reduced, so every rank stops here together. FAULT_NAN_AT_STEP=N (for tests)
    makes step N's loss NaN."""
    loss = float("nan") if fault_at("FAULT_NAN_AT_STEP", step) else loss
    if math.isfinite(loss):
        return
    if rt.master:
        kept = f"{ckpt_path} is kept (resume from it with --resume and a lower --lr)"
        kept = kept if os.path.exists(ckpt_path) else "no checkpoint had been saved yet"
        note(f"error: loss is {loss} at step {step}; stopping. {kept}")
    cleanup(rt)
    sys.exit(1)


def all_rng_states(rt):
    """Every rank's Python and torch generator states (rank order; numpy's random is not used), so a resumed
    multi-process run continues each rank's stream."""
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), **cuda}
    states = [state] * rt.world_size
    if rt.distributed:
        dist.all_gather_object(states, state)
    return states


def restore_rng(ckpt, rt):
    """This rank's stream of a checkpoint; under another world size, rank 0's and a distinct seed per rank."""
    states = ckpt.get("rng_ranks") or [ckpt["rng"]]
    state = states[rt.rank] if len(states) == rt.world_size else ckpt["rng"]
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if len(states) != rt.world_size and rt.rank:
        seed_everything(ckpt["config"]["seed"] + rt.rank + ckpt["step"])


def training_state(model, optimizer, rt):
    """Full (unsharded) model and optimizer state dicts on CPU. Under FSDP every rank must call it (it
    gathers shards); parameters are keyed by name, so a checkpoint resumes under DDP, FSDP or one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    fsdp = rt.distributed and rt.parallel == "fsdp"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if fsdp else None
    model_sd = get_model_state_dict(model, options=opts)  # without options: model.state_dict(), detached
    return {k: v.cpu() for k, v in model_sd.items()}, get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer_state(model, optimizer, state, rt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True) if rt.distributed and rt.parallel == "fsdp" else None
    set_optimizer_state_dict(model, optimizer, state, options=opts)


def save_checkpoint(path, ckpt):
    """Write atomically: a temporary file, flushed to disk, then renamed over the old checkpoint, so a crash at
    any moment leaves either the previous or the new complete checkpoint. A failed write (disk full) ends the run
    with exit code 1 and keeps the previous checkpoint. FAULT_SLOW_SAVE_AT_STEP=N (for tests) pauses step N's save
    between the write and the rename, so a test can kill the process in the middle of a save."""
    tmp = f"{path}.tmp"
    try:
        torch.save(ckpt, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        why = e.strerror if isinstance(e, OSError) else f"{str(e).splitlines()[0]}: is the disk full?"
        note(f"error: cannot write the checkpoint {tmp} ({why}); {path} is left as it was")
        sys.exit(1)
    if fault_at("FAULT_SLOW_SAVE_AT_STEP", ckpt["step"]):
        time.sleep(60)
    os.replace(tmp, path)


def load_checkpoint(path):
    check(os.path.isfile(path), f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"cannot read checkpoint {path} ({type(e).__name__}): truncated or not a checkpoint; pass an intact one")
    check(isinstance(ckpt, dict) and "model" in ckpt and "model_config" in ckpt, f"{path} is not a checkpoint")
    return ckpt


def load_model(init_from, dropout=0.0):
    """A model and its tokenizer from --init_from: a ckpt.pt of any script, a Hugging Face GPT-2 folder, or a
    hub id. Returns (GPT, tokenizer spec, checkpoint dict or None)."""
    if os.path.isfile(init_from):
        ckpt = load_checkpoint(init_from)
        try:  # TypeError: a model_config with fields GPTConfig lacks (gpt.py's --attention mla, --objective denoise)
            model = GPT(GPTConfig(**{**ckpt["model_config"], "dropout": dropout}))
            model.load_state_dict(ckpt["model"])  # training_state's keys: no torch.compile or DDP prefixes
        except (RuntimeError, TypeError) as e:
            die(f"--init_from {init_from}: not a checkpoint of this script's GPT ({str(e).splitlines()[0]})")
        return model, ckpt["tokenizer"], ckpt
    if os.path.isdir(init_from) and not os.path.isfile(os.path.join(init_from, "config.json")):
        die(f"--init_from {init_from}: a folder needs config.json and model.safetensors (Hugging Face GPT-2 layout)")
    path_like = init_from.endswith(".pt") or init_from.startswith(("/", ".", "~"))
    check(os.path.isdir(init_from) or not path_like, f"--init_from {init_from}: no such file")
    hub = "cannot load it from the Hugging Face hub; pass a ckpt.pt or a GPT-2 folder"
    if not os.path.isdir(init_from):  # a hub id
        import huggingface_hub

        try:  # one quick request: on an unreachable hub, the download itself retries for about a minute
            huggingface_hub.model_info(init_from, timeout=10)
        except Exception as e:  # offline, or an unknown id: a copy downloaded earlier still does
            cached = huggingface_hub.try_to_load_from_cache(init_from, "config.json")
            check(isinstance(cached, str), f"--init_from {init_from}: {hub} ({type(e).__name__})")
            init_from = os.path.dirname(cached)
    try:
        return GPT.from_pretrained(init_from, dropout=dropout), "gpt2", None
    except Exception as e:  # ValueError: weights that do not fit; others: the hub (no weights, a broken download)
        die(f"--init_from {init_from}: {e if isinstance(e, ValueError) else f'{hub} ({type(e).__name__})'}")


class CharTokenizer:
    """One token per character of a fixed alphabet."""

    def __init__(self, chars):
        self.chars = "".join(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.eot_id = None
        self.spec = {"type": "char", "chars": self.chars}

    def encode(self, text):
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class BPETokenizer:
    """GPT-2 byte-pair encoding through tiktoken; <|endoftext|> (50256) ends documents."""

    def __init__(self):
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            die(f"cannot load the GPT-2 BPE files ({type(e).__name__}); offline, set TIKTOKEN_CACHE_DIR to them")
        self.vocab_size = self.enc.n_vocab
        self.eot_id = self.enc.eot_token
        self.spec = "gpt2"
        self.encode = self.enc.encode_ordinary  # text -> ids, <|endoftext|> in text is plain text

    def decode(self, ids):
        return self.enc.decode(list(ids))


def get_tokenizer(spec):
    """The tokenizer a checkpoint names: "gpt2" or {"type": "char", "chars": ...}."""
    if spec == "gpt2":
        return BPETokenizer()
    check(isinstance(spec, dict) and spec.get("type") == "char", f"unknown tokenizer {spec!r}")
    return CharTokenizer(spec["chars"])


def read_text(path):
    check(os.path.isfile(path), f"data file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        die(f"{path} is not UTF-8 text")
    check(text, f"data file {path} is empty")
    return text


def prepare_out_dir(cfg, script, rt):
    """Resolve --out_dir (same on every rank), refuse to overwrite an existing run, and prove it is writable
    before anything is loaded. It leaves no trace: save_config writes the run's first file once every input has
    been checked, so bad input leaves a run folder as it was."""
    out_dir = broadcast_object(cfg.out_dir or os.path.join("out", f"{script}-{time.strftime('%Y%m%d-%H%M%S')}"), rt)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    if cfg.resume:
        check(os.path.isfile(ckpt), f"--resume: no checkpoint at {ckpt} yet; start the run again without --resume")
    else:
        check(not os.path.exists(ckpt), f"{out_dir} already holds a run; pass --resume or another --out_dir")
    if rt.master:  # a probe file in the deepest folder of out_dir that exists (a file there: not a folder)
        d = os.path.abspath(out_dir)
        while not os.path.exists(d):
            d = os.path.dirname(d)
        try:
            with tempfile.TemporaryFile(dir=d) as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            die(f"--out_dir {out_dir} is not writable ({e.strerror})")
    return out_dir


def save_config(cfg, out_dir, rt):
    """config.json of the run (atomically: --resume reads it back), written after every input has been checked."""
    if rt.master:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "config.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        os.replace(f"{path}.tmp", path)


class Logger:
    """Rank 0 writes metrics.jsonl (closed at every line), shows a tqdm bar and a line every log step, and
    mirrors to wandb when asked; close() draws training_curves.png. Other ranks log nothing."""

    def __init__(self, cfg, out_dir, rt, total_steps, start_step=0):
        self.master = rt.master
        self.wandb = None
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if self.master:  # lines past the checkpoint (all, in a new run) are dropped
            rows = read_metrics(self.path) if os.path.exists(self.path) else []
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] < start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not self.master, dynamic_ncols=True)
        if self.master and cfg.wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project, name=os.path.basename(out_dir), config=dataclasses.asdict(cfg)
            )

    def log(self, step, metrics, echo=True):
        if not self.master:
            return
        if any(k.startswith("eval/") for k in metrics):
            # an evaluation: the time since the bar last moved (the evaluation, a checkpoint) is no step's, so the
            # bar's clock skips it and its rate and time left stay those of the training steps
            self.bar.unpause()
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        with open(self.path, "a") as f:  # closed at every line: a killed run keeps all it logged
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if echo:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
            sys.stdout.flush()  # a log file of stdout keeps every line if the run is killed

    def close(self):
        if not self.master:
            return
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        plot_curves(self.path, os.path.join(os.path.dirname(self.path), "training_curves.png"))


def json_or_none(line):
    """The JSON object of a text (a line of metrics.jsonl, a config.json), or {} for a malformed one (cut short by a
    killed process)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def read_metrics(path):
    with open(path) as f:
        return [r for r in map(json_or_none, f) if "step" in r]


def curve_panels(rows):
    """The panels of training_curves.png, each a list of metric names: the losses (training and held-out on one
    panel), the reward, the KL to the reference, and the first held-out metric besides the losses. A metric that
    was never logged, or never changed, is left out, and so is a panel left empty."""
    changed = [k for k in dict.fromkeys(k for r in rows for k in r) if len({r[k] for r in rows if k in r}) > 1]
    losses = [k for k in ("train/loss", "eval/train_loss", "eval/val_loss", "eval/loss") if k in changed]
    held_out = [k for k in changed if k.startswith("eval/") and k not in losses]
    rl = [[k] for k in ("rl/reward_mean", "rl/kl") if k in changed]
    return [keys for keys in (losses, *rl, held_out[:1]) if keys]


def plot_curves(metrics_path, png_path):
    """training_curves.png: curve_panels' panels in a row against the step, each labelled by its first metric."""
    from matplotlib.figure import Figure  # no pyplot: no display backend, no global figure state

    rows = read_metrics(metrics_path)
    panels = curve_panels(rows)
    if not panels:
        return
    fig = Figure(figsize=(4.5 * len(panels), 3.2), layout="tight")
    for ax, keys in zip(fig.subplots(1, len(panels), squeeze=False).flat, panels):
        for key in keys:
            ax.plot(*zip(*[(r["step"], r[key]) for r in rows if key in r]), marker=".", label=key)
        ax.set(xlabel="step", ylabel=keys[0])
        ax.legend(fontsize=8)
    fig.savefig(png_path, dpi=100)


# ----- END SHARED BLOCK: train -----


if __name__ == "__main__":
    main()
