"""
char_grpo.py: can a GPT learn language from reward alone? Character-level GRPO with dense per-character rewards.

The policy continues real text: for each of --batch_size contexts of --context_len characters it samples
--group_size rollouts of --horizon characters. Character t of a rollout earns r_t = 1 if it equals the true
continuation at the same offset (`--reward_mode plus1`; `pm1` gives +1/-1), plus `w * log p(true char | rollout
prefix)` with `--partial_logprob w`. Rollouts are drawn from softmax(logits / --temperature), and every log-prob of
a rollout character (policy, old policy, rl/entropy) is taken under it, the reference's at the same temperature over
the whole vocabulary as in TRL (the bigram's log-probs serve as its logits); partial credit's log p(true char) is a
reward, the model's prediction of the text as eval/bpc scores it, so it stays at temperature 1.
The objective is GRPO's (Shao et al. 2024, DeepSeekMath):

    J = E[ 1/|o| sum_t min(ratio_t A_t, clip(ratio_t, 1-eps, 1+eps) A_t) ] - beta * KL(pi || pi_ref),
    ratio_t = pi(o_t | prefix) / pi_old(o_t | prefix)

with process advantages (`--adv process`, DeepSeekMath process supervision: each reward normalised by its
group's mean and std, A_t = sum of normalised rewards from t on) or outcome advantages (`--adv group`, as
grpo.py's: the rollout's mean reward, normalised within the group). Where we depart from the paper, on purpose:
  - the reference policy is a choice (`--reference bigram|random|init|none`): a frozen add-one-smoothed bigram
    model of the training text by default, since a model trained from scratch has no sensible "initial" policy;
  - the KL holds from the first step at beta 0.5, far above DeepSeekMath's 0.04: without it the reward's cheap
    optimum (writing spaces) takes over within 25 steps (docs/char_grpo.md); --kl_warmup_tokens anneals beta from 0;
  - the KL term is the mean per-character --kl_estimator value, differentiated as a loss term: k3 (the default, as
    in DeepSeekMath) estimates KL(pi || pi_ref) but its gradient is that of KL(pi_ref || pi) (Tang & Munos 2025);
    k2's gradient is that of KL(pi || pi_ref); k1 is refused, its expected gradient on-policy is zero;
  - `--loss_type` swaps the GRPO aggregation for DAPO, Dr. GRPO, GSPO, CISPO or REINFORCE (see policy_loss); GSPO's
    clip range defaults to the paper's 3e-4 / 4e-4 (its length-normalised sequence ratio never leaves 1 +- 0.2).
`--supervised` trains the same model on the same data and number of characters with cross-entropy on the true
continuations (the baseline); `--eval_reference` evaluates the bigram reference itself, as the models are.
The model and the losses are hand-written on purpose: reading them is the point.

Commands:
    python char_grpo.py                                         # tiny Shakespeare, a few minutes on a laptop CPU
    python char_grpo.py --supervised                            # the supervised baseline, the same characters
    python char_grpo.py --device cuda --n_layer 6 --n_embd 384 --batch_size 64 --max_steps 2000   # one GPU
    torchrun --standalone --nproc_per_node=8 char_grpo.py --batch_size 32 --max_steps 2000          # 8 GPUs

docs/char_grpo.md holds the implementation details, every flag and logged metric, and the results (GRPO against
the supervised baseline).
"""

