"""
grpo.py: the GRPO family (GRPO, DAPO, Dr. GRPO, GSPO, LUSPO, CISPO, SAPO, RLOO, REINFORCE) on token-level tasks, one
flag at a time. Formulas, implementation details, every flag and metric, and results: docs/grpo.md.

For every prompt q the policy samples a group of G completions o_1..o_G, a task scores them, and the rewards become
group-relative advantages A. The policy then maximises a clipped surrogate (Shao et al. 2024, DeepSeekMath):

    J = agg_{i,t}[ min(r_it A_it, clip(r_it, 1 - eps, 1 + eps_high) A_it) ] - beta * mean_t k(d_it) + c_H * H(pi)
    r_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)     (pi_old: the policy that sampled; --num_iterations > 1
                                                              reuses one batch of rollouts for several updates)
Every log-prob of a completion token (pi, pi_old, the entropy H) is taken under the sampling distribution,
softmax(logits / --temperature) over the --top_k largest logits, so the first update on a batch starts from r = 1;
the reference is scored at the same temperature over the whole vocabulary (as TRL), so the KL stays finite.
Advantages (--adv): group  A_i = (R_i - mean_G R) / (std_G R + 1e-4), unbiased std (--scale_rewards batch: the
batch's std; none: no division, Dr. GRPO) | rloo  A_i = R_i - mean of the other G - 1 rewards (Ahmadian et al.
2024) | process  per-token rewards normalised by their group's mean and std, A_t = their sum from t on (next_token;
arithmetic with a --reward_model, prm or orm: only each step's newline carries a reward, sigmoid(its score)).
Loss types (--loss_type): N sequences of |o_i| tokens in the optimizer step (all micro-batches and ranks), L =
--horizon, term_it the clipped token term above:
    grpo       -1/N sum_i 1/|o_i| sum_t term_it        each sequence weighs the same: a token of a long completion
                                                         weighs less (the length bias of Dr. GRPO)
    dapo       -1/(sum_i |o_i|) sum_i,t term_it         every token of the step weighs the same (Yu et al. 2025),
                                                         with its clip-higher --clip_eps_high 0.28 (which, as TRL's
                                                         epsilon_high, is the upper clip of every clipped loss)
    dr_grpo    -1/(N L) sum_i,t term_it                 a constant normaliser, no length bias (Liu et al. 2025);
                                                         pair it with --scale_rewards none
    gspo       -1/N sum_i min(s_i A_i, clip(s_i) A_i)   sequence ratio s_i = exp(mean_t log r_it) (Zheng et al.
                                                         2025); default clip the paper's [1 - 3e-4, 1 + 4e-4]: a
                                                         length-normalised ratio would never leave 1 +- 0.2
    luspo      -1/N sum_i |o_i| min(s_i A_i, clip(s_i) A_i)   gspo's term times the length (arXiv 2602.05261, TRL's
                                                         form): no extra weight on a short completion's tokens
    cispo      -1/(sum |o_i|) sum sg(min(r_it, 1 + eps_high)) A_it log pi(o_it)   the ratio is a detached weight,
                                                         so clipped tokens still get a gradient (MiniMax-M1, 2025)
    reinforce  -1/(sum |o_i|) sum A_it log pi(o_it)     no ratio, no clip; with --adv rloo this is RLOO
    sapo       -1/N sum_i 1/|o_i| sum_t (4/tau) sigmoid(tau (r_it - 1)) A_it   a soft gate, no clip (Gao et al.
                                                         2025, arXiv 2511.20347): tau = --sapo_tau_pos where A > 0,
                                                         else --sapo_tau_neg; at r = 1 the plain policy gradient
Variants of the policy term, each off by default:
    --clip_delta d            grpo, dapo, dr_grpo: the unclipped ratio in the min is min(r_it, d) (INTELLECT-2's
                              two-sided clip), so a token with A < 0 and a huge ratio adds at most d |A|
    --top_entropy_quantile p  A_it -> A_it * 1[H_it >= the (1 - p) quantile of H] (Wang et al. 2025, "Beyond the
                              80/20 Rule"); the normalisers still count every token
    --off_policy_mask delta   a sequence with A_i < 0 and mean_t (log pi_old - log pi) > delta leaves the policy term
                              (DeepSeek-V3.2's off-policy sequence masking; it acts with --num_iterations > 1)
    --ref_sync_steps tau      TR-DPO (Gorbatovski et al. 2024): every tau steps the reference becomes
    --ref_mixup alpha         alpha pi + (1 - alpha) pi_ref, a moving anchor for the KL term
The KL term is beta * mean over tokens of k(d) = kl_penalty(logp, ref_logp, --kl_estimator), d = logp - ref_logp, a
loss term rather than a reward penalty. The default k3 = exp(-d) - 1 + d (DeepSeekMath) estimates KL(pi || pi_ref),
but its gradient as a loss is that of KL(pi_ref || pi) (Tang & Munos 2025); k2 = d^2 / 2 has the gradient of
KL(pi || pi_ref) on-policy; k1 = d is refused (its expected gradient on-policy is zero; it belongs in the reward).
Tasks (--task): next_token (a generated token scores 1 if it equals the true continuation of tiny Shakespeare or
--data), arithmetic (1.0 for the exact answer and a newline; --steps K: K operations evaluated left to right, solved
one step a line, 1.0 for K well-formed lines whose last result is the answer; held out of training iff
zlib.crc32(prompt.encode()) % 10 == 0; --reward_model trains on a learned reward and logs the exact-answer reward
beside it), reasoning (R1-Zero in miniature, docs/r1_zero.md: "Q:<expr>;" answered directly or in worked steps,
1.0 when the last answer is the value, no format reward), reward_model (a reward_model.py checkpoint scores
completions of HH-RLHF prompts).

Where we depart from the papers, on purpose:
  - beta can warm up linearly over --kl_warmup_tokens generated tokens, and the reference is a choice
    (--reference bigram|init|none): a model trained from scratch has no sensible "initial" policy;
  - --dynamic_sampling (DAPO) samples at most --max_sampling_rounds rounds, then tops the batch up with
    zero-advantage groups, so every rank keeps the same batch shape;
  - --mask_truncated (DAPO's overlong filtering) drops completions that never reached the end token from the loss;
  - a model from scratch reads characters (--tokenizer char): over GPT-2's 50,257 tokens a random policy never
    matches the next token, so every next_token group scores alike and the gradient is zero.
The model and the losses are hand-written on purpose: reading them is the point.

Commands:
    python grpo.py                                                        # next_token on tiny Shakespeare, CPU
    python gpt.py --data arithmetic --digits 2 --out_dir out/arith                 # a warm start, then
    python grpo.py --task arithmetic --digits 2 --init_from out/arith/ckpt.pt --loss_type dapo --clip_eps_high 0.28
    python grpo.py --task reward_model --init_from out/sft/ckpt.pt --reward_model out/rm/ckpt.pt --device cuda
    torchrun --standalone --nproc_per_node=8 grpo.py --horizon 70         # 8 GPUs, one process each
"""

import argparse
import copy
import dataclasses
import gzip
import inspect
import json
import math
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

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
    # run: where it starts from and where it writes
    out_dir: str = ""  # run folder; default out/grpo-<YYYYmmdd-HHMMSS>
    init_from: str = "scratch"  # scratch | gpt2 | hub id | Hugging Face folder | ckpt.pt of any script
    resume: bool = False  # continue the run in out_dir from its ckpt.pt

    # task and its data
    task: str = "next_token"  # next_token | arithmetic | reasoning | reward_model
    data: str = "shakespeare"  # next_token: shakespeare (tiny Shakespeare, shipped in data/) or a text file
    data_path: str = ""  # local copy: the tiny Shakespeare text, or HH-RLHF .jsonl/.jsonl.gz for reward_model
    reward_model: str = ""  # reward_model.py's ckpt.pt (A,B,..: an ensemble): learned reward: reward_model, arithmetic
    rm_ensemble: str = "mean"  # --reward_model A,B,..: mean | min (worst case) | uwo (mean - uwo_lambda * variance)
    uwo_lambda: float = 0.5  # uwo's weight on the members' variance (0.5: not tuned here)
    rm_sigmoid: bool = False  # arithmetic: an orm's reward is sigmoid(score) (a prm's and --adv process's always are)
    context_len: int = 32  # next_token: tokens of real text before each rollout
    reward_mode: str = "plus1"  # next_token: plus1 (1 per correct token, else 0) | pm1 (+1 correct, -1 wrong)
    digits: int = 1  # arithmetic: most digits per operand
    ops: str = "+-*"  # arithmetic: operators to draw from
    steps: int = 1  # arithmetic: operations per problem (K), evaluated left to right, solved one step a line
    min_steps: int = 1  # reasoning: fewest operations per problem (the most: --steps)
    format_reward: float = 0.0  # arithmetic: reward of a well-formed answer (ended by a newline) with a wrong result
    max_prompt_len: int = 96  # reward_model: prompt tokens kept (the end of the dialogue)

    # a new model (--init_from scratch)
    tokenizer: str = "char"  # new models only: char (the data's characters) | gpt2 (BPE, for pretrained models)
    n_layer: int = 4  # transformer blocks (scratch only)
    n_head: int = 4  # attention heads (scratch only)
    n_embd: int = 128  # embedding width (scratch only)
    block_size: int = 128  # context length of the model (scratch only)

    # rollouts: B prompts, G completions each, at most --horizon tokens, from the sampling distribution
    batch_size: int = 16  # prompts (groups) per step per rank
    group_size: int = 8  # completions per prompt (G)
    horizon: int = 16  # most tokens per completion
    temperature: float = 1.0  # sampling temperature of rollouts
    top_k: int = 0  # sample rollouts among the k most likely tokens (0: all)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int = 4  # dynamic_sampling: most rollout rounds per step

    # advantages and the policy loss
    adv: str = "auto"  # auto | group | rloo | process (auto: process for next_token, group otherwise)
    scale_rewards: str = "group"  # group advantages: group | batch | none (Dr. GRPO: no std scaling)
    loss_type: str = "grpo"  # grpo | dapo | dr_grpo | gspo | luspo | cispo | reinforce | sapo (the docstring's table)
    clip_eps: float = None  # PPO clip range, lower (and upper unless clip_eps_high is set); unset: 0.2, gspo/luspo 3e-4
    clip_eps_high: float = None  # upper clip range (DAPO's clip-higher: 0.28); unset or 0: clip_eps, gspo 4e-4
    clip_delta: float = 0.0  # grpo, dapo, dr_grpo: cap (> 1 + eps) of the min's unclipped ratio (INTELLECT-2; 0: off)
    sapo_tau_pos: float = 1.0  # sapo: temperature of the soft gate on tokens with A > 0
    sapo_tau_neg: float = 1.05  # sapo: temperature of the soft gate on tokens with A <= 0
    num_iterations: int = 1  # policy updates per batch of rollouts (the ratio uses the sampling policy's log-probs)
    mask_truncated: bool = False  # DAPO: completions without an end token within --horizon leave the loss
    top_entropy_quantile: float = 1.0  # the policy term trains on this top share of tokens by sampling entropy (1: all)
    off_policy_mask: float = 0.0  # num_iterations > 1: A < 0 sequences with mean old_logp - logp > this drop (0: off)
    entropy_coef: float = 0.0  # entropy bonus coefficient

    # KL to a frozen reference (a loss term, not a reward penalty)
    reference: str = "auto"  # auto | bigram | init | none (auto: bigram for scratch next_token, else init)
    beta_kl: float = 0.02  # KL coefficient (0: no KL term; the KL is still logged when there is a reference)
    kl_estimator: str = "k3"  # k2 | k3, the KL term of the loss (k1 is refused: its expected gradient is zero)
    kl_warmup_tokens: int = 0  # beta rises linearly from 0 to beta_kl over this many generated tokens (0: no warm-up)
    ref_sync_steps: int = 0  # TR-DPO: every this many steps the reference moves toward the policy (0: off)
    ref_mixup: float = 0.6  # TR-DPO's alpha: the reference becomes alpha policy + (1 - alpha) reference (0: off)

    # optimisation
    max_steps: int = 200  # optimizer steps (batches of rollouts)
    grad_accum: int = 1  # micro-batches per optimizer step (groups are never split)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 10  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay on matrices
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)

    # evaluation, logging, checkpoints
    eval_every: int = 25  # steps between evaluations
    eval_size: int = 128  # held-out windows or prompts per evaluation; arithmetic: held-out draws, repeats dropped
    log_every: int = 10  # steps between log lines
    save_every: int = 100  # steps between checkpoints (one is always written at the end)
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rlhf-gpt"  # wandb project

    # system
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA if supported)
    compile: bool = False  # torch.compile the training forward and the rollouts' decode step (a CUDA graph on a GPU)
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank)
    deterministic: bool = False  # torch.use_deterministic_algorithms


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: pure functions, tensors in and tensors out. char_grpo.py and rookworld_grpo.py carry copies;
# tests/test_grpo_math.py checks them against hand-derived values and against each other.


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """Outcome advantages of (N,) rewards in contiguous groups: (r - group mean) / (group std + eps), unbiased std.
    scale="batch" divides by the std of the whole batch instead; scale="none" only subtracts the mean (Dr. GRPO)."""
    r = rewards.view(-1, group_size)  # (N/G, G)
    same = (r == r[:, :1]).all(1, keepdim=True)  # no spread: exactly 0 (a float mean can be off by rounding)
    adv = (r - r.mean(1, keepdim=True)).masked_fill(same, 0.0)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.flatten()  # (N,)


