"""
ppo.py: actor-critic PPO with GAE (Schulman et al. 2017, arXiv 1707.06347; 2016, arXiv 1506.02438) for language
models, on dense and learned rewards, in the RLHF form of Ziegler et al. 2019 (arXiv 1909.08593) and Stiennon et al.
2020 (arXiv 2009.01325), with the details of Huang et al. 2022 ("The N implementation details of RLHF with PPO").

The policy pi samples one completion o_1..o_T of each prompt q; a value model V estimates the return from each state
s_t = (q, o_<t). pi is the sampler's distribution, softmax(logits / --temperature) over the --top_k most likely
tokens: every log-prob of a completion token (pi_old at the rollout, pi in each update, the entropy H) is taken under
it; log pi_ref at the same temperature over the whole vocabulary (as TRL), so it stays finite. Every completion is an
episode whose steps are its tokens, with the KL penalty in the per-token reward:

    r_t = R_t - kl_coef * k1_t,   k1_t = log pi_old(o_t | s_t) - log pi_ref(o_t | s_t)
    R_t = the task's reward where it is earned: next_token scores every token; arithmetic and reward_model score the
          whole completion at its last token (minus --missing_eos_penalty if it never ends), 0 elsewhere
    delta_t = r_t + gamma V(s_t+1) - V(s_t),   A_t = sum_l (gamma lam)^l delta_t+l,   G_t = A_t + V(s_t)   (GAE)

G_t (the value target) is taken before --whiten_advantages normalises A over the rollout batch. Then --ppo_epochs
passes over the batch in --num_minibatches minibatches, each one optimizer step of

    L = L_clip + c_V L_V - entropy_coef H,       rho_t = pi(o_t | s_t) / pi_old(o_t | s_t)
    L_clip = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))   (--dual_clip c: for A_t < 0 also capped
             at -c A_t; Ye et al. 2020)
    L_V    = 0.5 mean_t max((V_t - G_t)^2, (clip(V_t, V_old_t - eps_v, V_old_t + eps_v) - G_t)^2)

mean_t is over every real completion token of the minibatch (all micro-batches and ranks together), eps = --clip_eps,
eps_v = --clip_eps_value, kl_coef = --beta_kl. --adaptive_kl (Ziegler et al. 2019) starts kl_coef at --beta_kl and
after each step sets kl_coef *= 1 + clip(KL / --target_kl - 1, -0.2, 0.2) * n / --kl_horizon, KL the mean over the
step's completions of k1 summed over each, n the number of completions (all ranks).

The value model (--value_model): `separate` (default) is a GPT body with a scalar head on every position (the
RewardModel class of reward_model.py), initialised from the policy with the head at zero, or with --value_init
reward_model from the --reward_model checkpoint; it has its own AdamW at --value_lr and minimises L_V alone (c_V = 1).
`shared` puts a zero-initialised value head on the policy's final hidden states: one forward gives logits and values,
one optimizer trains both, and c_V = --vf_coef. V(s_t) is read at the position whose logits give pi(o_t | s_t).

Tasks (--task), as in grpo.py: next_token (each generated token scores 1 if it equals the true continuation of real
text; tiny Shakespeare or --data FILE), arithmetic (generated problems `a+b=`, --digits, --ops: 1.0 for the exact
answer and a newline; --steps K: K operations solved one step a line, as grpo.py; with --reward_model an outcome
reward model of reward_model.py is the reward and the exact answer is only measured, the gold reward beside the
proxy; an arithmetic problem is held out of training and used in every evaluation iff zlib.crc32(prompt) % 10 == 0),
reward_model (a reward_model.py checkpoint scores each completion of an HH-RLHF prompt). The reference of the KL
penalty (--reference): the starting policy (init), a bigram model of the training text (the default for next_token
from scratch, where the starting policy is noise), a random GPT, or none.

Where we depart from the papers, on purpose:
  - one completion per prompt and the reward at the last token, as Ziegler et al., but the episode ends at the last
    completion token even when --horizon cut it short (no bootstrap from V);
  - --whiten_advantages uses the mean and unbiased variance of each rank's rollout batch (as TRL does);
  - the value model is separate and initialised from the policy, not from the reward model, unless --value_init
    reward_model (Huang et al. initialise it from the reward model);
  - log pi_ref is taken over the whole vocabulary: with --top_k the penalty has a floor of -log pi_ref(top-k set) per
    token even where pi = pi_ref, the true KL of the truncated sampler to the full reference;
  - the epoch loop stops early (--target_kl_stop) on the mean approx KL of the epoch's minibatches, not the last one's.
The model, GAE and the losses are hand-written on purpose: reading them is the point.

Commands:
    python ppo.py                                                         # next_token on tiny Shakespeare, CPU
    python gpt.py --data arithmetic --tokenizer char --digits 2 --ops +- --out_dir out/sft2   # a warm start, then
    python ppo.py --task arithmetic --digits 2 --ops +- --init_from out/sft2/ckpt.pt --horizon 6 --batch_size 256
    torchrun --standalone --nproc_per_node=8 ppo.py --task reward_model --init_from out/sft/ckpt.pt \
        --reward_model out/rm/ckpt.pt --value_init reward_model --parallel fsdp   # RLHF on HH-RLHF, 8 GPUs

docs/ppo.md holds the rest: every implementation detail, the flags by group, every logged metric, the results and
the experiments/ scripts that rerun them; docs/rlhf_loop.md runs the whole RLHF loop on a task with a known gold
reward.
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
import resource
import signal
import sys
import tempfile
import time
import zlib
from collections import defaultdict
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
    # the run: where it is written, what it starts from
    out_dir: str = ""  # run folder; default out/ppo-<YYYYmmdd-HHMMSS>
    init_from: str = "scratch"  # scratch | gpt2 | hub id | Hugging Face folder | ckpt.pt of any script
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    # a new model (scratch only)
    tokenizer: str = "gpt2"  # new models only: gpt2 | char (the data's characters; small and offline, for tests)
    n_layer: int = 4  # transformer blocks (scratch only)
    n_head: int = 4  # attention heads (scratch only)
    n_embd: int = 128  # embedding width (scratch only)
    block_size: int = 128  # context length of the model (scratch only)
    # the task: its prompts and its reward
    task: str = "next_token"  # next_token | arithmetic | reward_model
    data: str = "shakespeare"  # next_token: shakespeare (tiny Shakespeare, shipped in data/) or a text file
    data_path: str = ""  # local copy: the tiny Shakespeare text, or HH-RLHF .jsonl/.jsonl.gz for reward_model
    reward_model: str = ""  # reward_model.py's ckpt.pt (A,B,..: an ensemble): the learned reward, --value_init
    rm_ensemble: str = "mean"  # --reward_model A,B,..: mean | min (worst case) | uwo (mean - uwo_lambda * variance)
    uwo_lambda: float = 0.5  # uwo's weight on the members' variance (0.5: not tuned here)
    rm_sigmoid: bool = False  # arithmetic: an orm's reward is sigmoid(score) (a prm's is a probability already)
    context_len: int = 32  # next_token: tokens of real text before each rollout
    reward_mode: str = "plus1"  # next_token: plus1 (1 per correct token, else 0) | pm1 (+1 correct, -1 wrong)
    digits: int = 1  # arithmetic: most digits per operand
    ops: str = "+-*"  # arithmetic: operators to draw from
    steps: int = 1  # arithmetic: operations per problem (K), evaluated left to right, solved one step a line
    format_reward: float = 0.0  # arithmetic: reward of a well-formed answer (ended by a newline) with a wrong result
    max_prompt_len: int = 96  # reward_model: prompt tokens kept (the end of the dialogue)
    missing_eos_penalty: float = 0.0  # subtracted from the score of a completion without an end token
    # rollouts
    batch_size: int = 64  # prompts per step per rank, one completion each
    horizon: int = 16  # most tokens per completion
    temperature: float = 1.0  # sampling temperature of rollouts
    top_k: int = 0  # sample rollouts among the k most likely tokens (0: all)
    # the value model
    value_model: str = "separate"  # separate (a GPT body with a value head) | shared (a value head on the policy)
    value_init: str = "policy"  # separate value model: policy (head at zero) | reward_model (--reward_model's weights)
    # the KL penalty in the reward
    reference: str = "auto"  # auto (bigram for next_token from scratch, else init) | bigram | random | init | none
    beta_kl: float = 0.05  # the per-token KL penalty's coefficient in the reward, rl/beta (where --adaptive_kl starts)
    adaptive_kl: bool = False  # adapt kl_coef towards --target_kl (Ziegler et al. 2019)
    target_kl: float = 6.0  # adaptive_kl: target KL per sequence (nats, k1 summed over its tokens)
    kl_horizon: int = 10000  # adaptive_kl: completions over which the coefficient moves by at most a fifth
    # advantages
    gamma: float = 1.0  # discount per token
    lam: float = 0.95  # GAE lambda (1: Monte Carlo returns minus values; 0: one-step TD errors)
    whiten_advantages: bool = True  # normalise advantages to mean 0, variance 1 over the rollout batch
    # the loss
    clip_eps: float = 0.2  # PPO clip range of the probability ratio
    dual_clip: float = 0.0  # c > 1 caps the loss of negative-advantage tokens at -c A (0: off)
    clip_eps_value: float = 0.2  # clip range of the value around the rollout's value (0: unclipped value loss)
    vf_coef: float = 0.1  # shared value model: weight of the value loss on the shared trunk (separate: --value_lr)
    entropy_coef: float = 0.0  # entropy bonus coefficient
    # optimisation: epochs of minibatch updates on each batch of rollouts
    max_steps: int = 150  # PPO iterations (batches of rollouts)
    ppo_epochs: int = 4  # passes over each batch of rollouts
    num_minibatches: int = 4  # optimizer steps per pass (the batch split into this many minibatches)
    grad_accum: int = 1  # micro-batches per minibatch
    target_kl_stop: float = 0.0  # stop the passes when an epoch's mean approx KL exceeds this (0: never)
    lr: float = 1e-3  # peak learning rate of the policy (and of the shared value head)
    value_lr: float = 0.0  # peak learning rate of a separate value model (0: --lr)
    min_lr: float = (
        None  # learning rate at the end of the cosine decay (unset: --lr / 10; the value model's scaled alike)
    )
    warmup_steps: int = 10  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay on matrices
    grad_clip: float = 1.0  # clip the gradient norm of each model to this (0: off)
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
    compile: bool = False  # torch.compile the training forward passes and the rollouts' decode step (a CUDA graph)
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank)
    deterministic: bool = False  # torch.use_deterministic_algorithms


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: pure functions, tensors in and tensors out. Shapes: N completions, T positions,
# mask 1.0 on real completion tokens, a prefix of each row (real tokens first, then padding). tests/test_ppo.py checks
# them against plain loops and hand-computed values.


def masked_mean(x, mask, num_tokens=None):
    """Mean of x over the positions where mask is 1; num_tokens replaces the count (a global count, when a batch is
    split over micro-batches and ranks, makes the shares sum to the mean of the whole batch)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def ppo_rewards(scores, kl, mask, kl_coef):
    """Per-token rewards (N, T): the task's (N, T) rewards where they are earned (an outcome reward on the last real
    token), minus kl_coef * kl at every real token."""
    return -kl_coef * kl * mask + scores * mask


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation over (N, T) per-token rewards and values V(s_t). The state after a row's last
    real token is terminal: its value is 0, and nothing at masked positions reaches earlier ones.
        delta_t = r_t + gamma V_t+1 - V_t,   A_t = delta_t + gamma lam A_t+1,   returns G_t = A_t + V_t
    Returns (advantages, returns), both 0 on padding; returns are the value targets, before any whitening."""
    rewards = torch.where(mask > 0, rewards, 0.0)
    values = torch.where(mask > 0, values, 0.0)
    T = rewards.size(1)
    next_adv = torch.zeros_like(rewards[:, 0])  # (N,)
    adv = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(next_adv)  # 0 past the end
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (N,)
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        adv.append(next_adv)
    adv = torch.stack(adv[::-1], 1)  # (N, T)
    return adv, adv + values


def whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over the real positions, with the masked mean and the unbiased masked variance;
    shift_mean=False adds the mean back (scale only). Padding positions are ignored and come out as 0."""
    x = torch.where(mask > 0, x, 0.0)
    n = mask.sum()
    mean = x.sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def ppo_policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, dual_clip=None, num_tokens=None):
    """PPO's clipped surrogate over (N, T) token log-probs and per-token advantages, as a loss (token mean):
        max(-A rho, -A clip(rho, 1 - eps, 1 + eps)),  rho = exp(logp - old_logp), old_logp carries no gradient;
    dual_clip c (> 1) also caps the term of tokens with A < 0 at -c A (Ye et al. 2020), so one very unlikely old token
    cannot dominate. Returns (loss, stats): clip_frac (tokens whose clipped branch is active), dual_clip_frac,
    approx_kl (k3 estimate of KL(pi_old || pi), (rho - 1) - log rho) and ratio_mean, all normalised like the loss."""
    mask = mask.float()
    log_ratio = logp - old_logp.detach()  # (N, T)
    ratio = log_ratio.exp()
    pg1 = -adv * ratio  # (N, T) the plain surrogate
    pg2 = -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)  # (N, T) the clipped one
    per_token = torch.max(pg1, pg2)  # (N, T): the pessimistic of the two
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        dual = (adv < 0) & (per_token > -adv * dual_clip)
        per_token = torch.where(dual, -adv * dual_clip, per_token)
    loss = masked_mean(per_token, mask, num_tokens)
    with torch.no_grad():
        stats = {
            "clip_frac": (pg2 > pg1).float(),
            "dual_clip_frac": dual.float(),
            "ratio_mean": ratio,
            "approx_kl": torch.expm1(log_ratio) - log_ratio,  # k3 of KL(pi_old || pi)
        }
        return loss, {name: masked_mean(x, mask, num_tokens) for name, x in stats.items()}