import argparse
import dataclasses
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
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

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
    # run and data
    out_dir: str = ""  # run folder; default out/char_grpo-<YYYYmmdd-HHMMSS>
    data: str = "shakespeare"  # shakespeare (tiny Shakespeare, shipped in data/) or the path of a text file
    data_path: str = ""  # local copy of tiny Shakespeare (offline)
    init_from: str = "scratch"  # scratch | ckpt.pt of gpt.py or any script (same char vocabulary)
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    # model (a new one; --init_from and --resume keep the checkpoint's)
    n_layer: int = 4  # transformer blocks (scratch only)
    n_head: int = 4  # attention heads (scratch only)
    n_embd: int = 128  # embedding width (scratch only)
    block_size: int = 128  # context length of the model (scratch only)
    # rollouts
    context_len: int = 32  # characters of real text before each rollout
    horizon: int = 16  # characters per rollout
    batch_size: int = 16  # contexts per step per rank
    group_size: int = 8  # rollouts per context (a group)
    temperature: float = 1.0  # sampling temperature of rollouts
    # reward and advantages
    reward_mode: str = "plus1"  # plus1: 1 per correct character, else 0 | pm1: +1 correct, -1 wrong | none: no reward
    partial_logprob: float = 0.0  # w: add w * log p(true char | rollout prefix) to every character's reward
    adv: str = "process"  # process: per-character returns of normalised rewards | group: per-rollout (outcome)
    scale_rewards: str = "group"  # --adv group's std: group | batch | none (Dr. GRPO: no std scaling)
    # KL to a frozen reference
    reference: str = "bigram"  # KL reference: bigram | random | init | none
    beta_kl: float = 0.5  # KL coefficient (final, with a warm-up)
    kl_warmup_tokens: int = 0  # generated characters over which beta rises linearly from 0 to beta_kl (0: none)
    kl_estimator: str = "k3"  # k2 | k3, the per-character KL term of the loss (k1 is refused: zero gradient)
    # loss
    loss_type: str = "grpo"  # grpo | dapo | dr_grpo | gspo | cispo | reinforce
    clip_eps: float = None  # PPO clip range, lower (and upper unless clip_eps_high is set); unset: 0.2, gspo 3e-4
    clip_eps_high: float = None  # upper clip range (DAPO's clip-higher: 0.28); unset or 0: clip_eps, gspo 4e-4
    num_iterations: int = 1  # optimizer steps per batch of rollouts (>1 reuses them through the ratio)
    # optimisation
    grad_accum: int = 1  # micro-batches per optimizer step (groups are never split)
    max_steps: int = 300  # rollout batches
    lr: float = 1e-3  # peak learning rate
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 20  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay on matrices
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    # the supervised baseline
    supervised: bool = False  # baseline: cross-entropy on the true continuations, same data and number of characters
    eval_reference: bool = False  # train nothing: evaluate the bigram reference itself, as a model is evaluated
    # evaluation, logging, checkpoints
    eval_every: int = 25  # steps between evaluations
    eval_size: int = 256  # val windows per evaluation
    log_every: int = 10  # steps between log lines
    save_every: int = 100  # steps between checkpoints (one is always written at the end)
    # system
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA if supported)
    compile: bool = False  # torch.compile the training forward and the rollouts' decode step (a CUDA graph on a GPU)
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank)
    deterministic: bool = False  # torch.use_deterministic_algorithms
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rlhf-gpt"  # wandb project


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: pure functions, tensors in and tensors out. grpo.py and rookworld_grpo.py carry
# copies; tests/test_grpo_math.py checks them against hand-derived values and against each other.


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


# ----------------------------------------------------------------------------------------------------------
# The training step, as the algorithm reads: rollout -> reward -> advantage -> loss -> update (grpo_step), then
# the functions it calls; supervised_step is the baseline's step.