def rloo_advantages(rewards, group_size):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each (N,) reward minus the mean of the other G-1 rewards of
    its group, which equals G/(G-1) * (r - group mean)."""
    r = rewards.view(-1, group_size)  # (N/G, G)
    others = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    return (r - others).flatten()  # (N,)


def process_advantages(token_rewards, mask, group_size, eps=1e-4, steps=None):
    """Process supervision (DeepSeekMath 4.1.3): every (N, T) reward is normalised by the mean and unbiased std of
    all real rewards of its group, and the advantage at t is the sum of normalised rewards at positions >= t.
    steps (N, T), 1.0 at the positions that carry a reward (the token that ends each step of a solution): only those
    rewards are normalised and summed, so the zeros between them count for nothing. None: every real token of mask
    carries one (next_token). The advantage is defined on every real token of mask either way."""
    N, T = token_rewards.shape
    if steps is None:
        steps = mask
    r = token_rewards.reshape(-1, group_size * T)  # (N/G, G*T): one row per group
    m = steps.reshape(-1, group_size * T).float()  # 1.0 where a reward is
    count = m.sum(1, keepdim=True)
    mean = (r * m).sum(1, keepdim=True) / count.clamp(min=1)
    std = ((((r - mean) * m) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    same = ((r == r.max(1, keepdim=True).values) | (m == 0)).all(1, keepdim=True)  # no spread: exactly 0
    normed = ((r - mean) / (std + eps) * m).masked_fill(same, 0.0).view(N, T)  # (N, T), 0 where no reward is
    return normed.flip(1).cumsum(1).flip(1) * mask  # (N, T): reversed cumulative sum, zero on padding


def masked_mean(x, mask, num_tokens=None):
    """Mean of x over the positions where mask is 1; num_tokens replaces the count (a global count, when a batch is
    split over micro-batches and ranks, makes the shares sum to the mean of the whole batch)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimators of KL(pi || pi_ref) on tokens sampled from pi (Schulman 2020), d = logp - ref_logp:
    k1 = d (unbiased, can be negative), k2 = d^2 / 2, k3 = exp(-d) - 1 + d (>= 0, unbiased where pi_ref's support
    lies inside pi's: under top-k sampling it reads low by pi_ref's mass outside the kept tokens)."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.expm1(-d) + d  # exp(-d) - 1 + d, without cancellation for small d
    raise ValueError(f"unknown KL estimator {kind!r}")


def policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    loss_type="grpo",
    clip_eps=0.2,
    clip_eps_high=None,
    max_len=None,
    num_seqs=None,
    num_tokens=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    clip_delta=None,
):
    """Policy-gradient loss of (N, T) token log-probs; adv is (N,) per sequence or (N, T) per token. loss_type is
    one of grpo.py's loss table (its module docstring; docs/grpo.md): ratio = exp(logp - old_logp) (old_logp carries
    no gradient), clip_eps_high None means a symmetric clip. clip_delta (grpo, dapo, dr_grpo) caps the unclipped
    ratio in the min, so a token with A < 0 and a huge ratio cannot blow up the loss; None or 0: no cap.
    num_seqs and num_tokens are the global counts when a batch is split over micro-batches or ranks (default:
    this batch's), so the summed micro-batch losses equal the loss of the whole batch. Returns (loss, stats): this
    batch's clip_frac (the terms that a clip or the cap holds, so that they get no gradient) and ratio_mean over its
    real tokens, over its sequences for gspo and luspo (weigh them accordingly)."""
    mask = mask.float()
    N, T = logp.shape
    if num_seqs is None:  # this batch is the whole step
        num_seqs = N
    n = mask.sum().clamp(min=1)  # this batch's real tokens
    if num_tokens is None:
        num_tokens = n
    if clip_eps_high is None:  # a symmetric clip
        clip_eps_high = clip_eps
    adv = adv.reshape(N, -1)  # (N, 1) one advantage per sequence, the same for each of its tokens, or (N, T)
    seq_len = mask.sum(1).clamp(min=1)  # (N,)
    log_ratio = logp - old_logp.detach()  # (N, T)
    if loss_type in ("gspo", "luspo"):
        ratio = ((log_ratio * mask).sum(1) / seq_len).exp()  # (N,)
        seq_adv = (adv * mask).sum(1) / seq_len  # (N,)
        if loss_type == "luspo":  # the term times |o_i| (> 0, so inside the min): no bias towards short sequences
            seq_adv = seq_adv * seq_len
        clipped_ratio = ratio.clamp(1 - clip_eps, 1 + clip_eps_high)
        loss = -torch.min(ratio * seq_adv, clipped_ratio * seq_adv).sum() / num_seqs
        clipped = (clipped_ratio * seq_adv < ratio * seq_adv).float()
        return loss, {"clip_frac": clipped.mean(), "ratio_mean": ratio.mean().detach()}
    ratio = log_ratio.exp()  # (N, T)
    clipped = torch.zeros_like(ratio)  # sapo (a soft gate) and reinforce never clip
    if loss_type in ("grpo", "dapo", "dr_grpo"):
        clipped_ratio = ratio.clamp(1 - clip_eps, 1 + clip_eps_high)  # DAPO's clip-higher when the two differ
        unclipped = ratio.clamp(max=clip_delta) if clip_delta else ratio  # (N, T)
        per_token = -torch.min(unclipped * adv, clipped_ratio * adv)
        clipped = per_token != -ratio * adv  # (N, T) bool: the clip or the cap holds the term
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_tau_pos, sapo_tau_neg).to(adv)  # (N, 1) or (N, T), in adv's dtype
        per_token = -4 / tau * torch.sigmoid(tau * (ratio - 1)) * adv
    elif loss_type == "cispo":
        per_token = -ratio.clamp(max=1 + clip_eps_high).detach() * adv * logp
        clipped = ratio > 1 + clip_eps_high
    elif loss_type == "reinforce":
        per_token = -adv * logp
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    per_token = per_token * mask  # (N, T): 0 on padding
    if loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(1) / seq_len).sum() / num_seqs
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (num_seqs * (max_len or T))
    else:
        loss = per_token.sum() / num_tokens
    # (clipped carries no gradient)
    return loss, {"clip_frac": (clipped * mask).sum() / n, "ratio_mean": (ratio * mask).sum().detach() / n}


def high_entropy_mask(entropy, mask, quantile):
    """(N, T) float: 1.0 on the real tokens whose entropy is at or above the (1 - quantile) quantile of all real
    tokens' entropies, else 0.0 ("Beyond the 80/20 Rule", Wang et al. 2025: the policy gradient of the top 20% of
    tokens by entropy, the "forking" tokens, does the learning). quantile 1 keeps every real token (the 0 quantile is
    their least entropy); without a real token nothing is kept (the quantile of no value is NaN)."""
    real = mask > 0
    threshold = torch.nanquantile(entropy.float().where(real, math.nan), 1 - quantile)  # padding left out as NaN
    return ((entropy >= threshold) & real).float()