def value_loss(values, old_values, returns, mask, clip_eps, num_tokens=None):
    """0.5 * mean_t max((V - G)^2, (clip(V, V_old - eps, V_old + eps) - G)^2): the value may not gain from moving
    further than eps from the rollout's value (clip_eps None or 0: the plain squared error)."""
    loss = (values - returns) ** 2  # (N, T)
    if clip_eps:
        clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask.float(), num_tokens)


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. 2019: after each step with n completions and a measured KL,
    value *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon, so it moves towards the target by at most 20% per
    `horizon` completions."""

    def __init__(self, init_kl_coef, target, horizon):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl, n_steps):
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------------------------------------
# The PPO step, as the algorithm reads: rollout -> reward -> advantage -> loss -> update (ppo_step), then the
# functions it calls.


def ppo_step(run, step):
    """One PPO iteration, ALGO LOGIC 1-6: rollout -> rewards -> advantages -> epochs of updates -> the KL coefficient.
    The raw actor samples, the wrapped models (DDP / FSDP) train. Returns the step's metrics (every rank's rollouts);
    run.tokens counts the completion tokens of all ranks."""
    cfg = run.cfg
    rt = run.rt
    t0 = time.time()
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    n_seqs = cfg.batch_size * rt.world_size  # completions of the step, all ranks
    lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    # the actor at --lr; a separate value model (the critic) at --value_lr, its minimum scaled alike
    lr_scale = {"actor": 1.0, "critic": (cfg.value_lr or cfg.lr) / cfg.lr}
    for name, opt in run.optimizers.items():
        for group in opt.param_groups:
            group["lr"] = lr * lr_scale[name]

    # 1-2. rollouts: completions, the sampling policy's log-probs and values, the task's rewards
    batch = rollout(run)
    t_rollout = time.time() - t0
    mask = batch["mask"]
    old_values = batch["old_values"]

    # 3. per-token rewards: the task's where they sit, less --missing_eos_penalty on the last token of a completion
    # without its end token, minus kl_coef * k1 at every token
    truncated = batch["truncated"].float()  # (N,)
    kl = (batch["old_logp"] - batch["ref_logp"]) * mask  # (N, H) k1
    penalty, _ = at_last_token(cfg.missing_eos_penalty * truncated, mask)  # (N, H)
    kl_coef = 0.0  # no reference: no penalty
    if run.ref is not None:
        kl_coef = run.kl_ctl.value
    rewards = ppo_rewards(batch["rewards"] - penalty, kl, mask, kl_coef)  # (N, H)

    # 4. advantages by GAE from the rollout's values; the returns are the value targets, taken before whitening
    adv, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)  # (N, H), (N, H)
    if cfg.whiten_advantages:
        adv = whiten(adv, mask)
    batch["adv"] = adv
    batch["returns"] = returns

    # 5. PPO epochs: minibatches of rows, one optimizer step each, until --target_kl_stop
    metrics = ppo_update(run, batch)  # the train/ losses, gradient norms and epochs run

    # 6. the KL coefficient for the next step, from this step's KL per sequence (all ranks)
    mean_seq_kl = (all_reduce(kl.sum(), rt) / n_seqs).item()
    if cfg.adaptive_kl:
        run.kl_ctl.update(mean_seq_kl, n_seqs)

    # metrics over every rank's rollouts; the task's rewards before the missing-EOS penalty
    _, residual_var = global_moments(returns - old_values, rt, mask)
    returns_mean, returns_var = global_moments(returns, rt, mask)
    if returns_var > 0:
        metrics["rl/explained_variance"] = 1 - residual_var / returns_var
    if run.ref is not None:
        metrics["rl/rollout_kl"] = mean_seq_kl  # k1 summed over each completion, mean over completions
    reward_mean, reward_var = global_moments(batch["rewards"][batch["reward_mask"] > 0], rt)  # where they sit
    for name, x in run.task.measures(batch["completion"], mask, batch["info"]).items():  # accuracy, gold reward
        metrics[name] = global_moments(x, rt)[0]
    n_tokens, n_truncated = all_reduce(torch.stack([mask.sum(), truncated.sum()]), rt)
    run.tokens += int(n_tokens.item())
    if run.task.eos_id is not None:  # next_token has no end token: every completion runs the whole horizon
        metrics["rl/truncated_frac"] = (n_truncated / n_seqs).item()
    if run.ref is not None:
        metrics["rl/kl"] = mean_seq_kl * n_seqs / max(n_tokens.item(), 1)  # k1, mean over completion tokens
    metrics.update(
        {
            "train/lr": lr,
            "rl/reward_mean": reward_mean,
            "rl/reward_std": math.sqrt(reward_var),
            "rl/beta": kl_coef,
            "rl/returns_mean": returns_mean,
            "rl/value_mean": global_moments(old_values, rt, mask)[0],
            "rl/completion_len": (n_tokens / n_seqs).item(),
            "rl/tokens": run.tokens,
            "perf/rollout_tokens_per_s": n_seqs * cfg.horizon / max(t_rollout, 1e-9),
            "perf/rollout_ms": 1000 * t_rollout,
            "perf/step_ms": 1000 * (time.time() - t0),
            "perf/peak_mem_mb": peak_memory_mb(rt),
        }
    )
    return metrics


# The rollout batch, a dict of per-row values (N = --batch_size rows on this rank, P the longest prompt, H = --horizon):
#   prompts     N token-id lists       the prompts, unpadded
#   seq         (N, P+H) long          left-padded prompts followed by the completions
#   attn        (N, P+H) bool or None  attention mask of seq; None when no prompt is padded (plain causal attention)
#   completion  (N, H) long            the sampled tokens; after an end token, padding (the end token again, or 0)
#   mask        (N, H) float           1.0 on real completion tokens, up to and including the end token
#   truncated   (N,) bool              no end token within the horizon (always False for next_token: it has none)
#   info        N entries, what each row's reward needs (task.sample's): next_token's true continuation,
#               arithmetic's answer, None for reward_model
#   old_logp    (N, H) float           log pi_old(o_t | s_t) under the sampling distribution (--temperature, --top_k)
#   old_values  (N, H) float           V_old(s_t), read at the position that predicts o_t
#   ref_logp    (N, H) float           log pi_ref(o_t | s_t); old_logp itself without a reference (k1 = 0)
#   rewards     (N, H) float           the task's rewards where reward_mask is 1.0, 0 elsewhere
#   reward_mask (N, H) float           1.0 where a reward sits: the last real token (an outcome reward), or every
#                                      real token (next_token)
# ppo_step adds adv (N, H), the GAE advantages (whitened with --whiten_advantages), and returns (N, H), the value
# targets G_t = A_t + V_old(s_t).


@torch.no_grad()
def rollout(run):
    """ALGO LOGIC 1-2: sample one completion per prompt, then no-grad passes (as many rows at a time as an update's
    forward pass) for the sampling policy's log-probs and values, the reference's log-probs (the policy's own without
    a reference: no penalty) and the task's rewards. Returns the batch (the table above)."""
    cfg = run.cfg
    rt = run.rt
    task = run.task
    actor = run.actor
    H = cfg.horizon
    n_micro = cfg.batch_size // cfg.num_minibatches // cfg.grad_accum  # rows per forward pass
    prompts, info = task.sample(cfg.batch_size)
    with rt.autocast():  # the actor has no dropout: it samples in train mode as in eval mode
        # the completions and their masks, (N, H) each
        completion, mask = sample_completions(
            actor, prompts, H, cfg.temperature, cfg.top_k or None, task.eos_id, rt, n_ends=task.n_ends
        )
        truncated = torch.zeros_like(mask[:, 0], dtype=torch.bool)
        if task.eos_id is not None:
            truncated = ((completion == task.eos_id) & (mask > 0)).sum(1) < task.n_ends  # (N,) not ended within H
        seq, attn = join(prompts, completion)
        parts = defaultdict(list)  # batch key -> one tensor per micro-batch, (n, H) or (n,)
        for i in range(0, len(prompts), n_micro):
            rows = slice(i, i + n_micro)
            s = seq[rows]
            a = None if attn is None else attn[rows]
            logp, _, values = logprobs_and_values(actor, run.critic, s, a, cfg)  # (n, H) each
            ref_logp = logp  # no reference: k1 = 0
            if run.ref is not None:  # the same temperature, the whole vocabulary (the bigram answers the same call)
                ref_logp = completion_logprobs(run.ref, s, a, H, temperature=cfg.temperature)[0]
            # (n, H) each; info: the true continuations, arithmetic's answers, or None each (reward_model)
            rewards, reward_mask = task.rewards(prompts[rows], completion[rows], mask[rows], info[rows])
            parts["old_logp"].append(logp)
            parts["old_values"].append(values)
            parts["ref_logp"].append(ref_logp)
            parts["rewards"].append(rewards)  # (n, H)
            parts["reward_mask"].append(reward_mask)  # (n, H) 1.0 where a reward sits
    batch = {key: torch.cat(tensors).float() for key, tensors in parts.items()}
    batch.update(prompts=prompts, seq=seq, attn=attn, completion=completion, mask=mask, truncated=truncated, info=info)
    return batch