def grpo_step(cfg, run, rt):
    """One GRPO step: rollouts -> rewards -> advantages -> --num_iterations policy updates on the same rollouts.
    Returns (loss, grad norm, metrics), the rl/ metrics over every rank's rollouts."""
    G = cfg.group_size
    H = cfg.horizon
    N = cfg.batch_size * G  # this rank's rollouts: --batch_size groups of G
    # ALGO LOGIC 1. rollout: G continuations of each context and the log-probs the update compares against
    t_rollout = time.time()
    batch = rollout(cfg, run, rt)
    t_rollout = time.time() - t_rollout
    seq = batch["seq"]
    completion = batch["completion"]
    truth = batch["truth"]
    mask = batch["mask"]
    # 2. reward: one per character
    rewards = token_rewards(completion, truth, cfg.reward_mode, batch["logp_true"], cfg.partial_logprob)  # (N, H)
    if cfg.reward_mode == "none":  # the control without reward: every advantage is 0, the KL term alone trains
        rewards = torch.zeros_like(rewards)
    # 3. advantage
    if cfg.adv == "process":
        adv = process_advantages(rewards, mask, G)  # (N, H)
    else:
        # over every rank's rollouts: groups never span ranks, but --scale_rewards batch takes the std of the
        # global batch; this rank keeps its own rows
        all_adv = group_advantages(gather_rows(rewards.mean(1), rt), G, cfg.scale_rewards)  # (world * N,)
        adv = all_adv.view(rt.world_size, N)[rt.rank][:, None].expand(N, H)  # (N, H): the same on every character
    warm = min(1.0, run.tokens / cfg.kl_warmup_tokens) if cfg.kl_warmup_tokens else 1.0
    beta = cfg.beta_kl * warm if cfg.reference != "none" else 0.0
    # global counts: the summed micro-batch losses of every rank equal the loss of the whole batch
    n_seqs = all_reduce(torch.tensor(float(N), device=rt.device), rt)
    n_tokens = all_reduce(mask.sum(), rt)
    # 4. loss and 5. update: --num_iterations optimizer steps over the same rollouts, old_logp fixed
    n_micro = cfg.batch_size // cfg.grad_accum * G  # rows per micro-batch: whole groups
    for _ in range(cfg.num_iterations):
        sums = {}  # this rank's share of each statistic, summed over micro-batches (the last iteration's are logged)
        for i in range(0, N, n_micro):
            rows = slice(i, i + n_micro)
            grad_sync(run.policy, i + n_micro >= N)
            with rt.autocast():
                logp, entropy = completion_logprobs(
                    run.policy, seq[rows], completion[rows], cfg.temperature, entropy=True
                )
            pg_loss, stats = policy_loss(
                logp,
                batch["old_logp"][rows],
                adv[rows],
                mask[rows],
                loss_type=cfg.loss_type,
                clip_eps=cfg.clip_eps,
                clip_eps_high=cfg.clip_eps_high,
                max_len=H,
                num_seqs=n_seqs,
                num_tokens=n_tokens,
            )
            kl_term = (kl_penalty(logp, batch["ref_logp"][rows], cfg.kl_estimator) * mask[rows]).sum() / n_tokens
            loss = pg_loss + beta * kl_term
            k1 = ((logp - batch["ref_logp"][rows]) * mask[rows]).sum() / n_tokens  # logged, whatever --kl_estimator
            run.scaler.scale(loss * rt.world_size).backward()
            # the stats' share of the step: its tokens, or for gspo (per-sequence stats) its sequences
            if cfg.loss_type == "gspo":
                share = n_micro / n_seqs
            else:
                share = mask[rows].sum() / n_tokens
            micro = {
                "loss": loss,
                "rl/kl": k1,
                "rl/entropy": (entropy * mask[rows]).sum() / n_tokens,  # this share of the sampler's mean entropy
                "rl/clip_frac": stats["clip_frac"] * share,
                "rl/ratio_mean": stats["ratio_mean"] * share,
            }
            for name, value in micro.items():
                sums[name] = sums.get(name, 0.0) + value.detach()
        grad_norm = step_optimizer(cfg, run)
    # every share is normalised by global counts: the sum over ranks is the global value
    totals = {name: all_reduce(value, rt).item() for name, value in sums.items()}
    # the rollouts of every rank; a group without signal: all its rollouts got the same rewards
    rewards = gather_rows(rewards, rt)  # (world * N, H)
    match = gather_rows((completion == truth).float(), rt)  # (world * N, H)
    if cfg.adv == "process":
        groups = rewards.view(-1, G, H)
    else:
        groups = rewards.mean(1).view(-1, G, 1)
    metrics = {
        "rl/reward_mean": rewards.mean().item(),
        "rl/reward_std": rewards.std().item(),
        "rl/beta": beta,
        "rl/accuracy": match.mean().item(),
        "rl/zero_std_frac": (groups == groups[:, :1]).all(2).all(1).float().mean().item(),
    }
    train_loss = totals.pop("loss")
    metrics.update(totals)  # rl/kl, rl/entropy, rl/clip_frac, rl/ratio_mean
    metrics["perf/rollout_ms"] = 1000 * t_rollout
    return train_loss, grad_norm, metrics