def off_policy_mask(adv, logp, old_logp, mask, threshold):
    """(N, 1) float: 0.0 for a sequence whose advantage is negative and whose mean over its real tokens of
    old_logp - logp (a k1 estimate of KL(sampler || policy) per token) exceeds threshold, else 1.0 (DeepSeek-V3.2,
    2025, "Off-Policy Sequence Masking": negative samples far off-policy mislead and destabilise the update, while
    the policy learns most from its own mistakes). adv is (N,) or (N, T): a sequence's sign is that of its sum over
    its real tokens."""
    seq_adv = (adv.reshape(len(mask), -1) * mask).sum(1)  # (N,)
    drift = ((old_logp - logp) * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
    drop = (seq_adv < 0) & (drift > threshold)
    return (~drop).float()[:, None]


@torch.no_grad()
def sync_reference(ref, policy, alpha):
    """TR-DPO's reference update (Gorbatovski et al. 2024), in place: every reference weight becomes
    alpha * policy + (1 - alpha) * ref; alpha = 1 copies the policy (the hard update), 0 leaves ref as it is.
    parameters() lists a tied weight once. Under FSDP2 each policy weight is gathered whole: every rank calls it."""
    for r, p in zip(ref.parameters(), policy.parameters()):
        if hasattr(p, "full_tensor"):  # a DTensor shard of FSDP2
            p = p.full_tensor()
        r.lerp_(p, alpha)  # r + alpha (p - r), exact at alpha = 0 and 1


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: the training step as the algorithm reads (rollout -> reward -> advantage -> loss -> update), then the
# functions it calls, in that order.


def training_step(run, step):
    """One optimizer step, as the algorithm reads: rollouts -> rewards -> advantages -> loss -> update. Returns its
    metrics (docs/grpo.md lists them)."""
    cfg = run.cfg
    rt = run.rt
    G = cfg.group_size
    t0 = time.time()
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    # 1-3. rollouts: G completions per prompt, their log-probs (sampling policy, reference) and rewards
    batch, rounds = sample_batch(run)
    t_rollout = time.time() - t0

    # 4. advantages (N, H), from the task's rewards where they sit
    adv = compute_advantages(
        batch["rewards"], batch["reward_mask"], batch["mask"], run.adv_kind, G, cfg.scale_rewards, rt
    )

    # 5. loss and policy update; the KL coefficient warms up over the first --kl_warmup_tokens generated tokens
    beta = 0.0 if run.ref is None else cfg.beta_kl  # no reference, no KL term
    if cfg.kl_warmup_tokens:
        beta *= min(1.0, run.tokens / cfg.kl_warmup_tokens)
    losses, grad_norm = update_policy(run, batch, adv, beta)
    run.tokens += int(all_reduce(batch["mask"].sum(), rt))
    if cfg.ref_sync_steps and (step + 1) % cfg.ref_sync_steps == 0:  # TR-DPO: the reference follows the policy
        sync_reference(run.ref, run.raw, cfg.ref_mixup)

    sampled = len(rounds) * batch["mask"].numel() * rt.world_size  # token positions sampled, every round and rank
    metrics = {
        **rollout_metrics(run.task, rounds[0], batch, G, rt, run.adv_kind),
        **losses,  # train/loss, rl/pg_loss, rl/kl, rl/entropy, rl/clip_frac, rl/ratio_mean, rl/..._frac
        "rl/beta": beta,
        "rl/sampling_rounds": len(rounds),
        "rl/tokens": run.tokens,
        "train/lr": lr,
        "train/grad_norm": grad_norm.item(),
        "perf/rollout_ms": 1000 * t_rollout,
        "perf/rollout_tokens_per_s": sampled / max(t_rollout, 1e-9),
        "perf/peak_mem_mb": peak_memory_mb(rt),
        "perf/step_ms": 1000 * (time.time() - t0),
    }
    if run.ref is None:
        metrics["rl/kl"] = None  # no reference, no KL
    return metrics


def sample_batch(run):
    """ALGO LOGIC 1-3: a batch of --batch_size groups (collect). --dynamic_sampling (DAPO) samples more rounds until
    every rank has that many groups whose rewards differ, or --max_sampling_rounds were sampled; the batch is then
    the groups with signal in the order sampled, topped up with zero-advantage groups, so every rank keeps the same
    batch shape. Returns (batch, the rounds: collect's batches in the order sampled; the first one's rewards are the
    step's rl/ metrics)."""
    cfg = run.cfg
    G = cfg.group_size
    rounds = []
    while True:
        rounds.append(collect(run.task, run.raw, run.ref, cfg, run.rt, cfg.batch_size))
        if not cfg.dynamic_sampling:
            return rounds[0], rounds
        zero = torch.cat([no_signal(r, run.adv_kind, G, run.rt) for r in rounds])  # (groups so far,)
        # every rank samples as many rounds (FSDP's forward passes are collective)
        short = all_reduce(((~zero).sum() < cfg.batch_size).float(), run.rt, op="max")  # 1.0: a rank is short
        if not short or len(rounds) == cfg.max_sampling_rounds:
            # (B*G,) the rows of the groups with signal first, then the others, each in the order sampled
            rows = torch.argsort(zero.repeat_interleave(G).int(), stable=True)[: cfg.batch_size * G]
            return take_rows(rounds, rows), rounds


# The batch that collect returns, one row per completion: N = n_prompts * G rows, a group's G rows contiguous
# (rows g*G .. g*G+G-1), H = --horizon.
#   key          shape and type         what it holds; what None means
#   prompts      N lists of token ids   the row's prompt, shared by its group's G rows
#   info         N entries              what the row's reward needs (task.sample's): next_token's true continuation,
#                                       arithmetic's answer; None for reward_model
#   completion   (N, H) long            sampled tokens, padded to H (with the end token, or 0)
#   mask         (N, H) float           1.0 on real completion tokens, up to and including the end token
#   truncated    (N,) bool              True: no end token within H. None: the task has no end token (next_token)
#   old_logp     (N, H) float           log-probs under the sampling distribution. None: one update per batch, so
#                                       the training pass's own (detached) stand in
#   ref_logp     (N, H) float           the reference's log-probs (same temperature, every token). None: no reference
#   rewards      (N, H) float           the task's rewards where reward_mask is 1.0, 0 elsewhere
#   reward_mask  (N, H) float           1.0 where a reward sits: the last real token (an outcome reward), every real
#                                       token (next_token), each step's end (arithmetic --adv process)
#   rollout_kl   (N,) float             k1 summed over each completion, sampling policy against the reference, only
#                                       logged. None: the reward is no learned proxy (task.proxy), or no reference
def collect(task, raw, ref, cfg, rt, n_prompts):
    """ALGO LOGIC 1-3: sample prompts and G completions each (groups contiguous), then score them as many rows at a
    time as a training micro-batch holds (score_rows). Returns the batch above. The policy samples in train mode: it
    has no dropout, so train and eval modes compute the same."""
    G = cfg.group_size
    prompts, info = task.sample(n_prompts)
    prompts = [p for p in prompts for _ in range(G)]  # each prompt G times in a row: a group
    info = [x for x in info for _ in range(G)]
    with torch.no_grad(), rt.autocast():
        # (N, H) each; a completion ends at its task.n_ends-th end token (arithmetic --steps K: its K-th newline)
        completion, mask = sample_completions(
            raw, prompts, cfg.horizon, cfg.temperature, cfg.top_k, task.eos_id, rt, n_ends=task.n_ends
        )
        truncated = None  # a task without an end token (next_token)
        if task.eos_id is not None:
            truncated = ((completion == task.eos_id) * mask).sum(1) < task.n_ends  # (N,) not ended within H
        batch = dict(prompts=prompts, info=info, completion=completion, mask=mask, truncated=truncated)
        # the training pass's micro-batches: no pass here is larger
        parts = [
            score_rows(task, raw, ref, cfg, batch, rows, seq, attn)
            for rows, seq, attn in micro_batch_inputs(batch, cfg.grad_accum)
        ]
    batch.update(take_rows(parts, torch.arange(len(prompts))))  # the parts end to end
    return batch


def score_rows(task, raw, ref, cfg, batch, rows, seq, attn):
    """ALGO LOGIC 2-3: collect's scores of the rows (a slice) of its batch, whose seq and attn micro_batch_inputs
    gives: the sampling policy's log-probs (under the sampling distribution) where something reads them, the
    reference's (the same temperature, the whole vocabulary; the bigram answers the model's call) and the task's
    rewards with their reward mask."""
    H = cfg.horizon
    completion = batch["completion"][rows]
    mask = batch["mask"][rows]
    # With one policy update per batch the sampling policy is the policy being trained: its log-probs are the training
    # pass's own, detached, and old_logp is not kept
    keep_old = cfg.num_iterations > 1
    logs_kl = task.proxy and ref is not None  # rl/rollout_kl, the KL of exactly these rollouts, for the metric only
    logp = None  # (n, H) the sampling policy's log-probs, where something reads them
    if keep_old or logs_kl:
        logp = completion_logprobs(raw, seq, attn, H, temperature=cfg.temperature, top_k=cfg.top_k)[0]
    ref_logp = None  # no reference
    if ref is not None:
        ref_logp = completion_logprobs(ref, seq, attn, H, temperature=cfg.temperature)[0]
    rewards, reward_mask = task.rewards(batch["prompts"][rows], completion, mask, batch["info"][rows])
    return dict(
        old_logp=logp if keep_old else None,
        ref_logp=ref_logp,
        rewards=rewards.float(),  # (n, H)
        reward_mask=reward_mask,  # (n, H)
        rollout_kl=((logp - ref_logp) * mask).sum(1) if logs_kl else None,  # (n,)
    )


def micro_batch_inputs(batch, grad_accum):
    """The --grad_accum micro-batches of whole groups that a collected batch is scored in (collect) and trained in
    (update_policy): the same rows, padded alike, so a training pass computes on exactly the shapes that scored them.
    Yields (rows, a slice; seq (n, P+H); attn (n, P+H) or None)."""
    seq, attn = join(batch["prompts"], batch["completion"])  # every row padded to the batch's longest prompt
    n = len(seq) // grad_accum
    for i in range(0, len(seq), n):
        rows = slice(i, i + n)
        yield rows, seq[rows], None if attn is None else attn[rows]


def zero_std_groups(adv, group_size):
    """(N/G,) True for the groups without signal: those whose advantages (N, H) are all equal, which for advantages
    centred on their group (compute_advantages) means all 0, so that the group adds nothing to the policy term."""
    a = adv.reshape(-1, group_size * adv.size(1))  # (N/G, G*H): one row per group
    return (a == a[:, :1]).all(1)


def take_rows(batches, rows):
    """The rows (N,) of collected batches put end to end: tensors indexed, lists picked, None kept."""
    out = dict(batches[0])  # None stays None
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.cat([b[key] for b in batches])[rows]
        elif isinstance(value, list):
            every = [x for b in batches for x in b[key]]
            out[key] = [every[i] for i in rows.tolist()]
    return out


def no_signal(batch, kind, group_size, rt):
    """(N/G,) True for this rank's groups of a collected batch whose advantages (compute_advantages, of this kind)
    are all 0 (zero_std_groups). The scale is left out (none): it never makes an advantage 0."""
    adv = compute_advantages(batch["rewards"], batch["reward_mask"], batch["mask"], kind, group_size, "none", rt)
    return zero_std_groups(adv, group_size)


def compute_advantages(rewards, reward_mask, mask, kind, group_size, scale, rt):
    """ALGO LOGIC 4: this rank's advantages (N, H) of the task's rewards (N, H), which sit where reward_mask is 1.0.
    process: process_advantages normalises the rewards where they sit and sums them from t on. group and rloo: each
    completion's return, the mean of its rewards (an outcome reward: the one on its last token), gets one advantage,
    on every token. Groups never span ranks, but --scale_rewards batch divides by the std of every rank's
    returns: group_advantages runs on all ranks' returns and each rank keeps its own rows."""
    if kind == "process":
        return process_advantages(rewards, mask, group_size, steps=reward_mask)  # (N, H)
    returns = (rewards * reward_mask).sum(1) / reward_mask.sum(1)  # (N,)
    if kind == "rloo":
        adv = rloo_advantages(returns, group_size)
    else:
        every = group_advantages(gather_rows(returns, rt), group_size, scale)  # (world_size * N,): every rank's rows
        adv = every.chunk(rt.world_size)[rt.rank]  # (N,) this rank's rows
    return adv[:, None].expand_as(mask)  # (N, H): the same on every token (the loss masks the padding)


def gather_rows(x, rt):
    """Every rank's x (N, ...) in rank order: (world_size * N, ...); every rank must hold as many rows. Each rank
    writes its rows into zeros and all_reduce sums them, which is exact."""
    out = x.new_zeros(rt.world_size, *x.shape)
    out[rt.rank] = x
    return all_reduce(out, rt).flatten(0, 1)


def update_policy(run, batch, adv, beta):
    """ALGO LOGIC 5: --num_iterations optimizer steps over the same rollouts (old_logp fixed), each over --grad_accum
    micro-batches of whole groups (grpo_loss). Every normaliser counts the whole step (all micro-batches and ranks), so
    the micro-batch losses add up to the step's loss. Returns the last iteration's loss metrics by name, over every
    rank, and its gradient norm."""
    cfg = run.cfg
    rt = run.rt
    mask = batch["mask"]
    if cfg.mask_truncated:  # DAPO's overlong filtering: completions without an end token leave the loss
        mask = mask * ~batch["truncated"][:, None]
    N = len(mask)
    n_seqs = N * rt.world_size  # the whole step's sequences (every rank holds N)
    n_tokens = all_reduce(mask.sum(), rt).clamp(min=1)  # the whole step's tokens: dapo's normaliser
    keep = mask.clone()  # the tokens the policy term trains on: every real token, or the top quantile by entropy
    for iteration in range(cfg.num_iterations):
        sums = 0.0  # this rank's share of each metric (in the order of shares), summed over the micro-batches
        for rows, seq, attn in micro_batch_inputs(batch, cfg.grad_accum):
            grad_sync(run.policy, rows.stop == N)  # the last micro-batch
            with rt.autocast():  # under the sampling distribution, as old_logp
                logp, entropies = completion_logprobs(
                    run.policy,
                    seq,
                    attn,
                    cfg.horizon,
                    entropy=True,
                    temperature=cfg.temperature,
                    top_k=cfg.top_k,  # 0: the whole vocabulary
                )
            # The first iteration's policy is the sampler (no update yet): its entropies are the sampling
            # distribution's, and the mask it gives stays for the later iterations. They are ranked over this
            # micro-batch of every rank (as TRL), and each rank keeps its own rows
            if iteration == 0 and cfg.top_entropy_quantile < 1:
                every_rank = high_entropy_mask(
                    gather_rows(entropies.detach(), rt), gather_rows(mask[rows], rt), cfg.top_entropy_quantile
                )  # (world_size * n, H)
                keep[rows] = every_rank.chunk(rt.world_size)[rt.rank]
            # one update per batch: the policy is the sampler, and its own log-probs (detached) stand in
            old_logp = logp.detach() if batch["old_logp"] is None else batch["old_logp"][rows]
            # without a reference (beta 0) the policy's own log-probs stand in: a KL of zero, with zero gradient
            ref_logp = logp.detach() if batch["ref_logp"] is None else batch["ref_logp"][rows]
            loss, shares = grpo_loss(
                cfg, logp, entropies, old_logp, ref_logp, adv[rows], keep[rows], mask[rows], beta, n_seqs, n_tokens
            )
            run.scaler.scale(loss * rt.world_size).backward()  # DDP averages gradients over ranks
            sums = sums + torch.stack([value.float() for value in shares.values()])
        # unscale (float16), clip, step, zero the gradients
        run.scaler.unscale_(run.optimizer)
        grad_norm = clip_grad_norm(run.policy, cfg.grad_clip)  # before clipping
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad()  # set_to_none, the default
    # each rank's shares are normalised by the whole step's counts: their sum over ranks is the step's value
    totals = all_reduce(sums, rt)  # one collective for them all
    return dict(zip(shares, totals.tolist())), grad_norm


def grpo_loss(cfg, logp, entropies, old_logp, ref_logp, adv, keep, mask, beta, n_seqs, n_tokens):
    """ALGO LOGIC 5: a micro-batch's share of the step's loss, policy_loss + beta * KL term - entropy_coef * entropy
    (each normaliser the whole step's n_seqs or n_tokens), and its share of each logged metric by name (rl/kl: the k1
    estimate, whatever --kl_estimator). --top_entropy_quantile (keep) and --off_policy_mask set the advantage of the
    tokens they drop to 0, as TRL multiplies its per-token loss by their masks. Tensors are (n, H)."""
    # (n, 1): 0.0 drops a sequence too far off-policy with A < 0; --off_policy_mask 0 (off): no threshold
    on_policy = off_policy_mask(adv, logp, old_logp, mask, cfg.off_policy_mask or math.inf)
    # a dropped token's advantage is 0: it leaves the policy term, but the normalisers still count it. The tensors'
    # width is --horizon (completions are padded to it): dr_grpo's constant length L
    pg_loss, stats = policy_loss(
        logp,
        old_logp,
        adv * keep * on_policy,
        mask,
        cfg.loss_type,
        cfg.clip_eps,
        cfg.clip_eps_high,
        num_seqs=n_seqs,
        num_tokens=n_tokens,
        sapo_tau_pos=cfg.sapo_tau_pos,
        sapo_tau_neg=cfg.sapo_tau_neg,
        clip_delta=cfg.clip_delta,
    )
    kl = masked_mean(kl_penalty(logp, ref_logp, cfg.kl_estimator), mask, n_tokens)
    if cfg.entropy_coef <= 0:
        entropies = entropies.detach()  # no bonus: the entropy is only logged
    entropy = masked_mean(entropies, mask, n_tokens)
    loss = pg_loss + beta * kl - cfg.entropy_coef * entropy
    # the stats' part of the step: its tokens, or for gspo and luspo (per-sequence stats) its sequences
    part = mask.sum() / n_tokens
    if cfg.loss_type in ("gspo", "luspo"):
        part = len(mask) / n_seqs
    shares = {  # detached: only logged (stats, keep and on_policy carry no gradient)
        "train/loss": loss.detach(),
        "rl/pg_loss": pg_loss.detach(),
        "rl/kl": masked_mean(logp.detach() - ref_logp, mask, n_tokens),  # k1, whatever --kl_estimator
        "rl/entropy": entropy.detach(),
        "rl/clip_frac": stats["clip_frac"] * part,
        "rl/ratio_mean": stats["ratio_mean"] * part,
        "rl/entropy_mask_frac": masked_mean(keep, mask, n_tokens),  # the real tokens kept
        "rl/off_policy_masked_frac": (1 - on_policy).sum() / n_seqs,
    }
    return loss, shares


def rollout_metrics(task, first, batch, group_size, rt, kind):
    """rl/ metrics of the step's rollouts over every rank's rows (each rank holds as many): rewards (where they sit),
    the task's measures and groups without signal of the first sampling round, lengths of the batch trained on."""
    measures = task.measures(first["completion"], first["mask"], first["info"])  # rl/accuracy, rl/gold_reward

    def mean(x):  # over every rank's rows; a measure the task does not have (None) stays None
        if x is None:
            return None
        return gather_rows(x.float(), rt).mean().item()

    rewards = gather_rows(first["rewards"], rt)[gather_rows(first["reward_mask"], rt) > 0]  # where they sit
    return {
        "rl/reward_mean": rewards.mean().item(),
        "rl/reward_std": rewards.std().item(),
        **{name: mean(x) for name, x in measures.items()},
        "rl/rollout_kl": mean(first["rollout_kl"]),
        "rl/zero_std_frac": mean(no_signal(first, kind, group_size, rt)),
        "rl/completion_len": mean(batch["mask"].sum(1)),
        "rl/truncated_frac": mean(batch["truncated"]),  # None for a task without an end token (next_token)
    }


def peak_memory_mb(rt):
    """Peak memory of the step: CUDA's allocator peak, else the process's peak resident set."""
    if rt.device.type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 2**10


# ----------------------------------------------------------------------------------------------------------
# Setup, evaluation, checkpoints and main()


def validate(cfg):
    """Impossible settings: one line naming the flag, exit code 2, before anything is loaded or written."""
    positive = [
        "horizon",
        "batch_size",
        "max_steps",
        "num_iterations",
        "grad_accum",
        "eval_every",
        "eval_size",
        "log_every",
        "save_every",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "max_sampling_rounds",
        "context_len",
        "max_prompt_len",
        "digits",
        "steps",
        "lr",
        "clip_eps",
        "sapo_tau_pos",
        "sapo_tau_neg",
        "temperature",  # temperature 0 (greedy) would make a group's completions identical
    ]
    for name in positive:
        value = getattr(cfg, name)
        check(value > 0, f"--{name} must be positive (got {value})")
    zero_ok = [
        "beta_kl",
        "kl_warmup_tokens",
        "entropy_coef",
        "clip_eps_high",
        "grad_clip",
        "weight_decay",
        "warmup_steps",
        "top_k",
        "clip_delta",
        "off_policy_mask",
        "ref_sync_steps",
        "uwo_lambda",
    ]
    for name in zero_ok:
        value = getattr(cfg, name)
        check(value >= 0, f"--{name} must be >= 0 (got {value})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    check(cfg.group_size >= 2, f"--group_size {cfg.group_size}: GRPO compares the completions of a group (at least 2)")
    check(cfg.batch_size % cfg.grad_accum == 0, "--batch_size must be a multiple of --grad_accum (groups stay whole)")
    check(cfg.ops and set(cfg.ops) <= set("+-*"), f"--ops {cfg.ops!r}: use operators from +-*")
    check(cfg.n_embd % cfg.n_head == 0, f"--n_embd {cfg.n_embd} must be a multiple of --n_head {cfg.n_head}")
    check(
        0 < cfg.top_entropy_quantile <= 1, f"--top_entropy_quantile must be in (0, 1] (got {cfg.top_entropy_quantile})"
    )
    check(0 <= cfg.ref_mixup <= 1, f"--ref_mixup must be in [0, 1] (got {cfg.ref_mixup})")
    choices = {
        "task": ["next_token", "arithmetic", "reasoning", "reward_model"],
        "rm_ensemble": ["mean", "min", "uwo"],
        "tokenizer": ["gpt2", "char"],
        "reward_mode": ["plus1", "pm1"],
        "adv": ["auto", "group", "rloo", "process"],
        "scale_rewards": ["group", "batch", "none"],
        "kl_estimator": ["k2", "k3"],
        "loss_type": ["grpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "reinforce", "sapo"],
        "reference": ["auto", "bigram", "init", "none"],
    }
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        check(value in allowed, f"--{name} {value!r}: use one of {' '.join(allowed)}")
    # a sequence loss averages the masked advantages over each completion, so the mask would not pick token gradients
    check(
        not (cfg.loss_type in ("gspo", "luspo") and cfg.top_entropy_quantile < 1),
        f"--top_entropy_quantile acts on token losses; --loss_type {cfg.loss_type} averages a sequence's advantages",
    )
    if cfg.clip_delta:
        # the losses with a clipped min, whose unclipped ratio the cap bounds
        check(
            cfg.loss_type in ("grpo", "dapo", "dr_grpo"),
            f"--clip_delta acts on grpo, dapo and dr_grpo, not --loss_type {cfg.loss_type}",
        )
        # at or below the upper clip, a token with A > 0 and a ratio between the two would get no gradient
        upper = 1 + cfg.clip_eps_high  # resolve_clip set it (clip_eps when unset)
        check(
            cfg.clip_delta > upper, f"--clip_delta {cfg.clip_delta:g} must be above the upper clip 1 + eps ({upper:g})"
        )
    # the over-optimisation measures of a learned reward are the KL to the initial policy, which a moving one hides
    check(
        not (cfg.ref_sync_steps and cfg.reward_model),
        "--ref_sync_steps with --reward_model: the over-optimisation measures are the KL to the initial policy",
    )
    check(cfg.steps == 1 or cfg.task in ("arithmetic", "reasoning"), "--steps is for --task arithmetic, reasoning")
    check(1 <= cfg.min_steps <= cfg.steps, f"--min_steps {cfg.min_steps}: from 1 to --steps {cfg.steps}")
    check(
        cfg.task != "reasoning" or cfg.init_from != "scratch",
        "--task reasoning: warm start it (gpt.py --data reasoning)",
    )
    # per-token rewards: next_token's, or a reward model's at each step's end (process_rewards)
    check(
        cfg.adv != "process" or cfg.task == "next_token" or (cfg.task == "arithmetic" and cfg.reward_model),
        "--adv process needs per-token rewards: --task next_token, or arithmetic with a --reward_model",
    )
    check(cfg.reference != "bigram" or cfg.task == "next_token", "--reference bigram needs a text stream (next_token)")
    check(
        not cfg.reward_model or cfg.task in ("arithmetic", "reward_model"), "--reward_model: arithmetic, reward_model"
    )
    check(not (cfg.mask_truncated and cfg.task == "next_token"), "--mask_truncated: next_token rollouts have no end")
    check(
        cfg.rm_ensemble == "mean" or "," in cfg.reward_model,
        f"--rm_ensemble {cfg.rm_ensemble} needs --reward_model A,B,..",
    )
    check(cfg.rm_ensemble == "uwo" or cfg.uwo_lambda == Config.uwo_lambda, "--uwo_lambda needs --rm_ensemble uwo")
    check(
        not cfg.rm_sigmoid or (cfg.reward_model and cfg.task == "arithmetic"),
        "--rm_sigmoid transforms an arithmetic verifier's score (--task arithmetic --reward_model)",
    )
    # process advantages normalise by their group's std, and rloo's need none: --scale_rewards would do nothing
    check(
        cfg.scale_rewards == Config.scale_rewards or advantage_kind(cfg) == "group",
        f"--scale_rewards scales group advantages; --adv {cfg.adv} on {cfg.task} does not read it",
    )


def resolve_clip(cfg):
    """The clip ranges in effect: unset (None), 0.2 and clip_eps, or for gspo and luspo (a sequence ratio) the GSPO
    paper's 3e-4 and 4e-4 (Zheng et al. 2025): a length-normalised sequence ratio stays within 1 +- 0.2 and would never
    clip. --clip_eps_high 0 means clip_eps; a given --clip_eps is gspo's upper range too unless --clip_eps_high is
    given. config.json records the values used, and the losses receive exactly these."""
    paper = cfg.loss_type in ("gspo", "luspo") and cfg.clip_eps is None  # the paper's ranges, unless a range is given
    clip_eps = cfg.clip_eps
    if clip_eps is None:
        clip_eps = 3e-4 if paper else 0.2
    high = cfg.clip_eps_high
    if not high:  # unset or 0: the symmetric clip (gspo's own upper range when neither range is given)
        high = 4e-4 if paper and high is None else clip_eps
    return dataclasses.replace(cfg, clip_eps=clip_eps, clip_eps_high=high)


def advantage_kind(cfg):
    """--adv as it runs: auto is process for next_token's per-token rewards, group otherwise."""
    if cfg.adv == "auto":
        return "process" if cfg.task == "next_token" else "group"
    return cfg.adv


def setup(cfg):
    """Runtime and run folder; the policy and its tokenizer (a resumed run, --init_from, or a new model); the task;
    the frozen reference; optimizer and loss scaler, restored on --resume. Returns the run's state as a namespace."""
    rt = setup_runtime(cfg)
    out_dir = prepare_out_dir(cfg, "grpo", rt)
    stop = GracefulExit()
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    text = None  # next_token's text (path: the file it came from)
    if cfg.task == "next_token":
        path = cfg.data
        if cfg.data == "shakespeare":  # --data_path: a local copy; else data/'s (downloaded there if missing)
            path = cfg.data_path or download(SHAKESPEARE_URL, SHAKESPEARE_PATH)
        text = read_text(path)
    adv_kind = advantage_kind(cfg)
    source = ckpt_path if cfg.resume else cfg.init_from
    if source == "scratch":  # a new model (and no ckpt: only a resumed run, which loads one, reads its state)
        # char: the text's characters, or arithmetic's
        tok = BPETokenizer() if cfg.tokenizer == "gpt2" else CharTokenizer(sorted(set(text or ARITHMETIC_CHARS)))
        model = GPT(GPTConfig(cfg.block_size, tok.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd))  # no dropout
    else:
        model, spec, ckpt = load_model(source)
        tok = get_tokenizer(spec)
    # the longest prompt in tokens: arithmetic's "a*b=" (--steps K: K operations) of the longest numbers; the other
    # tasks set their own
    prompt_len = (cfg.steps + 1) * (cfg.digits + 1)
    if cfg.task == "next_token":
        if isinstance(tok, CharTokenizer):
            unknown = sorted(set(text) - set(tok.chars))
            check(not unknown, f"{path} has characters {''.join(unknown[:10])!r} outside the model's char vocabulary")
        task = NextTokenTask(cfg, tok, text, path)
        prompt_len = cfg.context_len
    elif cfg.task == "arithmetic":
        task = ArithmeticTask(cfg, tok, rt, process=adv_kind == "process")
    elif cfg.task == "reasoning":
        task = ReasoningTask(cfg, tok, rt)
        prompt_len += 2  # "Q:a*b;": arithmetic's problem between "Q:" and ";" instead of before "="
    else:
        task = RewardModelTask(cfg, tok, rt)
        prompt_len = cfg.max_prompt_len
    # the learned reward's weights: a resumed run must be scored by the same ones (a checkpoint written before this
    # check has no checksum, and is refused when a reward model is used)
    rm_checksum = None if task.rm is None else weights_checksum(task.rm)  # an ensemble's: all its members'
    check(
        not cfg.resume or ckpt.get("rm_checksum") == rm_checksum,
        f"--resume: --reward_model {cfg.reward_model!r} is not the reward model the run was trained on",
    )
    longest = prompt_len + cfg.horizon
    check(
        longest <= model.config.block_size,
        f"prompts + --horizon ({longest}) exceed block_size {model.config.block_size}",
    )
    model.to(rt.device)
    reference = cfg.reference
    if reference == "auto":  # a model trained from scratch on text has no sensible initial policy
        reference = "bigram" if cfg.task == "next_token" and cfg.init_from == "scratch" else "init"

    # frozen reference: never wrapped, never trained; a copy of rank 0's starting weights on every rank
    broadcast_weights(model, rt)
    ref = None
    if reference == "bigram":
        ref = BigramReference(task.train_ids.to(rt.device), model.config.vocab_size)
    elif reference == "init":
        ref = copy.deepcopy(model)  # the starting weights (a resumed run's: its policy's, until the next line)
        if cfg.resume and ckpt["reference"]:  # as it was saved (--ref_sync_steps moves it); older runs: None
            ref.load_state_dict(ckpt["reference"])
        ref.to(rt.device).eval().requires_grad_(False)
    check(not cfg.ref_sync_steps or isinstance(ref, GPT), "--ref_sync_steps: use --reference init")

    policy = wrap_model(model, rt, cfg.compile)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, (0.9, 0.99), rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    run = SimpleNamespace(
        cfg=cfg,
        rt=rt,
        out_dir=out_dir,
        ckpt_path=ckpt_path,
        stop=stop,
        tok=tok,
        task=task,
        raw=model,  # the policy itself; policy is its wrapper (DDP, FSDP, compiled) for the training passes
        ref=ref,
        policy=policy,
        optimizer=optimizer,
        scaler=scaler,
        adv_kind=adv_kind,
        rm_checksum=rm_checksum,
        start_step=0,
        tokens=0,
        first_eval=None,
    )
    if cfg.resume:  # (a ckpt.pt given to --init_from gives its weights, not its state)
        load_optimizer_state(model, optimizer, ckpt["optimizer"], rt)
        # float16 runs' loss scale and growth tracker; a checkpoint without one (older, or another dtype) keeps the new
        scaler.load_state_dict(ckpt.get("scaler") or scaler.state_dict())
        restore_rng(ckpt, rt)
        run.start_step = ckpt["step"]
        run.tokens = ckpt["tokens"]
        run.first_eval = ckpt["first_eval"]
    if rt.master:
        details = f"vocab {tok.vocab_size}, {cfg.task}, loss {cfg.loss_type}, adv {adv_kind}, ref {reference}"
        print_start(model, rt, out_dir, details)
    return run


def evaluate_policy(run, step, logger):
    """The task's evaluation of the policy, logged, and its samples appended to samples.txt. The policy stays in
    train mode: it has no dropout, so both modes compute the same."""
    metrics, text = run.task.evaluate(run.raw, run.ref, run.rt, run.tok, step)  # the bigram: next_token's, unread
    if run.first_eval is None:  # the evaluation before training, for final_results.json
        run.first_eval = metrics
    logger.log(step, {**metrics, "rl/tokens": run.tokens})
    if run.rt.master:
        with open(os.path.join(run.out_dir, "samples.txt"), "a") as f:
            f.write(f"--- step {step}\n{text}\n")
    return metrics


def weights_checksum(model):
    """A fingerprint of a model's weights: the sum of every entry of its state dict, in float64 on the CPU (the same
    on every device). A run saves it in ckpt.pt, and a resumed run compares it with its own model's."""
    return float(sum(v.cpu().double().sum() for v in model.state_dict().values()))


def save(run, step):
    """ckpt.pt (the format every script shares) and this script's extras: tokens generated, the first evaluation,
    the reference when a resume cannot rebuild it (init's weights, or as --ref_sync_steps left it)."""
    model_sd, optim_sd = training_state(run.raw, run.optimizer, run.rt)
    rngs = all_rng_states(run.rt)
    if run.rt.master:
        ckpt = {
            "model": model_sd,
            "model_config": dataclasses.asdict(run.raw.config),
            "tokenizer": run.tok.spec,
            "step": step,
            "optimizer": optim_sd,
            "rng": rngs[0],
            "rng_ranks": rngs,
            "config": dataclasses.asdict(run.cfg),
            "scaler": run.scaler.state_dict(),
            "tokens": run.tokens,
            "first_eval": run.first_eval,
            "reference": run.ref.state_dict() if isinstance(run.ref, GPT) else None,  # as it is now: synced or not
            "rm_checksum": run.rm_checksum,  # a resume checks --reward_model against it
        }
        save_checkpoint(run.ckpt_path, ckpt)


def write_results(run, last_eval, wall_time_s):
    """final_results.json (the evaluation before and after training) and one summary line."""
    cfg = run.cfg
    results = {
        "task": cfg.task,
        "loss_type": cfg.loss_type,
        "adv": run.adv_kind,
        "steps": cfg.max_steps,
        "tokens": run.tokens,
        "wall_time_s": wall_time_s,
    }
    for name, metrics in (("before", run.first_eval), ("after", last_eval)):
        results[name] = {k.removeprefix("eval/"): v for k, v in metrics.items()}  # eval/accuracy: accuracy
    with open(os.path.join(run.out_dir, "final_results.json"), "w") as f:
        json.dump(results, f, indent=2)
    summary = ", ".join(f"{k} {results['before'][k]:.4g} -> {v:.4g}" for k, v in results["after"].items())
    print_end(f"{cfg.task} ({cfg.loss_type}): {summary}", run.out_dir, wall_time_s)


def main():
    """The run: evaluate every --eval_every steps, train, log and checkpoint; evaluate and save at the end."""
    cfg = resolve_clip(parse_config(Config))
    validate(cfg)
    run = setup(cfg)
    rt = run.rt
    save_config(cfg, run.out_dir, rt)  # every input is checked: from here on the run folder is written
    logger = Logger(cfg, run.out_dir, rt, cfg.max_steps, run.start_step)
    t_start = time.time()
    for step in range(run.start_step, cfg.max_steps):
        if step % cfg.eval_every == 0:
            evaluate_policy(run, step, logger)
        metrics = training_step(run, step)
        stop_requested = run.stop.requested(step + 1, rt)
        stop_if_not_finite(metrics["train/loss"], step, run.ckpt_path, rt)
        logger.bar.update(1)
        logger.bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}")
        logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested:
            save(run, step + 1)
        if stop_requested:
            run.stop.exit(step + 1, run.out_dir, rt)
    last_eval = evaluate_policy(run, cfg.max_steps, logger)
    save(run, cfg.max_steps)
    logger.close()
    if rt.master:
        write_results(run, last_eval, time.time() - t_start)
    cleanup(rt)


# ----------------------------------------------------------------------------------------------------------
# Tasks, behind one contract: the training step reads nothing else of a task. A task has
#   eos_id        the token that ends a completion (None: rollouts run the whole horizon)
#   n_ends        a completion ends at its n_ends-th end token (arithmetic --steps K: one step a line)
#   proxy         its reward is a learned stand-in for a gold one that it measures too (rl/gold_reward): the
#                 rollouts' KL to the reference is logged beside it (rl/rollout_kl)
#   sample(n)                                         -> n prompts (token-id lists) and a list of what each
#                                                        one's reward needs
#   rewards(prompts, completion, mask, info)          -> rewards (N, H) and reward_mask (N, H), 1.0 where a reward
#                                                        sits: an outcome reward on the last real token
#                                                        (at_last_token), a dense one on every token, a process
#                                                        reward at each step's end
#   measures(completion, mask, info)                  -> {metric: (N,)}, what it measures of the rollouts beside
#                                                        the reward (rl/accuracy, rl/gold_reward)
#   evaluate(model, ref, rt, tok, step)               -> (eval/ metrics, text for samples.txt)
# docs/grpo.md ("Your own task") writes a new one in one class. grpo.py is this block's source; ppo.py carries a
# verbatim copy (tests/test_shared_blocks.py).
# ----- BEGIN SHARED BLOCK: tasks (grpo.py is its source, ppo.py its copy; tests/test_shared_blocks.py) -----
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# tiny Shakespeare ships with the repository (data/ beside the scripts); a script forked alone downloads it there
SHAKESPEARE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")


def sample_completions(model, prompts, horizon, temperature, top_k, eos_id, rt, generator=None, n_ends=1):
    """Completions (N, horizon) and their mask (1.0 up to and including the end token), padded to the horizon. A
    completion ends at its n_ends-th end token (arithmetic --steps K: the K-th newline, one step a line). generate()
    stops at the first end token, and under FSDP every forward pass is collective, so ranks cannot stop early at
    different steps: for K > 1 or under FSDP the whole horizon is sampled and the mask is cut after that end token."""
    whole = n_ends > 1 or (rt.distributed and rt.parallel == "fsdp")
    ends = None if whole else eos_id  # generate() stops at the first one
    tokens, mask = generate(model, prompts, horizon, temperature, top_k, ends, generator, decode=rt.decode)
    if whole and eos_id is not None:
        is_end = (tokens == eos_id).float()
        mask = ((is_end.cumsum(1) - is_end) < n_ends).float()  # (N, H): up to the n_ends-th end token
    pad = (0, horizon - tokens.size(1))  # an early stop (only at an end token): fill up to the horizon (eos, masked)
    return F.pad(tokens, pad, value=eos_id), F.pad(mask, pad)


def completion_logprobs(model, seq, attn, H, entropy=False, temperature=1.0, top_k=None):
    """log p of the last H tokens of seq (N, P+H) given what precedes them, and with entropy=True the entropy at
    each of those positions (else None): (N, H), (N, H), under softmax(logits / temperature) restricted to the top_k
    logits (the sampling distribution). The logits stay inside the model's linear_logprobs. A model that returns more
    (ppo.py's PolicyWithValueHead: its values (N, H), read at the same positions) returns it too."""
    return model(
        seq[:, :-1],
        targets=seq[:, -H:],
        attention_mask=None if attn is None else attn[:, :-1],
        keep_last=H,
        output="logprobs",
        entropy=entropy,
        temperature=temperature,
        top_k=top_k,
    )


def completion_kl(model, ref, prompts, completion, mask, temperature=1.0, top_k=None):
    """(N,) k1 summed over each completion's real tokens, the model under its sampling distribution against the
    reference at the same temperature over every token: an unbiased estimate of the sequence KL. No reference: 0."""
    seq, attn = join(prompts, completion)
    H = completion.size(1)
    logp = completion_logprobs(model, seq, attn, H, temperature=temperature, top_k=top_k)[0]  # (N, H)
    # no reference: a KL of zero
    ref_logp = logp if ref is None else completion_logprobs(ref, seq, attn, H, temperature=temperature)[0]
    return ((logp - ref_logp) * mask).sum(1)


def join(prompts, completion):
    """Left-padded prompts followed by the completions: ids (N, P+H) and the attention mask (None when no row is
    padded, which keeps plain causal attention)."""
    idx, attn = left_pad(prompts, completion.device)
    seq = torch.cat([idx, completion], 1)  # (N, P+H)
    attn = torch.cat([attn, torch.ones_like(completion, dtype=torch.bool)], 1)  # (N, P+H)
    return seq, None if attn.all() else attn


class NextTokenTask:
    """Real text: a prompt is --context_len tokens of the train split, its reward compares each generated token with
    the true continuation at the same offset."""

    eos_id = None  # rollouts always run the whole horizon
    n_ends = 1
    proxy = False  # the true text scores
    rm = None

    def __init__(self, cfg, tok, text, path):
        self.cfg = cfg
        ids = torch.tensor(tok.encode(text))
        self.train_ids, val_ids = ids.tensor_split([int(0.9 * len(ids))])  # 90% to train, 10% to evaluate
        C = cfg.context_len
        H = cfg.horizon
        for name, split in (("train", self.train_ids), ("val", val_ids)):
            check(len(split) > C + H, f"the {name} split of {path} has {len(split)} tokens; it needs > {C + H}")
        with torch.random.fork_rng(devices=[]):  # fixed evaluation windows, without touching the training streams
            torch.manual_seed(0)
            self.eval_windows = torch.cat(sample_windows(val_ids, cfg.eval_size, C, H), 1)  # (E, C+H)

    def sample(self, n):
        ctx, truth = sample_windows(self.train_ids, n, self.cfg.context_len, self.cfg.horizon)
        return ctx.tolist(), list(truth)  # prompts, and each one's true continuation (H,)

    def rewards(self, prompts, completion, mask, truth):
        """A dense reward on every token (N, H); truth: N true continuations."""
        truth = torch.stack(truth).to(completion.device)  # (N, H)
        return token_rewards(completion, truth, self.cfg.reward_mode), mask

    def measures(self, completion, mask, truth):
        truth = torch.stack(truth).to(completion.device)  # (N, H)
        return {"rl/accuracy": (completion == truth).float().mean(1)}  # the share of tokens right

    @torch.no_grad()
    def evaluate(self, model, ref, rt, tok, step):
        C = self.cfg.context_len
        x = self.eval_windows.to(rt.device)  # (E, C+H): each context and its true continuation
        with rt.autocast():
            logits = model(x[:, :-1])[0].float()  # (E, C+H-1, V)
            greedy, _ = generate(model, x[:, :C], self.cfg.horizon, temperature=0)
        metrics = {
            # teacher-forced: the argmax is the next token
            "eval/next_token_acc": (logits.argmax(-1) == x[:, 1:]).float().mean().item(),
            "eval/val_loss": F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item(),
            # free-running: greedy tokens equal to the truth at their offset
            "eval/greedy_match": (greedy == x[:, C:]).float().mean().item(),
        }
        return metrics, f"{tok.decode(x[0, :C].tolist())}|{tok.decode(greedy[0].tolist())}"


def sample_windows(ids, n, context_len, horizon):
    """n random windows of the stream: contexts (n, context_len) and their true continuations (n, horizon)."""
    ix = torch.randint(len(ids) - context_len - horizon + 1, (n,))
    windows = torch.stack([ids[i : i + context_len + horizon] for i in ix])  # (n, C+H)
    return windows[:, :context_len], windows[:, context_len:]


def token_rewards(completion, truth, mode="plus1", logp_true=None, partial_logprob=0.0):
    """Dense rewards (N, H): each generated token against the true continuation at the same offset. plus1 gives 1
    where they are equal, else 0; pm1 gives +1 / -1; partial credit adds partial_logprob * log p(true token | rollout
    prefix) (detached)."""
    match = (completion == truth).float()  # (N, H)
    rewards = match if mode == "plus1" else 2 * match - 1
    if partial_logprob:
        rewards = rewards + partial_logprob * logp_true.detach().float()
    return rewards


class BigramReference:
    """Add-one-smoothed bigram model of a token stream, log p(b | a) = log((count(a, b) + 1) / (count(a) + V)).
    Kept sparse, as sorted pair keys a * V + b: a dense table over GPT-2's 50,257 tokens would need 10 GB."""

    def __init__(self, ids, vocab_size):
        self.vocab_size = vocab_size
        self.keys, counts = torch.unique(ids[:-1] * vocab_size + ids[1:], return_counts=True)  # sorted
        self.pair_counts = counts.float()
        self.prev_counts = torch.bincount(ids[:-1], minlength=vocab_size).float()

    def __call__(self, idx, targets, attention_mask=None, **sampling):
        """log p(targets | the token before each) and no entropy (None), as the model's log-prob call answers
        (completion_logprobs): the bigram serves as a reference model. The tokens before the targets (B, H) are the
        last H of idx (B, T), or idx broadcast against them (chars[:, None] and chars[None, :]: the whole table); the
        mask and the sampling arguments do not apply to a bigram."""
        prev = idx[:, -targets.size(1) :]
        key = prev * self.vocab_size + targets
        i = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)
        count = self.pair_counts[i] * (self.keys[i] == key)  # 0 for a pair never seen
        return torch.log((count + 1) / (self.prev_counts[prev] + self.vocab_size)), None


ARITHMETIC_CHARS = "\n*+-0123456789="  # the char vocabulary of `gpt.py --data arithmetic --tokenizer char`


class ArithmeticTask:
    """Generated problems; the gold reward checks the decoded answer (arithmetic_reward). With --reward_model, a
    learned reward model (reward_model.py --task orm or prm) scores prompt + completion instead, and the gold reward
    is only measured: RLHF with a known gold reward, where over-optimisation of the proxy can be watched. Training
    draws no held-out problem, and every evaluation uses held-out problems only (held_out)."""

    def __init__(self, cfg, tok, rt, process=False):
        self.cfg = cfg
        self.tok = tok
        newline = tok.encode("\n")
        check(len(newline) == 1, "the arithmetic task needs a tokenizer with a single newline token")
        self.eos_id = newline[0]
        self.n_ends = cfg.steps  # one step a line
        self.process = process  # the reward model's reward at each step's end (grpo.py --adv process)
        if cfg.init_from == "scratch" and rt.master:  # every answer wrong, every reward alike: nothing to learn from
            print("a model from scratch cannot do arithmetic (rl/zero_std_frac 1 at step 0): warm start it with gpt.py")
        self.eval_problems = held_out_problems(cfg.digits, cfg.ops, cfg.eval_size, cfg.steps)
        self.rm = None
        if cfg.reward_model:  # a learned reward; the gold one is only measured
            # the longest prompt, the completion and a newline after it (process_rewards)
            longest = (cfg.steps + 1) * (cfg.digits + 1) + cfg.horizon + 1
            self.rm, self.rm_task = frozen_reward_model(cfg, tok, rt, longest)
            check(
                self.rm_task in ("orm", "prm"),
                f"--reward_model {cfg.reward_model} is a {self.rm_task} model; use an orm or prm",
            )
        self.proxy = self.rm is not None

    def sample(self, n):
        return self.encode([self.draw() for _ in range(n)])

    def encode(self, problems):
        """Problems (prompt, answer) as prompts (token-id lists) and what each one's reward needs: its answer."""
        return [self.tok.encode(p) for p, _ in problems], [a for _, a in problems]

    def draw(self):
        """One training problem (prompt, answer): never a held-out one."""
        return draw_problem(random, self.cfg.digits, self.cfg.ops, False, self.cfg.steps)

    def texts(self, completion, mask):
        return [self.tok.decode(t[m > 0].tolist()) for t, m in zip(completion.cpu(), mask.cpu())]

    def gold(self, completion, mask, answers):
        """Gold rewards (N,): reward() of each decoded completion."""
        r = [self.reward(t, a) for t, a in zip(self.texts(completion, mask), answers)]
        return torch.tensor(r, device=completion.device)  # (N,)

    def reward(self, text, answer):
        """The gold reward of one decoded completion: arithmetic_reward, with --format_reward."""
        return arithmetic_reward(text, answer, self.cfg.format_reward)

    def rewards(self, prompts, completion, mask, answers):
        """Process rewards, the reward model's at each step's end (process_rewards), or score()'s outcome reward on
        the last real token: (N, H) each, rewards and their reward mask."""
        if self.process:
            return process_rewards(self.rm, prompts, completion, mask, self.eos_id)
        return at_last_token(self.score(prompts, completion, mask, answers), mask)

    def score(self, prompts, completion, mask, answers):
        """(N,) the gold rewards, or with --reward_model the learned one (the proxy): an orm's score at the last real
        token (--rm_sigmoid: its sigmoid, the probability of a right answer); a prm's product of its steps'
        probabilities, P(every step right)."""
        if self.rm is None:
            return self.gold(completion, mask, answers)
        if self.rm_task == "prm":
            p, steps = process_rewards(self.rm, prompts, completion, mask, self.eos_id)  # (N, H), 0 off the step ends
            return (p + 1 - steps).prod(1)  # the product of p over the step ends (1 elsewhere)
        scores = reward_model_scores(self.rm, prompts, completion, mask)
        return torch.sigmoid(scores) if self.cfg.rm_sigmoid else scores

    def measures(self, completion, mask, answers):
        gold = self.gold(completion, mask, answers)  # (N,)
        measures = {"rl/accuracy": (gold == 1.0).float()}
        if self.proxy:  # the gold reward beside the proxy's
            measures["rl/gold_reward"] = gold
        return measures

    @torch.no_grad()
    def evaluate(self, model, ref, rt, tok, step):
        """eval/ metrics of the greedy answers to the held-out problems; with a --reward_model, of sampled ones too."""
        _, completion, mask, exact = self.answer(model, rt, 1, 0.0)  # greedy
        texts = self.texts(completion, mask)
        # well formed: any reward under a format reward of 1 (arithmetic_reward's form, whatever the result)
        well_formed = sum(arithmetic_reward(t, a, 1.0) > 0 for t, (_, a) in zip(texts, self.eval_problems))
        shown = [f"{p}{t!r} (answer {a.split('=')[-1].strip()})" for (p, a), t in zip(self.eval_problems[:8], texts)]
        metrics = {
            "eval/accuracy": exact.mean().item(),
            "eval/format_rate": well_formed / len(texts),
            "eval/n_problems": len(texts),  # distinct held-out problems
        }
        if self.cfg.steps > 1:  # how right the steps of the same greedy answers are
            metrics.update(step_metrics(self.eval_problems, texts, exact))
        if ref is not None and (self.proxy or self.cfg.steps > 1):
            # four answers a problem sampled as in training (temperature 1): gold, proxy and KL to the reference on
            # the held-out problems, the axes of over-optimisation; gold on each half of the problems too (even and odd
            # places), to pick a peak on one half and report it on the other. With --steps K > 1 a gold-reward run
            # measures them too, so that its curve shares the KL axis of the runs on a process or outcome model
            prompts, completion, mask, exact = self.answer(model, rt, 4, 1.0)
            per_problem = exact.view(-1, 4).mean(1)  # (E,)
            metrics["eval/sample_accuracy"] = exact.mean().item()
            metrics["eval/sample_accuracy_a"] = per_problem[0::2].mean().item()
            metrics["eval/sample_accuracy_b"] = per_problem[1::2].mean().item()
            if self.proxy:
                metrics["eval/sample_rm_score"] = self.score(prompts, completion, mask, None).mean().item()
            metrics["eval/sample_kl"] = completion_kl(model, ref, prompts, completion, mask).mean().item()
        return metrics, "\n".join(shown)

    def answer(self, model, rt, n, temperature):
        """n answers of the model to each evaluation problem, in a row, at this temperature (0: greedy) over the whole
        vocabulary, with sampling noise of their own: (prompts, completion, mask, exact), a row per answer, exact 1.0
        for an exact answer."""
        rows = [problem for problem in self.eval_problems for _ in range(n)]  # n rows a problem, in a row
        prompts, answers = self.encode(rows)
        gen = torch.Generator(rt.device).manual_seed(0)  # the training streams stay as they were
        with rt.autocast():
            completion, mask = sample_completions(
                model, prompts, self.cfg.horizon, temperature, None, self.eos_id, rt, gen, n_ends=self.n_ends
            )
        return prompts, completion, mask, (self.gold(completion, mask, answers) == 1.0).float()


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


def step_correct(prompt, solution):
    """One bool per line of a written solution to an arithmetic prompt: a step is right when it is the prompt's next
    operation applied to the previous step's result (the first: the prompt's first operation), written as
    arithmetic_problem writes it ("x op y=r", or the result alone for a one-operation prompt) with its result right,
    and every step before it is right. So a right final answer reached through a wrong step is wrong, and so is right
    arithmetic that does not continue the chain; a line past the last operation is wrong."""
    x = int(re.match(r"\d+", prompt).group())
    operations = re.findall(r"([-+*])(\d+)", prompt)  # each operation's operator and number, in order
    right = []  # each written step's
    for line in solution.splitlines():
        if len(right) == len(operations):  # no operation left
            right.append(False)
            continue
        op, y = operations[len(right)]
        result = operate(x, op, int(y))
        step = f"{x}{op}{y}={result}" if len(operations) > 1 else f"{result}"
        right.append(line == step and all(right))
        x = result
    return right


def step_metrics(problems, texts, exact):
    """--steps K > 1 (the arithmetic task): eval/step_accuracy_right, the mean over the answers to the problems
    (prompt, answer) whose final result is exact ((E,) 1.0) of the share of their lines step_correct judges right,
    and eval/step_accuracy_wrong, the same over the other answers that have a line (nan where there is no such
    answer). A right result reached through a wrong step is what an outcome reward cannot tell apart."""
    judged = [step_correct(prompt, text) for (prompt, _), text in zip(problems, texts)]
    share = torch.tensor([sum(j) / len(j) if j else math.nan for j in judged])  # (E,) right lines; nan: no line
    right = exact.cpu() > 0  # (E,) the final result is exact (an exact answer has K lines)
    return {
        "eval/step_accuracy_right": share[right].mean().item(),  # the mean of none is nan
        "eval/step_accuracy_wrong": share[~right].nanmean().item(),  # over the answers that have a line
    }


class RewardModelTask:
    """HH-RLHF prompts; a reward_model.py checkpoint scores prompt + completion at its last real token."""

    n_ends = 1
    proxy = False  # no gold reward to measure

    def __init__(self, cfg, tok, rt):
        self.cfg = cfg
        self.tok = tok
        self.eos_id = tok.eot_id
        check(cfg.reward_model, "--task reward_model needs --reward_model PATH (a ckpt.pt of reward_model.py)")
        self.rm, _ = frozen_reward_model(cfg, tok, rt, cfg.max_prompt_len + cfg.horizon)
        if cfg.data_path:
            records = read_jsonl(cfg.data_path, ["chosen"])
            chosen = [r["chosen"] for r in random.Random(0).sample(records, len(records))]  # shuffled
            n_val = max(1, len(records) // 20)  # gpt.py's hh_sft split
            parts = [chosen[n_val:], chosen[:n_val]]
        else:
            try:  # offline, set HF_HUB_OFFLINE=1: datasets otherwise retries the hub for about a minute first
                import datasets

                hub = datasets.load_dataset("Anthropic/hh-rlhf")
                parts = [hub["train"]["chosen"], hub["test"]["chosen"]]
            except Exception as e:
                die(f"cannot load Anthropic/hh-rlhf from the hub ({type(e).__name__}); pass --data_path FILE.jsonl.gz")
        self.train_prompts, val_prompts = map(self.encode_prompts, parts)
        check(self.train_prompts and val_prompts, "no HH-RLHF dialogue with an Assistant turn in the data")
        self.eval_set = val_prompts[: cfg.eval_size]

    def encode_prompts(self, texts):
        """The prompts of the dialogues that have an Assistant turn, as token ids: their last --max_prompt_len."""
        pairs = map(split_hh, texts)  # (prompt, response) or None
        return [self.tok.encode(pair[0])[-self.cfg.max_prompt_len :] for pair in pairs if pair is not None]

    def sample(self, n):
        return [random.choice(self.train_prompts) for _ in range(n)], [None] * n  # the reward reads the text alone

    def rewards(self, prompts, completion, mask, info):
        return at_last_token(reward_model_scores(self.rm, prompts, completion, mask), mask)

    def measures(self, completion, mask, info):
        return {}  # no gold reward: nothing to measure

    @torch.no_grad()
    def evaluate(self, model, ref, rt, tok, step):
        prompts = self.eval_set
        gen = torch.Generator(rt.device).manual_seed(0)  # the same sampling noise at every evaluation
        # the sampling distribution (temperature, top_k); the reference at the same temperature over every token
        T = self.cfg.temperature
        top_k = self.cfg.top_k  # 0: the whole vocabulary
        with rt.autocast():
            completion, mask = sample_completions(model, prompts, self.cfg.horizon, T, top_k, self.eos_id, rt, gen)
            scores = reward_model_scores(self.rm, prompts, completion, mask)
            kl = completion_kl(model, ref, prompts, completion, mask, T, top_k)  # (E,)
        shown = [  # the first four
            f"{tok.decode(p[-40:])}|{tok.decode(t[m > 0].tolist())} (score {s:.3f})"
            for p, t, m, s in zip(prompts[:4], completion.cpu(), mask.cpu(), scores.tolist())
        ]
        metrics = {
            "eval/rm_score": scores.mean().item(),
            "eval/completion_kl": kl.mean().item(),
            "eval/completion_len": mask.sum(1).mean().item(),
        }
        return metrics, "\n\n".join(shown)


def split_hh(text):
    """An HH-RLHF dialogue as (prompt, response): the prompt runs through the last "\\n\\nAssistant:", the response is
    that final Assistant turn. None when there is no Assistant turn or its response is blank."""
    before, turn, response = text.rpartition("\n\nAssistant:")  # turn: "" when there is none
    if not turn or not response.strip():
        return None
    return before + turn, response


class RewardModel(nn.Module):
    """A GPT body and a scalar head on its final hidden states."""

    def __init__(self, config):
        super().__init__()
        self.body = GPT(config)
        self.head = nn.Linear(config.n_embd, 1)

    def forward(self, idx, attention_mask=None):  # (B, T) -> (B, T) float32 score at every position
        h, _ = self.body(idx, attention_mask=attention_mask, output="hidden")
        return self.head(h).squeeze(-1).float()


def load_reward_model(path):
    """A trained reward model from its ckpt.pt, frozen and in eval mode: (RewardModel, tokenizer spec, task)."""
    ckpt = load_checkpoint(path)
    check("reward_head" in ckpt, f"{path} has no reward head: it is a policy checkpoint, not a reward model")
    model = RewardModel(GPTConfig(**ckpt["model_config"]))
    model.body.load_state_dict(ckpt["model"])
    model.head.load_state_dict(ckpt["reward_head"])
    return model.eval().requires_grad_(False), ckpt["tokenizer"], ckpt.get("reward_task", "preference")


@torch.no_grad()
def reward_model_scores(rm, prompts, completion, mask):
    """Reward model scores (N,) of prompt + completion (its real tokens), left-padded: the last token's score."""
    rows = [p + t[m > 0].tolist() for p, t, m in zip(prompts, completion.cpu(), mask.cpu())]
    return rm(*left_pad(rows, completion.device))[:, -1]  # (N,)


def process_rewards(rm, prompts, completion, mask, eos_id):
    """A reward model's step rewards as the contract's per-token rewards, with their reward mask, (N, H) each: at the
    token that ends each step of a completion (step_ends: the reward mask, 1.0 there) the sigmoid of its score at the
    step's newline (eos_id), 0 at every other position. A step cut off at the horizon is scored at a newline put after
    it, where reward_model.py trains and best-of-n scores such a step. A prm (reward_model.py --task prm) gives its
    probability that the step is right if the steps before it are; an orm, trained on the outcome label at every
    answer token, its probability that the answer will end right (an outcome-supervised value: Uesato et al. 2022,
    arXiv 2211.14275). A completion follows its left-padded prompt whole: the model is causal, so what comes after a
    completion's last real token changes no score up to it."""
    steps = step_ends(completion, mask, eos_id)  # (N, H)
    cut_off = steps * (completion != eos_id)  # (N, H) 1.0 at the last real token of a step without its newline
    # (N, H+1): a newline after the last position. A step cut off before its newline ends at the horizon, or (in a
    # completion padded, as sample_completions pads it, with the newline) before padding: its newline is next
    written = F.pad(completion, (0, 1), value=eos_id)
    # (N, H+1) the score at each completion position and one after, the prompt (N, P) before them
    scores = rm(*join(prompts, written))[:, -written.size(1) :]
    at_end = torch.where(cut_off > 0, scores[:, 1:], scores[:, :-1])  # (N, H) the score at each step's newline
    return torch.sigmoid(at_end) * steps, steps


def at_last_token(rewards, mask):
    """Outcome rewards (N,) as the contract's per-token rewards: each on its completion's last real token (the end
    token when there is one), with that reward mask; (N, H) each. mask is 1.0 on the real tokens, a prefix of each
    row."""
    last = mask - F.pad(mask[:, 1:], (0, 1))  # (N, H) 1.0 where each row's mask ends
    return rewards[:, None] * last, last


def step_ends(completion, mask, eos_id):
    """(N, H) 1.0 at the token that ends each step of a completion, else 0: each newline (eos_id) among its real
    tokens, and the last real token of a completion cut off before its final newline (a partial last step). mask is
    1.0 on the real tokens, a prefix of each row (as sample_completions gives it)."""
    newlines = (completion == eos_id) * mask  # (N, H) the newline after each line
    last = mask - F.pad(mask[:, 1:], (0, 1))  # (N, H) 1.0 at each completion's last real token, where its mask ends
    return torch.maximum(newlines, last)


def frozen_reward_model(cfg, tok, rt, longest):
    """--reward_model on the device, frozen, and the task it was trained for (reward_model.py --task); each path must
    share the policy's tokenizer and hold a row of longest tokens. Two or more paths: a RewardEnsemble of models
    trained for the same task."""
    members = []
    tasks = set()
    for path in cfg.reward_model.split(","):
        rm, rm_tok, task = load_reward_model(path)
        check(rm_tok == tok.spec, f"--reward_model {path} uses another tokenizer than the policy")
        size = rm.body.config.block_size
        check(longest <= size, f"prompt + --horizon ({longest} tokens) exceeds the reward model's block_size {size}")
        members.append(rm)
        tasks.add(task)
    check(len(tasks) == 1, f"--reward_model: the members were trained for different tasks ({sorted(tasks)})")
    if len(members) > 1:
        rm = RewardEnsemble(members, cfg.rm_ensemble, cfg.uwo_lambda)
    return rm.to(rt.device), task


def ensemble_scores(scores, kind, uwo_lambda):
    """The scores (K, N) of K reward models combined into one (N,) (Coste et al. 2023, arXiv:2310.02743): mean, the
    members' mean; min, worst-case optimisation (WCO); uwo, uncertainty-weighted optimisation: the mean minus
    uwo_lambda times the members' variance, the population variance (divided by K, not K - 1). Any trailing shape
    works: (K, ...) -> (...)."""
    if kind == "min":
        return scores.min(0).values
    mean = scores.mean(0)
    if kind == "uwo":
        return mean - uwo_lambda * scores.var(0, correction=0)
    return mean


class RewardEnsemble(nn.Module):
    """Reward models scored as one: ensemble_scores of their scores at every position."""

    def __init__(self, members, kind, uwo_lambda):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.kind = kind
        self.uwo_lambda = uwo_lambda

    def forward(self, idx, attention_mask=None):  # (B, T) -> (B, T)
        scores = torch.stack([rm(idx, attention_mask) for rm in self.members])  # (K, B, T)
        return ensemble_scores(scores, self.kind, self.uwo_lambda)


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


# ----- END SHARED BLOCK: tasks -----


# ----------------------------------------------------------------------------------------------------------
# Tasks of this script alone


class ReasoningTask(ArithmeticTask):
    """R1-Zero in miniature (docs/r1_zero.md). The prompt is "Q:<expr>;" for an
    expression of --min_steps..--steps operations evaluated left to right, the completion ends at its newline, and
    the reward is 1.0 when its answer (read_answer: its last "A:n", else its last step's result) is the expression's
    value, else 0.0. No format reward: a direct answer and worked steps that reach the value score alike. The base
    model is gpt.py's --data reasoning, which holds out the same problems (held_out of the arithmetic prompt)."""

    def __init__(self, cfg, tok, rt):
        super().__init__(cfg, tok, rt)
        self.n_ends = 1  # the steps and the answer on one line
        self.eval_problems = [
            reasoning_problem(problem)
            for k in range(cfg.min_steps, cfg.steps + 1)  # --eval_size draws of each number of operations
            for problem in held_out_problems(cfg.digits, cfg.ops, cfg.eval_size, k)
        ]

    def draw(self):
        k = random.randint(self.cfg.min_steps, self.cfg.steps)  # the number of operations, then the problem
        return reasoning_problem(draw_problem(random, self.cfg.digits, self.cfg.ops, False, k))

    def reward(self, text, answer):
        """1.0 where the completion's answer is the value, else 0.0."""
        return float(read_answer(text) == answer)

    @torch.no_grad()
    def evaluate(self, model, ref, rt, tok, step):
        """eval/ metrics of the greedy answers to the held-out problems, eval/sample_ ones of four sampled answers a
        problem at temperature 1: accuracy; mean length in tokens; step_share, the share that write steps (not a
        direct "A:" answer); steps_right, the share that ended after writing every step as worked_steps does (a
        right answer through a wrong step does not count); the accuracy within each mode; the mean length of right
        and of wrong answers (nan: none)."""
        metrics = {"eval/n_problems": len(self.eval_problems)}  # distinct held-out problems
        for prefix, n, temperature in (("eval/", 1, 0.0), ("eval/sample_", 4, 1.0)):
            _, completion, mask, exact = self.answer(model, rt, n, temperature)
            texts = self.texts(completion, mask)
            worked = [worked_steps(p) for p, _ in self.eval_problems for _ in range(n)]
            steps = torch.tensor([not t.startswith("A:") and "=" in t for t in texts])  # (E n,)
            right_steps = [t.endswith("\n") and t.split(";A:")[0].rstrip("\n") == w for t, w in zip(texts, worked)]
            lengths = mask.sum(1).cpu()  # (E n,) the newline included
            exact = exact.cpu()
            right = exact > 0
            every = torch.ones_like(right)
            parts = {  # metric: (values, the answers it averages over)
                "accuracy": (exact, every),
                "length": (lengths, every),
                "step_share": (steps.float(), every),
                "steps_right": (torch.tensor(right_steps).float(), every),
                "accuracy_steps": (exact, steps),
                "accuracy_direct": (exact, ~steps),
                "length_right": (lengths, right),
                "length_wrong": (lengths, ~right),
            }
            for name, (values, rows) in parts.items():
                metrics[prefix + name] = values[rows].mean().item()
        shown = [f"{p}{t!r} (answer {a})" for (p, a), t in zip(self.eval_problems[:8], texts[::4])]  # sampled
        return metrics, "\n".join(shown)


def reasoning_problem(problem):
    """An arithmetic problem as the reasoning task asks it: ("7+2-5=", "7+2=9\\n9-5=4\\n") -> ("Q:7+2-5;", 4)."""
    prompt, solution = problem
    return f"Q:{prompt[:-1]};", int(solution.split("=")[-1])


def read_answer(text):
    """The answer of a reasoning completion: its last "A:n", else its last step's result (the number after its last
    "="); None when it never ended (no newline within the horizon) or has neither."""
    answers = re.findall(r"A:(-?\d+)", text) or re.findall(r"=(-?\d+)", text)
    if not answers or not text.endswith("\n"):
        return None
    return int(answers[-1])


def worked_steps(prompt):
    """The steps of a reasoning prompt as gpt.py's worked documents write them: each operation's result with the
    rest of the expression copied after it, ";" between steps: "Q:7+2-5;" -> "7+2=9-5;9-5=4"."""
    x = int(re.match(r"Q:(\d+)", prompt).group(1))
    operations = re.findall(r"[-+*]\d+", prompt)  # "+2", "-5"
    steps = []
    for i, operation in enumerate(operations):
        result = operate(x, operation[0], int(operation[1:]))
        steps.append(f"{x}{operation}={result}" + "".join(operations[i + 1 :]))
        x = result
    return ";".join(steps)


# ----------------------------------------------------------------------------------------------------------
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