def logprobs_and_values(actor, critic, seq, attn, cfg, entropy=False):
    """Log-probs (N, H) of the last H = --horizon tokens of seq (N, P+H) under the sampling distribution
    (--temperature, --top_k), with entropy=True the entropy of that distribution there (else None), and the values
    (N, H) read at the same positions: the value of completion token t is V(s_t), read at the position that predicts
    it. critic None: the actor is a PolicyWithValueHead and one forward gives all three."""
    H = cfg.horizon
    out = completion_logprobs(actor, seq, attn, H, entropy, cfg.temperature, cfg.top_k or None)  # (N, H) each
    if critic is None:
        return out  # log-probs, entropy, values
    a = None if attn is None else attn[:, :-1]
    return *out, critic(seq[:, :-1], attention_mask=a)[:, -H:]


def ppo_update(run, batch):
    """ALGO LOGIC 5: --ppo_epochs passes over the rollout batch, each in --num_minibatches minibatches of rows (one
    optimizer step each, over --grad_accum micro-batches), until an epoch's mean approx KL exceeds --target_kl_stop.
    Returns the train/ metrics: the mean of each loss term over the updates (all ranks), the mean gradient norm of
    each model and the epochs run."""
    cfg = run.cfg
    rt = run.rt
    N = cfg.batch_size
    n_minibatch = N // cfg.num_minibatches  # rows per optimizer step
    n_micro = n_minibatch // cfg.grad_accum  # rows per forward pass
    sums = defaultdict(float)  # metric name -> sum over the updates of the step, all ranks
    grad_norms = defaultdict(list)  # trained model's name -> its gradient norm at each update
    n_updates = 0  # --num_minibatches per epoch run (fewer epochs after an early stop)
    for _ in range(cfg.ppo_epochs):
        epoch_sums = defaultdict(float)  # metric name -> sum over this epoch's micro-batches, this rank
        perm = torch.randperm(N).to(rt.device)
        for start in range(0, N, n_minibatch):
            idx = perm[start : start + n_minibatch]
            n_tokens = all_reduce(batch["mask"][idx].sum(), rt).clamp(min=1)  # the minibatch's tokens, every rank
            for j in range(0, n_minibatch, n_micro):
                for m in run.wrapped.values():  # gradients are averaged over ranks only on the last micro-batch
                    grad_sync(m, j + n_micro >= n_minibatch)
                loss, terms = ppo_loss(run, batch, idx[j : j + n_micro], n_tokens)
                run.scaler.scale(loss * rt.world_size).backward()  # DDP averages gradients over ranks
                for name, value in terms.items():
                    epoch_sums[name] += value.detach()
            for opt in run.optimizers.values():
                run.scaler.unscale_(opt)
            for name, m in run.wrapped.items():
                grad_norms[name].append(clip_grad_norm(m, cfg.grad_clip))
            n_updates += 1
            for opt in run.optimizers.values():
                run.scaler.step(opt)
                opt.zero_grad(set_to_none=True)
            run.scaler.update()
        for name, value in epoch_sums.items():
            all_reduce(value, rt)  # in place: shares of global means, whose sum over ranks is the mean
            sums[name] += value
        epoch_kl = epoch_sums["rl/approx_kl"].item() / cfg.num_minibatches  # all ranks, mean over its minibatches
        if cfg.target_kl_stop and epoch_kl > cfg.target_kl_stop:
            break
    metrics = {name: (total / n_updates).item() for name, total in sums.items()}
    metrics["train/grad_norm"] = torch.stack(grad_norms["actor"]).mean().item()
    if "critic" in grad_norms:  # a separate value model
        metrics["train/value_grad_norm"] = torch.stack(grad_norms["critic"]).mean().item()
    metrics["train/epochs"] = n_updates // cfg.num_minibatches
    return metrics