# The rollout batch, N = --batch_size * --group_size rows on this rank, groups contiguous (rows g*G .. g*G+G-1
# continue the same context); C = --context_len, H = --horizon. Every tensor is fixed for the step (no gradient).
#   key         shape     what it holds
#   seq         (N, C+H)  the context, then the sampled continuation
#   completion  (N, H)    the sampled characters (softmax(logits / --temperature))
#   truth       (N, H)    the true continuation of the context in the text
#   mask        (N, H)    1.0 on real completion characters (all of them: a rollout never stops early)
#   old_logp    (N, H)    log-probs of the completion under the sampling policy, at --temperature
#   ref_logp    (N, H)    the reference's log-probs at --temperature; with --reference none it is old_logp (rl/kl 0)
#   logp_true   (N, H)    log p(true char | rollout prefix) at temperature 1, for partial credit; None when
#                         --partial_logprob is 0 (nothing computed)
def rollout(cfg, run, rt):
    """G continuations of each of --batch_size contexts of the training text, and the log-probs the update needs:
    the batch dict above."""
    C = cfg.context_len
    H = cfg.horizon
    G = cfg.group_size
    contexts, truth = sample_windows(run.train_ids, cfg.batch_size, C, H)  # (B, C), (B, H)
    prompts = contexts.repeat_interleave(G, 0).to(rt.device)  # (N, C)
    truth = truth.repeat_interleave(G, 0).to(rt.device)  # (N, H)
    with torch.no_grad(), rt.autocast():  # the model has no dropout: train mode samples as eval mode would
        # (N, H), (N, H); rt.decode: the decode step, compiled under --compile
        completion, mask = generate(run.raw, prompts, H, cfg.temperature, decode=rt.decode)
        seq = torch.cat([prompts, completion], 1)  # (N, C+H)
        old_logp, _ = completion_logprobs(run.raw, seq, completion, cfg.temperature)  # (N, H)
        # a reward, not a policy log-prob: the model's own (temperature 1) prediction of the true text, the quantity
        # eval/bpc measures, so --temperature changes how rollouts are drawn, not what earns reward
        logp_true = None
        if cfg.partial_logprob:
            logp_true, _ = completion_logprobs(run.raw, seq, truth)  # (N, H)
        ref_logp = old_logp  # --reference none: rl/kl is 0
        if run.ref_table is not None:  # the previous character's bigram row serves as the reference's logits
            ref_logp = token_logprobs(run.ref_table[seq[:, C - 1 : -1]], completion, cfg.temperature)  # (N, H)
        if run.ref_model is not None:
            ref_logp, _ = completion_logprobs(run.ref_model, seq, completion, cfg.temperature)  # (N, H)
    return dict(
        seq=seq,
        completion=completion,
        truth=truth,
        mask=mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        logp_true=logp_true,
    )


def completion_logprobs(model, seq, targets, temperature=1.0, entropy=False):
    """log p(targets) (N, H) under softmax(logits / temperature) at the last H positions of seq (N, C+H), whose
    logits at C-1 .. C+H-2 predict them, and with entropy=True the entropy there (else None). The logits stay inside
    the model's linear_logprobs (keep_last: the vocabulary projection of the context is never computed)."""
    H = targets.size(1)  # (N, H)
    return model(seq[:, :-1], targets, keep_last=H, output="logprobs", entropy=entropy, temperature=temperature)