def ppo_loss(run, batch, rows, n_tokens):
    """ALGO LOGIC 5: L = L_clip + c_V L_V - entropy_coef H on the batch's rows (a micro-batch), each term a share of
    the minibatch's token mean (n_tokens: its real tokens on every rank), through the wrapped models. Returns the loss
    and its terms by metric name (ppo_update detaches and sums them)."""
    cfg = run.cfg
    actor = run.wrapped["actor"]
    critic = run.wrapped.get("critic")  # None for --value_model shared: the actor's forward pass gives the values too
    mask = batch["mask"][rows]
    attn = None if batch["attn"] is None else batch["attn"][rows]
    with run.rt.autocast():  # (n, H) each, under the sampling distribution, as old_logp
        logp, entropies, values = logprobs_and_values(actor, critic, batch["seq"][rows], attn, cfg, entropy=True)
    old_logp = batch["old_logp"][rows]
    adv = batch["adv"][rows]
    old_values = batch["old_values"][rows]
    returns = batch["returns"][rows]
    pg_loss, stats = ppo_policy_loss(logp, old_logp, adv, mask, cfg.clip_eps, cfg.dual_clip or None, n_tokens)
    v_loss = value_loss(values.float(), old_values, returns, mask, cfg.clip_eps_value, n_tokens)
    if not cfg.entropy_coef:
        entropies = entropies.detach()  # no bonus: the entropy is only logged
    entropy = masked_mean(entropies, mask, n_tokens)
    # vf_coef weighs L_V against L_clip in the gradient of parameters both train (the shared trunk). A separate value
    # model shares none and has its own AdamW, which ignores the gradient's scale: there a weight would only move
    # where its gradient clipping starts, so it minimises L_V itself, at --value_lr.
    vf_coef = 1.0
    if critic is None:
        vf_coef = cfg.vf_coef
    loss = pg_loss + vf_coef * v_loss - cfg.entropy_coef * entropy
    terms = {
        "rl/pg_loss": pg_loss,
        "rl/value_loss": v_loss,
        "rl/entropy": entropy,
        "rl/approx_kl": stats["approx_kl"],
        "rl/clip_frac": stats["clip_frac"],
        "train/loss": loss,
    }
    if cfg.dual_clip:
        terms["rl/dual_clip_frac"] = stats["dual_clip_frac"]
    return loss, terms


def global_moments(x, rt, mask=None):
    """Mean and unbiased variance of x over the real positions (mask None: every position) of every rank's batch
    (never empty: every completion has a first token)."""
    if mask is None:
        mask = torch.ones_like(x)
    sums = torch.stack([mask.sum(), (x * mask).sum(), (x * x * mask).sum()]).double()
    count, total, total_sq = all_reduce(sums, rt)  # one collective for the three sums
    mean = total / count
    var = torch.zeros_like(mean)
    if count > 1:
        var = (total_sq - count * mean**2) / (count - 1)
    return mean.item(), max(var.item(), 0.0)


class PolicyWithValueHead(nn.Module):
    """--value_model shared: the policy GPT and a value head on its final hidden states; one forward pass returns the
    logits (B, T, V) and the values (B, T). It takes the GPT's place wherever a forward pass runs (sampling,
    evaluation), so under FSDP every call goes through the root module that holds the sharded embeddings."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config
        self.value_head = nn.Linear(policy.config.n_embd, 1)
        for p in self.value_head.parameters():
            nn.init.zeros_(p)

    def forward(self, idx, attention_mask=None, cache=None, keep_last=0, targets=None, output="logits", **sampling):
        """(logits (B, T, V), values (B, T)); with targets and output="logprobs", (log p(targets), entropy or None,
        values), each (B, T), from linear_logprobs (as GPT.forward: the logits stay inside), sampling its entropy,
        temperature and top_k: the log-probs and entropy of the sampling distribution."""
        h, _ = self.policy(idx, attention_mask=attention_mask, cache=cache, output="hidden", keep_last=keep_last)
        values = self.value_head(h).squeeze(-1).float()
        if targets is None or output != "logprobs":
            return self.policy.lm_head(h), values
        logp, ent = linear_logprobs(h.flatten(0, 1), self.policy.lm_head.weight, targets.flatten(), **sampling)
        return logp.view(targets.shape), None if ent is None else ent.view(targets.shape), values


# ----------------------------------------------------------------------------------------------------------
# main: the policy, the value model, the reference, then the loop of evaluations, PPO steps and checkpoints


def validate(cfg):
    """Impossible settings end the run before anything is read: one line naming the flag, exit code 2.
    (--temperature 0 is impossible here: PPO's ratio needs the sampling policy's probabilities.)"""
    positive = [
        "horizon",
        "batch_size",
        "max_steps",
        "ppo_epochs",
        "num_minibatches",
        "grad_accum",
        "eval_every",
        "eval_size",
        "log_every",
        "save_every",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "kl_horizon",
        "context_len",
        "max_prompt_len",
        "digits",
        "steps",
        "temperature",
        "lr",
        "clip_eps",
        "target_kl",
    ]
    for name in positive:
        check(getattr(cfg, name) > 0, f"--{name} must be positive (got {getattr(cfg, name)})")
    non_negative = [
        "value_lr",
        "clip_eps_value",
        "vf_coef",
        "entropy_coef",
        "beta_kl",
        "target_kl_stop",
        "missing_eos_penalty",
        "grad_clip",
        "weight_decay",
        "warmup_steps",
        "top_k",
    ]
    for name in non_negative:
        check(getattr(cfg, name) >= 0, f"--{name} must be >= 0 (got {getattr(cfg, name)})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    for name in ["gamma", "lam"]:
        check(0 <= getattr(cfg, name) <= 1, f"--{name} must be in [0, 1] (got {getattr(cfg, name)})")
    rows = cfg.num_minibatches * cfg.grad_accum
    check(cfg.batch_size % rows == 0, f"--batch_size must be a multiple of --num_minibatches * --grad_accum ({rows})")
    check(cfg.dual_clip == 0 or cfg.dual_clip > 1, f"--dual_clip must be > 1, or 0 for off (got {cfg.dual_clip})")
    check(cfg.ops and set(cfg.ops) <= set("+-*"), f"--ops {cfg.ops!r}: use operators from +-*")
    check(cfg.n_embd % cfg.n_head == 0, f"--n_embd {cfg.n_embd} must be a multiple of --n_head {cfg.n_head}")
    choices = {
        "task": ["next_token", "arithmetic", "reward_model"],
        "rm_ensemble": ["mean", "min", "uwo"],
        "tokenizer": ["gpt2", "char"],
        "value_model": ["separate", "shared"],
        "reward_mode": ["plus1", "pm1"],
        "value_init": ["policy", "reward_model"],
        "reference": ["auto", "bigram", "random", "init", "none"],
    }
    for name, allowed in choices.items():
        check(getattr(cfg, name) in allowed, f"--{name} {getattr(cfg, name)!r}: use one of {' | '.join(allowed)}")
    check(cfg.task != "next_token" or not cfg.missing_eos_penalty, "--missing_eos_penalty: next_token has no end token")
    check(cfg.task == "next_token" or cfg.reference != "bigram", "--reference bigram needs a text stream (next_token)")
    check(cfg.steps == 1 or cfg.task == "arithmetic", "--steps is for --task arithmetic")
    if cfg.value_init == "reward_model":  # a shared value head sits on the policy's trunk: no body of its own
        check(cfg.value_model == "separate", "--value_init reward_model needs --value_model separate")
        check(cfg.reward_model, "--value_init reward_model needs --reward_model PATH (a ckpt.pt of reward_model.py)")
    check(not cfg.adaptive_kl or cfg.reference != "none", "--adaptive_kl needs a reference (--reference none)")
    n_rm = len(cfg.reward_model.split(","))
    check(cfg.rm_ensemble == "mean" or n_rm > 1, f"--rm_ensemble {cfg.rm_ensemble} needs --reward_model A,B,..")
    check(cfg.uwo_lambda >= 0, f"--uwo_lambda must be >= 0 (got {cfg.uwo_lambda})")
    check(cfg.rm_ensemble == "uwo" or cfg.uwo_lambda == Config.uwo_lambda, "--uwo_lambda needs --rm_ensemble uwo")
    check(
        not cfg.rm_sigmoid or (cfg.reward_model and cfg.task == "arithmetic"),
        "--rm_sigmoid transforms an arithmetic verifier's score (--task arithmetic --reward_model)",
    )
    check(cfg.value_init != "reward_model" or n_rm == 1, "--value_init reward_model takes one --reward_model")


def setup(cfg):
    """Runtime and run folder; the policy (a resumed run, --init_from, or a new model on --tokenizer: a char tokenizer
    of the data's characters, or of arithmetic's) and the task; the value model; the frozen reference; optimizers and
    loss scaler, restored on --resume. Returns the run's state as a namespace."""
    rt = setup_runtime(cfg)
    out_dir = prepare_out_dir(cfg, "ppo", rt)
    run = SimpleNamespace(cfg=cfg, rt=rt, out_dir=out_dir, stop=GracefulExit(), start_step=0, tokens=0, first_eval=None)
    run.ckpt_path = os.path.join(out_dir, "ckpt.pt")
    text = None
    path = None
    if cfg.task == "next_token":
        path = cfg.data
        if cfg.data == "shakespeare":
            path = cfg.data_path or download(SHAKESPEARE_URL, SHAKESPEARE_PATH)
        text = read_text(path)
    ckpt = None  # a resumed run's checkpoint (an --init_from checkpoint is only weights)
    if cfg.resume or cfg.init_from != "scratch":
        model, spec, loaded = load_model(run.ckpt_path if cfg.resume else cfg.init_from)
        tok = get_tokenizer(spec)
        if cfg.resume:
            ckpt = loaded
    else:
        if cfg.tokenizer == "gpt2":
            tok = BPETokenizer()
        else:
            tok = CharTokenizer(sorted(set(text or ARITHMETIC_CHARS)))
        model = GPT(GPTConfig(cfg.block_size, tok.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, 0.0, True))
    if cfg.task == "next_token":
        if isinstance(tok, CharTokenizer):
            unknown = sorted(set(text) - set(tok.chars))
            check(not unknown, f"{path} has characters {''.join(unknown[:10])!r} outside the model's char vocabulary")
        run.task = NextTokenTask(cfg, tok, text, path)
        prompt_len = cfg.context_len
    elif cfg.task == "arithmetic":
        run.task = ArithmeticTask(cfg, tok, rt)
        prompt_len = (cfg.steps + 1) * (cfg.digits + 1)  # "a*b=" (--steps K: K operations) of the longest numbers
    else:
        run.task = RewardModelTask(cfg, tok, rt)
        prompt_len = cfg.max_prompt_len
    # the learned reward's weights: a resumed run must be scored by the same ones (a checkpoint written before this
    # check has no checksum, and is refused when a reward model is used)
    run.rm_checksum = None if run.task.rm is None else weights_checksum(run.task.rm)  # an ensemble's: all its members'
    check(
        ckpt is None or ckpt.get("rm_checksum") == run.rm_checksum,
        f"--resume: --reward_model {cfg.reward_model!r} is not the reward model the run was trained on",
    )
    model.to(rt.device)
    broadcast_weights(model, rt)  # rank 0's starting weights, which the value model and the reference copy

    # the value model: --value_model shared puts a zero-initialised value head on the policy (the actor; no critic);
    # separate keeps the policy as the actor and builds a GPT body with a scalar head, from the policy (the head at
    # zero, so the first values are 0 and the first advantages plain returns) or from --reward_model
    longest = prompt_len + cfg.horizon  # (a resumed run may ask for a longer --horizon than the value model holds)
    actor = model
    critic = None
    if cfg.value_model == "shared":
        actor = PolicyWithValueHead(model)
    elif ckpt is not None:
        critic = RewardModel(GPTConfig(**ckpt["value_model_config"]))
    elif cfg.value_init == "reward_model":
        critic, _ = frozen_reward_model(cfg, tok, rt, longest)  # its tokenizer and block_size checked
        critic.train()  # loaded frozen, as a reward; unfrozen here: its body and head start the value model
        critic.requires_grad_(True)
    else:
        critic = RewardModel(model.config)
        critic.body.load_state_dict(model.state_dict())
        for p in critic.head.parameters():
            nn.init.zeros_(p)
    value_model = actor.value_head if critic is None else critic  # what ckpt.pt's value_model holds
    if ckpt is not None:
        value_model.load_state_dict(ckpt["value_model"])
    trained = {"actor": actor.to(rt.device)}  # by name: the actor, and a separate value model (the critic)
    if critic is not None:
        trained["critic"] = critic.to(rt.device)
    size = model.config.block_size
    if critic is not None:
        size = min(size, critic.body.config.block_size)
    check(longest <= size, f"prompts + --horizon ({longest}) exceed block_size {size} (policy or value model)")

    # the frozen reference (--reference, auto resolved): never wrapped, never trained, the same on every rank and
    # after a resume (a copy of rank 0's starting weights, or a fixed seed). A policy from scratch on text is noise:
    # there the text's bigram model is the reference.
    run.reference = cfg.reference
    if run.reference == "auto":
        run.reference = "init"
        if cfg.task == "next_token" and cfg.init_from == "scratch":
            run.reference = "bigram"
    run.ref = None
    if run.reference == "bigram":
        run.ref = BigramReference(run.task.train_ids.to(rt.device), model.config.vocab_size)
    elif run.reference in ("random", "init"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 10_000)  # the same random reference on every rank and after a resume
            run.ref = GPT(model.config)
        if run.reference == "init":
            run.ref.load_state_dict(ckpt["reference"] if ckpt is not None else model.state_dict())
        run.ref.to(rt.device).eval().requires_grad_(False)

    # the trained models are wrapped (DDP / FSDP); the raw ones sample, evaluate and are saved
    run.tok = tok
    run.actor = actor
    run.critic = critic
    run.wrapped = {name: wrap_model(m, rt, cfg.compile) for name, m in trained.items()}
    # ppo_step sets their learning rates (--lr, --value_lr) every step
    run.optimizers = {
        name: make_optimizer(m, cfg.lr, cfg.weight_decay, (0.9, 0.99), rt.device) for name, m in trained.items()
    }
    run.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)  # one for both optimizers
    run.kl_ctl = AdaptiveKLController(cfg.beta_kl, cfg.target_kl, cfg.kl_horizon)
    if ckpt is not None:
        run.kl_ctl.value = ckpt["kl_coef"]  # where --adaptive_kl had moved it
        ckpt_key = {"actor": "optimizer", "critic": "value_optimizer"}
        for name, m in trained.items():
            load_optimizer_state(m, run.optimizers[name], ckpt[ckpt_key[name]], rt)
        restore_rng(ckpt, rt)
        # float16 runs' loss scale and growth tracker; a checkpoint without one (older, or another dtype) keeps the new
        run.scaler.load_state_dict(ckpt.get("scaler") or run.scaler.state_dict())
        run.start_step = ckpt["step"]
        run.tokens = ckpt["tokens"]
        run.first_eval = ckpt["first_eval"]
    if rt.master:
        n_value = sum(p.numel() for p in value_model.parameters())
        value = f"{n_value / 1e6:.2f}M ({cfg.value_model}) in the value model"
        print_start(model, rt, run.out_dir, f"{value}, vocab {tok.vocab_size}, {cfg.task}, reference {run.reference}")
    return run