def gather_rows(x, rt):
    """Every rank's x (N, ...) in rank order: (world_size * N, ...); every rank must hold as many rows. Each rank
    writes its rows into zeros and all_reduce sums them, which is exact."""
    out = x.new_zeros(rt.world_size, *x.shape)
    out[rt.rank] = x
    return all_reduce(out, rt).flatten(0, 1)


def step_optimizer(cfg, run):
    """Unscale (float16), clip, step, zero the gradients; returns the gradient norm before clipping."""
    run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(run.policy, cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def supervised_step(cfg, run, rt):
    """The baseline: cross-entropy on true continuations, as many target characters as GRPO generates (temperature
    1: the baseline samples nothing). Returns (loss, grad norm, metrics)."""
    N = cfg.batch_size * cfg.group_size  # as many windows as GRPO has rollouts
    n_micro = cfg.batch_size // cfg.grad_accum * cfg.group_size
    contexts, truth = sample_windows(run.train_ids, N, cfg.context_len, cfg.horizon)
    seq = torch.cat([contexts, truth], 1).to(rt.device)  # (N, C+H)
    truth = truth.to(rt.device)  # (N, H)
    loss_sum = torch.zeros((), device=rt.device)
    for i in range(0, N, n_micro):
        rows = slice(i, i + n_micro)
        grad_sync(run.policy, i + n_micro >= N)
        with rt.autocast():
            logp, _ = completion_logprobs(run.policy, seq[rows], truth[rows])  # (n_micro, H)
            loss = -logp.sum()
        run.scaler.scale(loss / truth.numel()).backward()  # the global mean: every rank holds as many characters
        loss_sum += loss.detach()
    train_loss = (all_reduce(loss_sum, rt) / (truth.numel() * rt.world_size)).item()
    return train_loss, step_optimizer(cfg, run), {"perf/rollout_ms": 0.0}  # nothing sampled


# ----------------------------------------------------------------------------------------------------------
# The task: windows of a text, dense per-character rewards, the bigram reference, evaluation and plots.

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# tiny Shakespeare ships with the repository (data/ beside the scripts); a script forked alone downloads it there
SHAKESPEARE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")


def download(url, path):
    """Fetch url to path once (torch.hub writes a temporary file and renames it), for the default data."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, path)
        except Exception as e:
            die(f"cannot download {url} ({type(e).__name__}); offline, pass a local copy with --data_path")
    return path


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


def evaluate_chars(cfg, run, rt, step):
    """Teacher-forced next-character accuracy and bits per character on the fixed val windows, and how often greedy
    rollouts match the true continuation; appends one sampled continuation to samples.txt."""
    C = cfg.context_len
    H = cfg.horizon
    raw = run.raw
    x = run.eval_x.to(rt.device)  # (E, C+H)
    with torch.no_grad(), rt.autocast():  # the model has no dropout: train mode is eval mode
        logits, nll = raw(x[:, :-1], x[:, 1:])  # (E, C+H-1, V), mean cross-entropy
        greedy, _ = generate(raw, x[:, :C], H, temperature=0)
        gen = torch.Generator(rt.device).manual_seed(step)  # its own stream: training randomness stays as is
        sample, _ = generate(raw, x[:1, :C], min(4 * H, raw.config.block_size - C), cfg.temperature, generator=gen)
    text = run.tok.decode(x[0, :C].tolist()) + "|" + run.tok.decode(sample[0].tolist())
    if rt.master:
        with open(os.path.join(run.out_dir, "samples.txt"), "a") as f:
            f.write(f"--- step {step} (context|sample)\n{text}\n")
    acc = (logits.argmax(-1) == x[:, 1:]).float().mean().item()
    return {"eval/next_token_acc": acc, "eval/bpc": nll.item() / math.log(2), **greedy_metrics(run, greedy, x[:, C:])}


def greedy_metrics(run, greedy, truth):
    """eval/greedy_match, the share of greedy characters (E, H) equal to the truth (E, H) at their offset, and
    eval/greedy_space_frac, the share of them that are spaces (the cheap optimum of a per-character reward)."""
    space = run.tok.encode(" ")[0] if " " in run.tok.chars else -1
    return {
        "eval/greedy_match": (greedy == truth).float().mean().item(),
        "eval/greedy_space_frac": (greedy == space).float().mean().item(),
    }


def evaluate_bigram(cfg, run, rt):
    """evaluate_chars's metrics of the bigram reference itself, on the same windows: its most likely character
    after each one (teacher-forced), its bits per character, and greedy rollouts that follow its most likely
    character from the context's last."""
    C = cfg.context_len
    x = run.eval_x.to(rt.device)  # (E, C+H)
    logp = run.ref_table[x[:, :-1]]  # (E, C+H-1, V): log p(next | previous)
    nll = -logp.gather(-1, x[:, 1:, None]).mean()
    chars = [x[:, C - 1]]
    for _ in range(cfg.horizon):
        chars.append(run.ref_table[chars[-1]].argmax(-1))
    greedy = torch.stack(chars[1:], 1)  # (E, H)
    acc = (logp.argmax(-1) == x[:, 1:]).float().mean().item()
    return {"eval/next_token_acc": acc, "eval/bpc": nll.item() / math.log(2), **greedy_metrics(run, greedy, x[:, C:])}


# ----------------------------------------------------------------------------------------------------------
# Setup, the training loop, main() and their helpers.


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


def validate(cfg):
    """Bad settings end the run before anything is loaded: one line on stderr, exit code 2."""
    positive = [
        "context_len",
        "horizon",
        "batch_size",
        "max_steps",
        "num_iterations",
        "grad_accum",
        "eval_every",
        "lr",
        "log_every",
        "save_every",
        "eval_size",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "clip_eps",
    ]
    for name in positive:
        check(getattr(cfg, name) > 0, f"--{name} must be positive (got {getattr(cfg, name)})")
    for name in ("beta_kl", "kl_warmup_tokens", "clip_eps_high", "grad_clip", "weight_decay", "warmup_steps"):
        check(getattr(cfg, name) >= 0, f"--{name} must be >= 0 (got {getattr(cfg, name)})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    check(cfg.group_size >= 2, f"--group_size must be >= 2, GRPO compares rollouts in a group (got {cfg.group_size})")
    check(cfg.batch_size % cfg.grad_accum == 0, "--batch_size must be a multiple of --grad_accum (groups stay whole)")
    check(cfg.temperature > 0, f"--temperature must be > 0: greedy rollouts of a group are alike ({cfg.temperature})")
    check(cfg.n_embd % cfg.n_head == 0, f"--n_embd {cfg.n_embd} must be a multiple of --n_head {cfg.n_head}")
    # k1 as a loss term: its expected gradient on-policy is zero (E[grad log pi] = 0)
    check(cfg.kl_estimator != "k1", "--kl_estimator k1: as a loss term its expected gradient is zero; use k2 or k3")
    choices = {
        "reward_mode": ("plus1", "pm1", "none"),
        "adv": ("process", "group"),
        "kl_estimator": ("k2", "k3"),
        "scale_rewards": ("group", "batch", "none"),
        "reference": ("bigram", "random", "init", "none"),
        "loss_type": ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "reinforce"),
    }
    for name, allowed in choices.items():
        check(getattr(cfg, name) in allowed, f"--{name} {getattr(cfg, name)!r}: use one of {', '.join(allowed)}")
    check(
        not (cfg.reward_mode == "none" and cfg.reference == "none"), "--reward_mode none needs a --reference to train"
    )
    check(not cfg.eval_reference or cfg.reference == "bigram", "--eval_reference evaluates --reference bigram")
    check(not (cfg.eval_reference and cfg.supervised), "--eval_reference trains nothing; drop --supervised")


def build_run(cfg, out_dir, rt):
    """Everything a run holds (a namespace): data, tokenizer, policy (new, --init_from, or the resumed run's), the
    frozen reference, optimizer and loss scale; a resumed run's optimizer, loss scale, RNG streams, step, tokens."""
    run = argparse.Namespace(out_dir=out_dir, ckpt_path=os.path.join(out_dir, "ckpt.pt"), start_step=0, tokens=0)
    source = run.ckpt_path if cfg.resume else cfg.init_from
    model = spec = ckpt = None  # scratch: a new model below, on the text's own vocabulary
    if source != "scratch":
        model, spec, ckpt = load_model(source)
    if cfg.data == "shakespeare":
        path = cfg.data_path or download(SHAKESPEARE_URL, SHAKESPEARE_PATH)
    else:
        path = cfg.data
    text = read_text(path)
    check(spec != "gpt2", f"--init_from {cfg.init_from}: a GPT-2 BPE model; char_grpo.py needs a char vocabulary")
    run.tok = CharTokenizer(sorted(set(text)) if spec is None else spec["chars"])
    unknown = sorted(set(text) - set(run.tok.chars))  # none in a new vocabulary
    check(not unknown, f"{path} has characters {''.join(unknown[:10])!r} outside the checkpoint's vocabulary")
    if spec is None:
        config = GPTConfig(
            block_size=cfg.block_size,
            vocab_size=run.tok.vocab_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
        )
        model = GPT(config)
    C = cfg.context_len
    H = cfg.horizon
    block_size = model.config.block_size
    check(C + H <= block_size, f"--context_len + --horizon ({C + H}) exceeds the model's block_size {block_size}")
    ids = torch.tensor(run.tok.encode(text))
    run.train_ids, val_ids = ids.tensor_split([int(0.9 * len(ids))])  # 90% to train, 10% to validate
    for name, split in (("train", run.train_ids), ("val", val_ids)):
        check(len(split) > C + H, f"{path}: the {name} split has {len(split)} characters, <= --context_len + --horizon")

    # frozen reference: never wrapped, never trained; a copy of rank 0's starting weights on every rank
    broadcast_weights(model.to(rt.device), rt)
    run.ref_table = None
    run.ref_model = None
    if cfg.reference == "bigram":
        # a char vocabulary is small: the whole table, (V, V) log p(next | previous), whose rows serve as logits
        bigram = BigramReference(run.train_ids, model.config.vocab_size)
        chars = torch.arange(model.config.vocab_size)
        run.ref_table = bigram(chars[:, None], chars[None, :])[0].to(rt.device)  # (V, V)
    if cfg.reference in ("random", "init"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 10_000)  # the same random reference on every rank and after a resume
            run.ref_model = GPT(model.config).to(rt.device).eval().requires_grad_(False)
        if cfg.reference == "init":
            run.ref_model.load_state_dict(ckpt["reference"] if cfg.resume else model.state_dict())

    run.raw = model  # unwrapped: sampling, evaluation, checkpoints
    run.policy = wrap_model(model, rt, cfg.compile)  # DDP / FSDP / compiled: the training forward
    run.optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, (0.9, 0.99), rt.device)
    run.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    if cfg.resume:
        load_optimizer_state(model, run.optimizer, ckpt["optimizer"], rt)
        # float16 runs' loss scale; a checkpoint without one (older, or another dtype) keeps the fresh scaler's
        run.scaler.load_state_dict(ckpt.get("scaler") or run.scaler.state_dict())
        restore_rng(ckpt, rt)
        run.start_step = ckpt["step"]
        run.tokens = ckpt["tokens"]
    with torch.random.fork_rng(devices=[]):  # fixed evaluation windows, without touching the training streams
        torch.manual_seed(0)
        run.eval_x = torch.cat(sample_windows(val_ids, cfg.eval_size, C, H), 1)  # (E, C+H)
    return run