def weights_checksum(model):
    """A fingerprint of a model's weights: the sum of every entry of its state dict, in float64 on the CPU (the same
    on every device). A run saves it in ckpt.pt, and a resumed run compares it with its own model's."""
    return float(sum(v.cpu().double().sum() for v in model.state_dict().values()))


def strip_prefix(state, prefix):
    """The entries of a dict whose key starts with prefix, keyed without it: a submodule's part of a state dict,
    or the eval/ metrics under their short names."""
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def save(run, step):
    """ckpt.pt: the policy under its own keys (any script can --init_from it) and its optimizer, the value model
    (the shared head; or a GPT body and head, its config and optimizer), the reference of --reference init, every
    rank's RNG, and the loop's state. Every rank calls it: under FSDP, gathering the state is collective."""
    rt = run.rt
    actor_sd, optim_sd = training_state(run.actor, run.optimizers["actor"], rt)
    ckpt = {
        "tokens": run.tokens,
        "first_eval": run.first_eval,
        "kl_coef": run.kl_ctl.value,
        "rm_checksum": run.rm_checksum,  # a resume checks --reward_model against it
        "reference": run.ref.state_dict() if run.reference == "init" else None,  # a resume reloads it
    }
    if run.critic is None:  # the shared value head is saved apart from the policy's keys
        model_sd = strip_prefix(actor_sd, "policy.")
        value_sd = strip_prefix(actor_sd, "value_head.")
    else:
        model_sd = actor_sd
        value_sd, value_optim_sd = training_state(run.critic, run.optimizers["critic"], rt)
        ckpt["value_model_config"] = dataclasses.asdict(run.critic.body.config)
        ckpt["value_optimizer"] = value_optim_sd
    rngs = all_rng_states(rt)
    if rt.master:
        ckpt.update(
            model=model_sd,
            model_config=dataclasses.asdict(run.actor.config),
            tokenizer=run.tok.spec,
            step=step,
            optimizer=optim_sd,
            rng=rngs[0],
            rng_ranks=rngs,
            value_model=value_sd,
            config=dataclasses.asdict(run.cfg),
            scaler=run.scaler.state_dict(),
        )
        save_checkpoint(run.ckpt_path, ckpt)