def save_char_run(cfg, run, rt, step):
    """ckpt.pt (the format every script shares, plus tokens, the loss scale and an "init" reference); rank 0 writes
    it."""
    model_sd, optim_sd = training_state(run.raw, run.optimizer, rt)  # under FSDP every rank gathers
    rngs = all_rng_states(rt)
    ckpt = dict(
        model=model_sd,
        model_config=dataclasses.asdict(run.raw.config),
        tokenizer=run.tok.spec,
        step=step,
        optimizer=optim_sd,
        rng=rngs[0],
        rng_ranks=rngs,
        config=dataclasses.asdict(cfg),
        tokens=run.tokens,
        supervised=cfg.supervised,
        scaler=run.scaler.state_dict(),
    )
    if cfg.reference == "init":
        ckpt["reference"] = run.ref_model.state_dict()
    if rt.master:
        save_checkpoint(run.ckpt_path, ckpt)


def train(cfg, out_dir, rt):
    """One run (GRPO, or the supervised baseline with cfg.supervised) into out_dir; returns its final results."""
    seed_everything(cfg.seed + rt.rank)
    stop = GracefulExit()
    run = build_run(cfg, out_dir, rt)
    save_config(cfg, out_dir, rt)  # every input is checked: from here on the run folder is written
    mode = "grpo"
    if cfg.supervised:
        mode = "supervised"
    if cfg.eval_reference:
        mode = "bigram"
    if rt.master:
        print_start(run.raw, rt, out_dir, f"{mode}, vocab {run.tok.vocab_size}, reference {cfg.reference}")
    logger = Logger(cfg, out_dir, rt, cfg.max_steps, run.start_step)
    t_start = time.time()
    last_eval = {}
    max_steps = cfg.max_steps
    if cfg.eval_reference:  # the reference's metrics at step 0, nothing trained
        max_steps = 0
    for step in range(run.start_step, max_steps + 1):
        if cfg.eval_reference:
            last_eval = evaluate_bigram(cfg, run, rt)
        elif step % cfg.eval_every == 0 or step == max_steps:
            last_eval = evaluate_chars(cfg, run, rt, step)
        if step % cfg.eval_every == 0 or step == max_steps:
            logger.log(step, {**last_eval, "rl/tokens": run.tokens})
        if step == max_steps:
            break
        t0 = time.time()
        lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        if cfg.supervised:
            train_loss, grad_norm, metrics = supervised_step(cfg, run, rt)
        else:
            train_loss, grad_norm, metrics = grpo_step(cfg, run, rt)
        n_global = cfg.batch_size * cfg.group_size * cfg.horizon * rt.world_size  # characters of the step
        run.tokens += n_global
        stop_requested = stop.requested(step + 1, rt)
        stop_if_not_finite(train_loss, step, run.ckpt_path, rt)
        dt = time.time() - t0
        logger.bar.update(1)
        logger.bar.set_postfix(loss=f"{train_loss:.4f}", acc=f"{last_eval.get('eval/next_token_acc', 0):.3f}")
        metrics.update({"train/loss": train_loss, "train/lr": lr, "train/grad_norm": grad_norm.item()})
        metrics.update({"rl/tokens": run.tokens, "perf/tokens_per_s": n_global / dt, "perf/step_ms": 1000 * dt})
        logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested:
            save_char_run(cfg, run, rt, step + 1)
        if stop_requested:
            stop.exit(step + 1, out_dir, rt)
    save_char_run(cfg, run, rt, max_steps)
    logger.close()
    results = {"mode": mode, "steps": max_steps, "tokens": run.tokens}
    results["wall_time_s"] = time.time() - t_start
    for name, value in last_eval.items():  # next_token_acc, bpc, greedy_match
        results[name.removeprefix("eval/")] = value
    if rt.master:
        Path(out_dir, "final_results.json").write_text(json.dumps(results, indent=2))
        summary = f"next-char accuracy {results['next_token_acc']:.3f}, {results['bpc']:.2f} bits per character"
        print_end(summary, out_dir, results["wall_time_s"])
    return results


def main():
    cfg = resolve_clip(parse_config(Config))
    validate(cfg)
    rt = setup_runtime(cfg)
    out_dir = prepare_out_dir(cfg, "char_grpo", rt)
    train(cfg, out_dir, rt)
    cleanup(rt)


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