def main():
    cfg = parse_config(Config)
    validate(cfg)
    run = setup(cfg)
    rt = run.rt
    save_config(cfg, run.out_dir, rt)  # every input is checked: from here on the run folder is written
    logger = Logger(cfg, run.out_dir, rt, cfg.max_steps, run.start_step)
    eval_ref = run.ref if isinstance(run.ref, GPT) else None  # the KL of the evaluation needs a model reference
    t_start = time.time()
    last_eval = {}
    for step in range(run.start_step, cfg.max_steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            last_eval, text = run.task.evaluate(run.actor, eval_ref, rt, run.tok, step)
            if not run.first_eval:
                run.first_eval = last_eval
            logger.log(step, {**last_eval, "rl/tokens": run.tokens})
            if rt.master:
                with open(os.path.join(run.out_dir, "samples.txt"), "a") as f:
                    f.write(f"--- step {step}\n{text}\n")
        if step == cfg.max_steps:
            break
        metrics = ppo_step(run, step)
        stop_requested = run.stop.requested(step + 1, rt)
        stop_if_not_finite(metrics["train/loss"], step, run.ckpt_path, rt)
        logger.bar.update(1)
        logger.bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}")
        logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested:
            save(run, step + 1)
        if stop_requested:
            run.stop.exit(step + 1, run.out_dir, rt)
    save(run, cfg.max_steps)
    logger.close()
    if rt.master:
        results = {
            "task": cfg.task,
            "value_model": cfg.value_model,
            "steps": cfg.max_steps,
            "tokens": run.tokens,
            "wall_time_s": time.time() - t_start,
            "before": strip_prefix(run.first_eval, "eval/"),  # eval/accuracy: accuracy
            "after": strip_prefix(last_eval, "eval/"),
        }
        with open(os.path.join(run.out_dir, "final_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        summary = ", ".join(f"{k} {results['before'][k]:.4g} -> {v:.4g}" for k, v in results["after"].items())
        print_end(f"{cfg.task} (ppo, {cfg.value_model} value model): {summary}", run.out_dir, results["wall_time_s"])
    cleanup(rt)


def peak_memory_mb(rt):
    """Peak memory of the step: CUDA's allocator peak, else the process's peak resident set."""
    if rt.device.type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 2**10


# ----------------------------------------------------------------------------------------------------------
# Tasks, behind one contract: the PPO step reads nothing else of a task. A task has
#   eos_id        the token that ends a completion (None: rollouts run the whole horizon)
#   n_ends        a completion ends at its n_ends-th end token (arithmetic --steps K: one step a line)
#   proxy         its reward is a learned stand-in for a gold one that it measures too (rl/gold_reward): the
#                 rollouts' KL to the reference is logged beside it (rl/rollout_kl)
#   sample(n)                                         -> n prompts (token-id lists) and what each one's reward
#                                                        needs (a list of n, or None)
#   rewards(prompts, completion, mask, info)          -> rewards (N, H) and reward_mask (N, H), 1.0 where a reward
#                                                        sits: an outcome reward on the last real token
#                                                        (at_last_token), a dense one on every token, a process
#                                                        reward at each step's end
#   measures(completion, mask, info)                  -> {"rl/accuracy": (N,) or None, "rl/gold_reward": (N,) or None}
#   evaluate(model, ref, rt, tok, step)               -> (eval/ metrics, text for samples.txt)
# docs/grpo.md ("Your own task") writes a new one in one class. The block is copied verbatim from grpo.py, where
# it is read (tests/test_shared_blocks.py).
# ----- BEGIN SHARED BLOCK: tasks (verbatim copy of grpo.py; tests/test_shared_blocks.py) -----
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
