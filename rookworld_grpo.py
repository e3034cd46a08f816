"""
rookworld_grpo.py: GRPO on the RookWorld chess tasks, every reward checked by python-chess and Stockfish.

RookWorld-LM (GPT-2 124M, jrahn/RookWorld-LM-124M) writes chess analysis (P:, the policy task) and simulates the chess
environment (A:, the environment task) as text. For every prompt q the policy samples a group of K completions, a
program scores each against the reference answer, and the rewards become advantages of a clipped surrogate (Shao et
al. 2024, DeepSeekMath), with an exact KL to the frozen starting policy:

    J = agg_{i,t}[ min(r_it A_it, clip(r_it, 1 - eps, 1 + eps_high) A_it) ] - beta * KL_t + c_H * H(pi)
    r_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    KL_t = sum_v pi(v) (log pi(v) - log pi_ref(v)) over the whole vocabulary at every completion position
           (--kl_type forward; reverse: KL(pi_ref || pi); symmetric: the mean of the two)
Rollouts sample from softmax(logits / --temperature) restricted to the --top_k most likely tokens, and every
completion log-prob used for training or logging (pi and pi_old in r, pi in KL_t, the entropy H) is of that sampling
distribution; pi_ref is the reference's softmax(logits / --temperature) over the whole vocabulary (as TRL does), so the
forward KL stays finite (--kl_type reverse or symmetric with --top_k is refused: KL(pi_ref || pi) is infinite there).
Advantages: --adv group: A_i = (R_i - mean_K R) / (std_K R + 1e-4) (group_advantages of grpo.py); --adv ema:
A_i = R_i - b_task with b_task a running mean reward of the prompt's task (P: or A:); --value_head: a scalar head on
the policy's last hidden states, token advantages by GAE (gae of ppo.py) on the reward at the last token, whitened.
--loss_type grpo | dapo | dr_grpo | gspo | cispo | reinforce as in grpo.py (gspo clips at the GSPO paper's 3e-4 / 4e-4
unless --clip_eps is given: its length-normalised sequence ratio stays within 1 +- 0.2); --adaptive_kl moves beta
(from --beta_kl) towards --target_kl (KL per completion) as Ziegler et al. 2019 do (AdaptiveKLController of ppo.py).

The two tasks, one training line each (GPT-2 BPE):
    P:  "P: " + fen.ljust(90) + "M: " + moves.ljust(30) + "E: " + evals.ljust(40) + "B: " + best
        moves: up to 5 UCI moves (Stockfish multipv 5); evals: the side to move's scores in pawns as plain floats (mate
        in n: +-(1000 - n/100)), listed in the same (shuffled) order as the moves; B: the best move.
        The prompt ends after "M:" (the padded FEN and "M:").
    A:  "A: " + fen + "+" + move + "+" + history + "+" + new_fen + "+" + reward + "+" + terminated + "+" + truncated
        history: the last (up to) 10 UCI moves, this one last; reward 0.001 for a legal move, 1.0 when the mover mates,
        0.5 for a draw, -1.0 for an illegal or malformed move (then truncated is 1 and new_fen is the input FEN);
        terminated (0/1) on mate, stalemate, insufficient material, the 75-move rule or fivefold repetition. FENs as
        python-chess writes them. The prompt ends at the third "+".
    Both prompts end on a token boundary of the whole line (ids(prompt) + ids(completion) == ids(line)), the layout
    RookWorld-LM was trained on. Completions end at <|endoftext|> or at a newline, stripped before scoring.

Rewards (score_p, score_a): -0.3 when the completion does not parse; otherwise a raw score in [0, 1], mapped by
--reward_mode ladder to 0.2 (raw < 0.4), 0.4 (< 0.6), 0.6 (< 0.8), 0.8 (< 0.95) or 1.0; continuous keeps raw.
    P:  raw = (4 best + 2 format + 1.5 candidates + 1 evals) / 8.5
        best        1 if B is the target's best move
        format      share of four checks: as many evals as moves, as many moves as the target, B among the moves,
                    no move listed twice
        candidates  share of the generated moves (each counted once) that are among the target's moves
        evals       max(0, 1 - MSE / 100) over the generated moves that are target moves, each eval compared with
                    the target eval of the same move (matched by move, not by position); 0 when no move matches
    A:  raw = (4 format + 3 fen + 2 flags + 1 reward) / 10
        format      1 if python-chess reads the new FEN, else 0.5
        fen         1 for the exact FEN, else 0.5 (1 - Levenshtein distance / length of the longer FEN)
        flags       1 if terminated and truncated are both right
        reward      1 if within 0.01 of the target's reward

Targets: the rest of the data line after the prompt; or, for P: prompts with --stockfish PATH, Stockfish's multipv-5
analysis (one thread, hash cleared before every position, --sf_depth and/or --sf_nodes; a fixed node limit makes it
deterministic), cached per position; --best_move picks the target's B (docs/rookworld_grpo.md).
Data: --data_path, a file of P: and A: lines (a line in neither format is counted and skipped), or
`--make_data N --out FILE`: N lines from games played from the initial position by Stockfish (random moves mixed in,
--random_move_frac; random play without Stockfish), P: lines annotated by Stockfish, A: lines from env_step (a few with
illegal or malformed moves, --illegal_frac). Without --data_path a run makes 1000 such lines in memory.
Where we depart from the originals, on purpose:
  - without Stockfish, --make_data annotates P: lines by a one-ply material count: a stand-in that lets the pipeline
    (and the tests) run anywhere, not chess knowledge;
  - fivefold repetition needs the game's moves: env_step sees it when history holds every move from the initial
    position (as --make_data gives it), never from the 10 moves of an A: line;
  - A: lines of a data file are kept as written, and the ones python-chess disagrees with are counted on stderr;
  - the reference policy is reloaded from --init_from on --resume instead of being stored in every checkpoint (the
    checkpoint holds a checksum of its weights, and a resume whose --init_from changed is refused);
  - the exact KL needs the reference's logits over the vocabulary at every completion token: memory grows with
    rows x tokens x 50,257 (--grad_accum splits the rows); the log-prob passes run over the batch's longest
    completion, not the whole --horizon.
The model, the losses and the reward scorer are hand-written on purpose: reading them is the point.

Commands:
    python rookworld_grpo.py --make_data 2000 --out data/rookworld.txt --stockfish /usr/games/stockfish
    python gpt.py --data data/rookworld.txt --tokenizer gpt2 --n_layer 2 --n_embd 64 --block_size 224 --out_dir out/sft
    python rookworld_grpo.py --init_from out/sft/ckpt.pt --data_path data/rookworld.txt --lr 1e-4 --max_steps 20
    python rookworld_grpo.py --data_path data/rookworld.txt --stockfish /usr/games/stockfish --device cuda  # 124M


docs/rookworld_grpo.md: the implementation details, the flags, every metric, results and their commands.
"""

import argparse
import atexit
import copy
import dataclasses
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import chess.engine  # binds chess too
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
    out_dir: str = ""  # run folder; default out/rookworld_grpo-<YYYYmmdd-HHMMSS>
    data_path: str = ""  # file of RookWorld P: and A: lines (default: 1000 lines made in memory, as --make_data)
    eval_path: str = ""  # held-out P:/A: lines to evaluate on (default: --eval_size of each task held out of the data)
    make_data: int = 0  # write this many P:/A: lines to --out and exit (no training)
    out: str = ""  # make_data: the file to write (never overwritten)
    init_from: str = "jrahn/RookWorld-LM-124M"  # hub id | Hugging Face GPT-2 folder | ckpt.pt of any script (GPT-2 BPE)
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    # targets: Stockfish, and the --make_data games
    stockfish: str = ""  # path of a Stockfish binary: P: targets (and --make_data annotations) from its analysis
    sf_depth: int = 8  # Stockfish depth per position (0: no depth limit)
    sf_nodes: int = 0  # Stockfish node limit per position (0: none); a fixed limit gives deterministic targets
    sf_workers: int = 2  # Stockfish processes, one search thread each
    best_move: str = "stockfish"  # stockfish | rookworld (the original data's B: on black-to-move rows the 5th move)
    random_move_frac: float = 0.25  # make_data: share of moves played at random instead of the engine's best
    illegal_frac: float = 0.05  # make_data: share of A: lines whose move is illegal or malformed
    # task and reward
    task_mix: float = 0.5  # share of P: prompts in a batch (the rest are A:)
    reward_mode: str = "ladder"  # ladder (0.2/0.4/0.6/0.8/1.0) | continuous (the raw score)
    # rollouts
    batch_size: int = 8  # prompts per step per rank
    group_size: int = 8  # completions per prompt (the group)
    horizon: int = 96  # most tokens per completion (P: and A: completions take up to ~80)
    temperature: float = 1.0  # sampling temperature of rollouts
    top_k: int = 0  # sample rollouts among the k most likely tokens (0: all)
    # advantages
    adv: str = "group"  # group (GRPO group advantages) | ema (running mean reward per task as baseline)
    ema_decay: float = 0.9  # adv ema: weight of the old mean
    scale_rewards: str = "group"  # group advantages: group | batch (std of every rank's rewards) | none (Dr. GRPO)
    # loss
    loss_type: str = "grpo"  # grpo | dapo | dr_grpo | gspo | cispo | reinforce
    clip_eps: float = None  # PPO clip range, lower (and upper unless clip_eps_high is set); unset: 0.2, gspo 3e-4
    clip_eps_high: float = None  # upper clip range (DAPO's clip-higher: 0.28); unset or 0: clip_eps, gspo 4e-4
    beta_kl: float = 0.02  # KL coefficient (the start value with --adaptive_kl; 0 without it: no reference model)
    kl_type: str = "forward"  # forward KL(pi || ref) | reverse KL(ref || pi) | symmetric (their mean), exact
    adaptive_kl: bool = False  # adapt beta towards --target_kl (Ziegler et al. 2019)
    target_kl: float = 1.0  # adaptive_kl: target KL per completion (nats, summed over its tokens)
    kl_horizon: int = 10000  # adaptive_kl: horizon in completions
    entropy_coef: float = 0.0  # entropy bonus coefficient
    # value head (PPO-style advantages)
    value_head: bool = False  # a value head on the policy and GAE advantages instead of --adv
    vf_coef: float = 0.1  # value_head: weight of the value loss
    clip_eps_value: float = 0.2  # value_head: clip range of the value loss
    gamma: float = 1.0  # value_head: discount of GAE
    lam: float = 0.95  # value_head: lambda of GAE
    # optimisation
    num_iterations: int = 1  # policy updates per batch of rollouts
    grad_accum: int = 1  # micro-batches per optimizer step (groups are never split)
    max_steps: int = 50  # optimizer steps (batches of rollouts)
    lr: float = 1e-5  # peak learning rate (1e-5 suits RookWorld-LM; ~1e-4 a small model SFT'd here; 1e-3 wrecks it)
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 5  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay on matrices
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    # evaluation, logging, checkpoints
    eval_every: int = 25  # steps between evaluations
    eval_size: int = 64  # held-out prompts per task per evaluation
    log_every: int = 5  # steps between log lines
    save_every: int = 50  # steps between checkpoints (one is always written at the end)
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
# ALGO LOGIC: pure functions, tensors in and tensors out. group_advantages and policy_loss (and join
# and peak_memory_mb below) are copies of grpo.py's; masked_mean, gae, whiten, value_loss and AdaptiveKLController of
# ppo.py's; weights_checksum (below) of dpo.py's (tests/test_shared_blocks.py checks that the copies are identical).


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


def vocab_kl(logp, ref_logp, kind="forward"):
    """Exact KL between the policy and the reference at every position, summed over the whole vocabulary, from
    their log-probabilities (..., V) -> (...), >= 0:
    forward  sum_v pi(v) (log pi(v) - log ref(v))  = KL(pi || ref); a token pi never samples (-inf, outside
             top_k) adds 0, value and gradient
    reverse  sum_v ref(v) (log ref(v) - log pi(v)) = KL(ref || pi); infinite when pi has such tokens
    symmetric their mean."""
    if kind not in ("forward", "reverse", "symmetric"):
        raise ValueError(f"unknown KL type {kind!r}")
    kl = 0.0
    if kind != "reverse":
        p = logp.exp()
        log_ratio = (logp - ref_logp).masked_fill(logp.isinf(), 0)  # 0 * -inf would be NaN
        kl = kl + (p * log_ratio).sum(-1)
    if kind != "forward":
        kl = kl + (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    if kind == "symmetric":
        return kl / 2
    return kl


def logprobs_and_kl(
    logits, targets, ref_logits=None, weights=None, kind="forward", temperature=1.0, top_k=None, ref_head=None, rows=256
):
    """(log p(targets), sum over positions of weights * vocab_kl, entropy of p): (..., V), (...), (..., V), (...) ->
    ((...) float32, scalar float32, (...) float32). p is the sampling distribution
    softmax(sampling_logits(logits, temperature, top_k)) with the target kept (as token_logprobs; the entropy is of
    that distribution, as linear_logprobs' is), the reference softmax(ref_logits / temperature) over the whole
    vocabulary; without ref_logits the KL is 0. A weight 0 (padding) drops a position from the KL. With ref_head
    (V, C), the reference's lm_head weight, ref_logits holds the reference's final hidden states (..., C) and each
    chunk's reference logits are made here, one tensor per chunk.
    One chunk of rows at a time; with a gradient each chunk is recomputed in backward (torch.utils.checkpoint), so
    no (positions, V) float32 tensor is made beyond one chunk's: autograd keeps the logits and the reference logits
    (per chunk, each freed once backward is done with it) and makes the logits' gradient. 256 rows: a float32 chunk
    of GPT-2's vocabulary is 51 MB, and a chunk makes a few such temporaries."""
    flat = logits.flatten(0, -2)  # (M, V)
    y = targets.flatten()  # (M,)
    ref = None
    if ref_logits is not None:
        ref = ref_logits.detach().flatten(0, -2)  # (M, V), or (M, C) with ref_head

    def chunk(x, r, y, w):  # (n, V), (n, V) or None, (n,), (n,) -> (n,), scalar, (n,)
        logp = torch.log_softmax(sampling_logits(x, temperature, top_k, keep=y), -1)  # (n, V)
        finite = logp.masked_fill(logp.isinf(), 0) if top_k else logp  # top_k's p = 0 tokens add 0, not NaN
        entropy = -(logp.exp() * finite).sum(-1)  # (n,)
        target_logp = logp.gather(1, y[:, None])[:, 0]  # (n,)
        if r is None:
            return target_logp, torch.zeros((), device=x.device), entropy
        ref_logp = torch.log_softmax(sampling_logits(r, temperature), -1)  # (n, V)
        return target_logp, (vocab_kl(logp, ref_logp, kind) * w).sum(), entropy

    grad = torch.is_grad_enabled() and flat.requires_grad
    logps = []
    kls = []
    entropies = []
    # split, not flat[i : i + rows]: the backward of a slice is a zero tensor the size of all the logits, per chunk
    for i, x in zip(range(0, len(flat), rows), flat.split(rows)):
        r = None
        w = None
        if ref is not None:
            r = ref[i : i + rows]
            w = weights.detach().flatten()[i : i + rows]
            if ref_head is not None:
                r = r @ ref_head.detach().T  # (n, V)
        args = (x, r, y[i : i + rows], w)
        if grad:  # recomputed in backward, so only one chunk's (n, V) tensors are alive at a time
            logp, kl, entropy = torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        else:
            logp, kl, entropy = chunk(*args)
        logps.append(logp)
        kls.append(kl)
        entropies.append(entropy)
    logp = torch.cat(logps).view(targets.shape)
    kl = torch.stack(kls).sum()
    entropy = torch.cat(entropies).view(targets.shape)
    return logp, kl, entropy


def ema_advantages(rewards, tasks, baselines):
    """--adv ema: each (N,) reward minus the running mean reward of its task (tasks: (N,) indices into the
    (n_tasks,) baselines). Unscaled, as REINFORCE with a baseline."""
    return rewards - baselines[tasks]


def ema_update(baselines, batch_means, present, decay):
    """Running mean reward per task: a task's first batch mean starts it (NaN until then), later batches decay into
    it; tasks without rollouts in this batch (present False) keep their value."""
    new = torch.where(torch.isnan(baselines), batch_means, decay * baselines + (1 - decay) * batch_means)
    return torch.where(present, new, baselines)


def masked_mean(x, mask, num_tokens=None):
    """Mean of x over the positions where mask is 1; num_tokens replaces the count (a global count, when a batch is
    split over micro-batches and ranks, makes the shares sum to the mean of the whole batch)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


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
# ALGO LOGIC: the training step as the algorithm reads (rollouts -> rewards -> advantages -> loss -> update), then
# the functions it calls, in that order.


def rl_step(run, step):
    """One GRPO step, as the algorithm reads: rollouts -> rewards -> advantages -> loss -> update. Returns (metrics,
    whether a stop was requested)."""
    cfg = run.cfg
    rt = run.rt
    t0 = time.time()
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    # 1-3. prompts (--task_mix of them P:), G completions each, their rewards, the sampling policy's log-probs
    n_p = round(cfg.task_mix * cfg.batch_size)  # P: prompts per step; the rest are A:
    prompts = [random.choice(run.train_p) for _ in range(n_p)]
    prompts += [random.choice(run.train_a) for _ in range(cfg.batch_size - n_p)]
    if run.stockfish:
        set_stockfish_targets(prompts, run.stockfish, cfg.best_move)
    batch = sample_groups(prompts, run.model, run.actor, cfg, rt, run.tok, run.stop_ids)
    t_rollout = time.time() - t0
    mask = batch["mask"]
    rewards = batch["rewards"].sum(1)  # (N,): each completion's one reward (on its last real token)
    N = len(rewards)
    # (world * N,): every rank's rewards, rank by rank (each rank's own at its offset, 0 elsewhere; the sum gathers)
    all_rewards = all_reduce(F.pad(rewards, (rt.rank * N, (rt.world_size - 1 - rt.rank) * N)), rt)
    is_task = torch.stack([batch["tasks"] == 0, batch["tasks"] == 1]).float()  # (2, N): P:, A:
    task_rewards = all_reduce(is_task @ rewards, rt)  # (2,): the reward sum of each task over every rank
    task_counts = all_reduce(is_task.sum(1), rt)  # (2,): its completions

    # 4. advantages: GAE on a value head, a running mean reward per task (--adv ema), or group-relative
    if cfg.value_head:
        adv, returns = gae(batch["rewards"], batch["old_values"], mask, cfg.gamma, cfg.lam)  # (N, T), (N, T)
        batch["adv"] = whiten(adv, mask)
        batch["returns"] = returns
    elif cfg.adv == "ema":
        means = task_rewards / task_counts.clamp(min=1)  # (2,)
        present = task_counts > 0  # a task without rollouts in this step keeps its baseline
        run.baselines = ema_update(run.baselines, means, present, cfg.ema_decay)
        batch["adv"] = ema_advantages(rewards, batch["tasks"], run.baselines)  # (N,)
    else:
        # on every rank's rewards: --scale_rewards batch divides by the std of the whole step's (groups never span
        # ranks and every rank has N rows, so this rank's advantages are its rows)
        adv = group_advantages(all_rewards, cfg.group_size, cfg.scale_rewards)  # (world * N,)
        batch["adv"] = adv[rt.rank * N : (rt.rank + 1) * N]
    n_seqs = all_reduce(torch.tensor(float(N), device=rt.device), rt)  # the whole step's completions
    tokens = all_reduce(mask.sum(), rt)  # the whole step's completion tokens
    n_tokens = tokens.clamp(min=1)

    # 5. loss and policy update
    totals, grad_norm = optimize_policy(run, batch, n_seqs, n_tokens)
    run.tokens += int(tokens.item())
    stop_requested = run.stop.requested(step + 1, rt)
    stop_if_not_finite(totals["train/loss"].item(), step, run.ckpt_path, rt)

    # metrics: the loss terms of the last iteration (optimize_policy names them), then every rank's rollouts
    metrics = {name: total.item() for name, total in totals.items()}
    if run.ref is None:
        metrics["rl/exact_kl"] = None  # no reference, no KL
    else:
        metrics["rl/exact_kl"] = (totals["rl/exact_kl"] / n_tokens).item()  # per token
    if not cfg.value_head:
        metrics["rl/value_loss"] = None
    # per task (P:, A:); a task without rollouts in this step gives 0 / 0 = NaN, dropped below
    task_reward = task_rewards / task_counts  # (2,)
    task_valid = all_reduce(is_task @ (rewards != INVALID_REWARD).float(), rt) / task_counts  # (2,) parse (score_*)
    ema = cfg.adv == "ema" and not cfg.value_head
    metrics["rl/reward_p"] = task_reward[0].item()
    metrics["rl/valid_p"] = task_valid[0].item()
    if ema:
        metrics["rl/baseline_p"] = run.baselines[0].item()
    metrics["rl/reward_a"] = task_reward[1].item()
    metrics["rl/valid_a"] = task_valid[1].item()
    if ema:
        metrics["rl/baseline_a"] = run.baselines[1].item()
    metrics["rl/reward_mean"] = all_rewards.mean().item()
    metrics["rl/reward_std"] = all_rewards.std().item() if all_rewards.numel() > 1 else 0.0
    # groups whose rewards are all equal: every step from one reward to the next is 0
    same = all_rewards.view(-1, cfg.group_size).diff(dim=1).eq(0).all(1)  # (world * batch_size,)
    metrics["rl/zero_std_frac"] = same.float().mean().item()
    metrics["rl/completion_len"] = (n_tokens / n_seqs).item()
    metrics["rl/beta"] = run.kl_ctl.value  # the beta this step used
    metrics["rl/truncated_frac"] = (all_reduce(batch["truncated"].float().sum(), rt) / n_seqs).item()
    metrics["rl/tokens"] = run.tokens
    metrics["train/lr"] = lr
    metrics["train/grad_norm"] = grad_norm.item()
    metrics["perf/rollout_tokens_per_s"] = mask.numel() * rt.world_size / max(t_rollout, 1e-9)  # positions sampled
    metrics["perf/rollout_ms"] = 1000 * t_rollout
    metrics["perf/step_ms"] = 1000 * (time.time() - t0)
    metrics["perf/peak_mem_mb"] = peak_memory_mb(rt)
    if cfg.adaptive_kl:  # after the update and its metrics, which used this step's beta
        run.kl_ctl.update(totals["rl/exact_kl"].item() / n_seqs.item(), int(n_seqs.item()))  # KL per completion
    return {k: v for k, v in metrics.items() if v is None or math.isfinite(v)}, stop_requested  # NaN: a task unseen


# The batch that sample_groups returns, one row per completion: N = --batch_size * G rows (this rank's), a group's
# G rows contiguous (rows g*G .. g*G+G-1), P the longest prompt, H the longest completion (<= --horizon).
#   key         shape and type       what it holds; what None means
#   rows        N dicts              the row's prompt record (task, prompt, target, fen, ids, ...), shared by its group
#   texts       N strings            the decoded completions up to their end: what the scorer read
#   seq         (N, P+H) long        left-padded prompt ids, then the completion (tokens after its end included)
#   attn        (N, P+H) bool        False on the left padding. None: no prompt is padded (plain causal attention)
#   mask        (N, H) float         1.0 on real completion tokens, up to and including the end token
#   rewards     (N, H) float         score_record of each completion, on its last real token (0 elsewhere); the
#                                    per-token rewards of grpo.py's task contract
#   reward_mask (N, H) float         1.0 on each completion's last real token, where its reward sits
#   truncated   (N,) bool            True: no end token within --horizon
#   tasks       (N,) long            0 for P:, 1 for A: (the index into per-task tensors and baselines)
#   old_logp    (N, H) float         log-probs under the sampling distribution, fixed over --num_iterations
#   old_values  (N, H) float         the value head's values at sampling time. None: no --value_head
# rl_step adds adv: (N,) per completion, or (N, H) per token with --value_head, and then returns (N, H) too.
def sample_groups(prompts, model, actor, cfg, rt, tok, stop_ids):
    """ALGO LOGIC 1-3: K completions per prompt (groups contiguous), the rewards, then one no-grad pass for the
    sampling policy's log-probs (and values). Returns the batch above."""
    rows = [r for r in prompts for _ in range(cfg.group_size)]  # each prompt G times in a row: a group
    ids = [r["ids"] for r in rows]
    completion, mask, texts = complete_prompts(model, ids, cfg.temperature, cfg.top_k, cfg, rt, tok, stop_ids)
    H = int(mask.sum(1).max().item())  # the longest completion: the log-prob passes cost N * H * vocabulary
    completion = completion[:, :H]  # (N, H)
    mask = mask[:, :H]  # (N, H)
    seq, attn = join(ids, completion)
    rewards = [score_record(r, t, cfg.reward_mode) for r, t in zip(rows, texts)]
    ends = torch.isin(completion, torch.tensor(stop_ids, device=rt.device))  # (N, H)
    batch = {"rows": rows, "texts": texts, "seq": seq, "attn": attn, "mask": mask}
    batch["rewards"], batch["reward_mask"] = at_last_token(torch.tensor(rewards, device=rt.device), mask)
    batch["truncated"] = ~ends.any(1)
    batch["tasks"] = torch.tensor([r["task"] == "A" for r in rows], device=rt.device).long()
    old_logp = []
    old_values = []
    with torch.no_grad():  # micro-batches of the training pass's size: no pass here is larger
        for micro in micro_batches(batch, len(rows) // cfg.grad_accum):
            values, logp, _, _ = policy_pass(actor, None, micro, cfg, rt)
            old_logp.append(logp)
            old_values.append(values)
    batch["old_logp"] = torch.cat(old_logp)
    batch["old_values"] = torch.cat(old_values) if cfg.value_head else None
    return batch


def complete_prompts(model, prompts, temperature, top_k, cfg, rt, tok, stop_ids):
    """Completions (N, n <= --horizon) of token-id prompts by generate() of the model block, their mask (1.0 up to
    and including the first end token: <|endoftext|> of RookWorld-LM or the newline of a model SFT'd by gpt.py on a
    file of lines) and their texts. Under FSDP every forward pass is collective, so there every rank samples the
    whole horizon (no early stop when its own rows have ended); the mask is made here from the first end token, as
    generate() makes it when it is given the end tokens. The model samples in train mode: it has no dropout
    (load_model's default), so train and eval modes compute the same."""
    collective = rt.distributed and rt.parallel == "fsdp"
    eos_id = None if collective else stop_ids
    with rt.autocast():
        # (N, n); rt.decode: the decode step, compiled under --compile
        completion, _ = generate(model, prompts, cfg.horizon, temperature, top_k, eos_id, decode=rt.decode)
    ends = torch.isin(completion, torch.tensor(stop_ids, device=completion.device)).long()  # (N, n)
    mask = (ends.cumsum(1) - ends == 0).float()  # (N, n): no end token before this one
    texts = [end_of_completion(tok.decode(t[m > 0].tolist())) for t, m in zip(completion.cpu(), mask.cpu())]
    return completion, mask, texts


def at_last_token(rewards, mask):
    """Outcome rewards (N,) as the contract's per-token rewards: each on its completion's last real token (the end
    token when there is one), with that reward mask; (N, H) each. mask is 1.0 on the real tokens, a prefix of each
    row."""
    last = mask - F.pad(mask[:, 1:], (0, 1))  # (N, H) 1.0 where each row's mask ends
    return rewards[:, None] * last, last


def join(prompts, completion):
    """Left-padded prompts followed by the completions: ids (N, P+H) and the attention mask (None when no row is
    padded, which keeps plain causal attention)."""
    idx, attn = left_pad(prompts, completion.device)
    seq = torch.cat([idx, completion], 1)  # (N, P+H)
    attn = torch.cat([attn, torch.ones_like(completion, dtype=torch.bool)], 1)  # (N, P+H)
    return seq, None if attn.all() else attn


def micro_batches(batch, size):
    """The batch's per-row tensors, `size` rows at a time (whole groups); an entry that is None is left out."""
    for i in range(0, len(batch["seq"]), size):
        yield {k: v[i : i + size] for k, v in batch.items() if torch.is_tensor(v)}


def policy_pass(model, ref, micro, cfg, rt):
    """ALGO LOGIC: the value head's values (None for a plain GPT), the completion tokens' log-probs under the
    sampling distribution (--temperature, --top_k), the exact KL to the reference over the vocabulary summed over the
    real tokens (0 without a reference) and the entropy per token, for a micro-batch of rollouts. The completion is
    the last T tokens of seq; its log-probs come from the states before each token."""
    seq = micro["seq"]  # (n, P+T)
    mask = micro["mask"]  # (n, T)
    T = mask.size(1)
    inputs = seq[:, :-1]
    targets = seq[:, -T:]
    attn = micro.get("attn")  # (n, P+T), or None (not in micro): no row is padded
    if attn is not None:
        attn = attn[:, :-1]
    ref_h = None
    ref_head = None
    with rt.autocast():
        logits, values = model(inputs, attention_mask=attn, keep_last=T)  # (n, T, V), (n, T) or None
        if ref is not None:
            with torch.no_grad():  # the reference's final hidden states (n, T, C)
                ref_h = ref(inputs, attention_mask=attn, keep_last=T, output="hidden")[0]
            ref_head = ref.lm_head.weight  # the reference logits are made from ref_h chunk by chunk
    logp, kl_sum, entropy = logprobs_and_kl(
        logits, targets, ref_h, mask, cfg.kl_type, cfg.temperature, cfg.top_k, ref_head
    )
    return values, logp, kl_sum, entropy


class ValueHeadGPT(nn.Module):
    """--value_head: the policy with a scalar head on its final hidden states. forward returns (logits, values)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        self.v_head = nn.Linear(gpt.config.n_embd, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    @property
    def transformer(self):  # what wrap_model shards
        return self.gpt.transformer

    def forward(self, idx, attention_mask=None, keep_last=0):
        h, _ = self.gpt(idx, attention_mask=attention_mask, output="hidden", keep_last=keep_last)  # (B, T, C)
        logits = self.gpt.lm_head(h)  # (B, T, V)
        values = self.v_head(h).squeeze(-1).float()  # (B, T)
        return logits, values


def optimize_policy(run, batch, n_seqs, n_tokens):
    """ALGO LOGIC 5: --num_iterations optimizer steps over the same rollouts (old_logp fixed), each over
    --grad_accum micro-batches of whole groups. The loss is policy_loss + beta * KL - entropy_coef * entropy +
    vf_coef * value loss, with beta run.kl_ctl's; every normaliser counts the whole step (all micro-batches and
    ranks), so the micro-batch losses add up to the step's loss. Returns the last iteration's sums over every rank,
    by metric name (train/loss, rl/exact_kl: here the KL summed over the step's tokens, rl/entropy, rl/clip_frac,
    rl/ratio_mean, rl/pg_loss, rl/value_loss), and its gradient norm."""
    cfg = run.cfg
    rt = run.rt
    n_micro = len(batch["seq"]) // cfg.grad_accum  # rows per micro-batch: whole groups
    for _ in range(cfg.num_iterations):
        sums = {}  # this rank's share of each stat, summed over the micro-batches
        for i, micro in enumerate(micro_batches(batch, n_micro)):
            grad_sync(run.policy, i == cfg.grad_accum - 1)
            m = micro["mask"]
            values, logp, kl_sum, entropy = policy_pass(run.policy, run.ref, micro, cfg, rt)
            pg_loss, stats = policy_loss(
                logp,
                micro["old_logp"],
                micro["adv"],
                m,
                cfg.loss_type,
                clip_eps=cfg.clip_eps,
                clip_eps_high=cfg.clip_eps_high,
                max_len=cfg.horizon,
                num_seqs=n_seqs,
                num_tokens=n_tokens,
            )
            if cfg.entropy_coef == 0:  # no bonus: the entropy is only logged, without a gradient
                entropy = entropy.detach()
            entropy = masked_mean(entropy, m, n_tokens)
            v_loss = torch.zeros((), device=rt.device)
            if values is not None:
                v_loss = value_loss(values, micro["old_values"], micro["returns"], m, cfg.clip_eps_value, n_tokens)
            # the KL at every position (padding weighted 0), the entropy bonus, the value loss
            loss = pg_loss + run.kl_ctl.value * kl_sum / n_tokens - cfg.entropy_coef * entropy + cfg.vf_coef * v_loss
            run.scaler.scale(loss * rt.world_size).backward()  # DDP averages gradients over ranks
            # the stats' share of the step: its tokens, or for gspo (per-sequence stats) its sequences
            share = len(m) / n_seqs if cfg.loss_type == "gspo" else m.sum() / n_tokens
            shares = {
                "train/loss": loss,
                "rl/exact_kl": kl_sum,  # summed over the step's tokens: rl_step divides
                "rl/entropy": entropy,
                "rl/clip_frac": stats["clip_frac"] * share,
                "rl/ratio_mean": stats["ratio_mean"] * share,
                "rl/pg_loss": pg_loss,
                "rl/value_loss": v_loss,
            }
            for name, value in shares.items():
                sums[name] = sums.get(name, 0.0) + value.detach().float()
        run.scaler.unscale_(run.optimizer)
        grad_norm = clip_grad_norm(run.policy, cfg.grad_clip)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    # each rank's shares are normalised by the whole step's counts: their sum over ranks is the step's value
    totals = all_reduce(torch.stack(list(sums.values())), rt)  # one collective for them all
    return dict(zip(sums, totals)), grad_norm


# ----------------------------------------------------------------------------------------------------------
# The chess tasks: the environment (A:) and the analysis (P:), as python-chess sees them, and the reward scorer

UCI_MOVE = re.compile(r"[a-h][1-8][a-h][1-8][qrbn]?")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
LEGAL_REWARD = 0.001  # a legal move that does not end the game
MATE_REWARD = 1.0  # a move that mates (a move can only win for its mover)
DRAW_REWARD = 0.5  # a move that ends the game drawn
ILLEGAL_REWARD = -1.0  # an illegal or malformed move
INVALID_REWARD = -0.3  # a completion that does not parse
HISTORY_MOVES = 10  # moves shown in an A: line, the current one last
A_PATTERN = re.compile(rf"([^+]*[^+\s][^+]*)\+({NUMBER.pattern})\+([01])\+([01])")  # fen+reward+terminated+truncated
P_PATTERN = re.compile(r"\s*(?:M:)?\s*(?P<moves>.*?)\s*E:\s*(?P<evals>.*?)\s*B:\s*(?P<best>\S+)\s*", re.S)


def game_board(fen, history):
    """The board of fen. When history holds every move from the initial position to fen (as --make_data and the
    tests give it), the board carries the game's move stack, so python-chess sees fivefold repetition; otherwise it
    is the bare position (10 moves of an A: line are too few to repeat a position five times)."""
    board = chess.Board(fen)
    if not history or len(history) != board.ply():
        return board
    game = chess.Board()
    try:
        for move in history:
            game.push_uci(move)
    except ValueError:
        return board
    return game if game.fen() == board.fen() else board


def env_step(fen, move, history=()):
    """One step of the chess environment: (new_fen, reward, terminated, truncated) after `move` (UCI) in `fen`.
    history: the UCI moves that led to fen, oldest first (see game_board). A legal move earns 0.001, 1.0 when it
    mates, 0.5 when the game ends drawn; it terminates on mate, stalemate, insufficient material, the 75-move rule or
    fivefold repetition. An illegal or malformed move earns -1.0, truncates, and leaves the position as it was."""
    board = game_board(fen, history)
    try:
        action = chess.Move.from_uci(move)
    except (ValueError, TypeError):  # chess.InvalidMoveError is a ValueError
        action = None
    if action is None or action not in board.legal_moves:
        return board.fen(), ILLEGAL_REWARD, board.is_game_over(), True
    board.push(action)
    outcome = board.outcome()
    if outcome is None:
        reward = LEGAL_REWARD
    elif outcome.winner is not None:
        reward = MATE_REWARD
    else:
        reward = DRAW_REWARD
    return board.fen(), reward, outcome is not None, False


def format_p_prompt(fen):
    """The P: prompt: "P: ", the FEN padded to 90 columns, then "M:" (the line goes on with " " + moves)."""
    return "P: " + fen.ljust(90) + "M:"


def format_p_completion(moves, evals, best):
    """The rest of a P: line after its prompt; evals are floats in pawns, written as Python writes them."""
    return " " + " ".join(moves).ljust(30) + "E: " + " ".join(str(e) for e in evals).ljust(40) + "B: " + best


def format_a_prompt(fen, move, history):
    """The A: prompt, up to the third "+". history: the UCI moves before this one; the line shows the last 10
    moves including this one."""
    return f"A: {fen}+{move}+{' '.join([*history, move][-HISTORY_MOVES:])}+"


def format_a_completion(new_fen, reward, terminated, truncated):
    """The rest of an A: line after its prompt: new_fen+reward+terminated+truncated (flags as 0/1)."""
    return f"{new_fen}+{reward}+{int(terminated)}+{int(truncated)}"


def parse_p(text):
    """A P: completion (the text after "M:"; a leading "M:" is allowed) as {"moves", "evals", "best"}, or None when
    the format is invalid: no E: or B: part, a move that is not UCI-shaped, an eval that is not a plain number."""
    m = P_PATTERN.fullmatch(text)
    if m is None:
        return None
    moves = m["moves"].split()
    evals = m["evals"].split()
    best = m["best"]
    if not moves or not all(UCI_MOVE.fullmatch(x) for x in [*moves, best]):
        return None
    if not all(NUMBER.fullmatch(e) for e in evals):
        return None
    return {"moves": moves, "evals": [float(e) for e in evals], "best": best}


def parse_a(text):
    """An A: completion (the text after the third "+") as {"fen", "reward", "terminated", "truncated"}, or None when
    it is not four "+"-separated fields: a non-empty FEN, a number, and two 0/1 flags."""
    m = A_PATTERN.fullmatch(text.strip())
    if m is None:
        return None
    fen, reward, terminated, truncated = m.groups()
    return {"fen": fen, "reward": float(reward), "terminated": terminated == "1", "truncated": truncated == "1"}


def edit_distance(a, b):
    """Levenshtein distance between two strings (insertions, deletions and substitutions cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def shape_reward(raw, shape="ladder"):
    """The raw score in [0, 1] as a reward: the ladder 0.2 / 0.4 / 0.6 / 0.8 / 1.0 (bins at 0.4, 0.6, 0.8, 0.95), or
    the raw score itself (continuous)."""
    if shape == "continuous":
        return raw
    if raw < 0.4:
        return 0.2
    if raw < 0.6:
        return 0.4
    if raw < 0.8:
        return 0.6
    if raw < 0.95:
        return 0.8
    return 1.0


def score_p(completion, target, shape="ladder"):
    """Reward of a P: completion against the reference completion (the rest of the training line):
    raw = (4 best + 2 format + 1.5 candidates + 1 evals) / 8.5, -0.3 when it does not parse (module docstring)."""
    got = parse_p(completion)
    want = parse_p(target)
    if got is None:
        return INVALID_REWARD
    moves = got["moves"]
    n = len(moves)
    best = float(got["best"] == want["best"])
    checks = [len(got["evals"]) == n, n == len(want["moves"]), got["best"] in moves, len(set(moves)) == n]
    fmt = sum(checks) / len(checks)
    candidates = len(set(moves) & set(want["moves"])) / len(moves)
    true_eval = dict(zip(want["moves"], want["evals"]))  # evals matched by move: the listed order is shuffled
    errors = [(e - true_eval[m]) ** 2 for m, e in zip(moves, got["evals"]) if m in true_eval]
    evals = max(0.0, 1 - sum(errors) / len(errors) / 100) if errors else 0.0
    return shape_reward((4 * best + 2 * fmt + 1.5 * candidates + 1 * evals) / 8.5, shape)


def readable_fen(fen):
    """Whether python-chess reads fen as a position."""
    try:
        chess.Board(fen)
        return True
    except ValueError:
        return False


def score_a(completion, target, shape="ladder"):
    """Reward of an A: completion against the reference completion: raw = (4 format + 3 fen + 2 flags + 1 reward) / 10,
    -0.3 when it does not parse (module docstring)."""
    got = parse_a(completion)
    want = parse_a(target)
    if got is None:
        return INVALID_REWARD
    new_fen = got["fen"]
    ref_fen = want["fen"]
    fmt = 1.0 if readable_fen(new_fen) else 0.5
    fen = 1.0
    if new_fen != ref_fen:  # partial credit: half of one minus the normalised edit distance
        fen = 0.5 * (1 - edit_distance(new_fen, ref_fen) / max(len(new_fen), len(ref_fen)))
    flags = float(got["terminated"] == want["terminated"] and got["truncated"] == want["truncated"])
    reward = float(abs(got["reward"] - want["reward"]) <= 0.01 + 1e-9)
    return shape_reward((4 * fmt + 3 * fen + 2 * flags + 1 * reward) / 10, shape)


def score_record(record, text, shape="ladder"):
    """The reward of a completion of a record's prompt, by its task's scorer."""
    if record["task"] == "P":
        return score_p(text, record["target"], shape)
    return score_a(text, record["target"], shape)


def best_of_analysis(fen, moves, rule):
    """The best move of an engine's multipv list (best first): its first move, or with rule "rookworld" the original
    data's choice, the last listed move when black is to move."""
    return moves[-1] if rule == "rookworld" and fen.split()[1] == "b" else moves[0]


def split_line(line, best_move="stockfish"):
    """A training line as a record {"task", "prompt", "target", "fen", ...}, cut where its prompt ends, so that
    prompt + target == line (the P: target's B follows --best_move); None for a line in neither format."""
    line = line.rstrip()
    if line.startswith("P: "):
        cut = line.find("M:")
        fen = line[3:cut].strip()
        target = line[cut + 2 :]
        parsed = parse_p(target) if cut > 0 else None
        if parsed is None or not readable_fen(fen) or len(parsed["evals"]) != len(parsed["moves"]):
            return None
        # the best move: as written (--best_move rookworld), or (stockfish) B when it has the highest eval, else the
        # first move with the highest eval (fixes the original data's black-to-move rows)
        moves = parsed["moves"]
        evals = parsed["evals"]
        if best_move == "stockfish" and dict(zip(moves, evals)).get(parsed["best"]) != max(evals):
            target = format_p_completion(moves, evals, moves[evals.index(max(evals))])
        return {"task": "P", "prompt": line[: cut + 2], "target": target, "fen": fen}
    if line.startswith("A: "):
        parts = line[3:].split("+")  # fen, move, history, new_fen, reward, terminated, truncated
        if len(parts) != 7 or not readable_fen(parts[0]) or parse_a("+".join(parts[3:])) is None:
            return None
        fen = parts[0]
        move = parts[1]
        shown = parts[2].split()
        history = shown[:-1] if shown and shown[-1] == move else shown  # the moves before this one
        prompt = "A: " + "+".join(parts[:3]) + "+"
        return dict(task="A", prompt=prompt, target="+".join(parts[3:]), fen=fen, move=move, history=history)
    return None


def end_of_completion(text):
    """A decoded completion up to its end: <|endoftext|> (RookWorld-LM) or a newline (a model SFT'd on a file of
    lines), stripped before scoring."""
    return text.split("<|endoftext|>", 1)[0].split("\n", 1)[0]


# ----------------------------------------------------------------------------------------------------------
# Stockfish, and the --make_data games


class Stockfish:
    """Multipv-5 analysis by a small pool of Stockfish processes (one search thread and a 16 MB hash each; the hash is
    cleared before every position), cached per FEN. Each engine analyses its share of the positions in a thread of
    its own; the threads only wait on the engine processes, which do the work."""

    def __init__(self, path, depth=8, nodes=0, workers=2):
        check(os.path.isfile(path) and os.access(path, os.X_OK), f"--stockfish {path}: not an executable file")
        self.limit = chess.engine.Limit(depth=depth or None, nodes=nodes or None)
        self.engines = []
        self.cache = {}
        atexit.register(self.close)
        for _ in range(workers):
            try:
                self.engines.append(chess.engine.SimpleEngine.popen_uci(path, timeout=30))
                self.engines[-1].configure({"Threads": 1, "Hash": 16})
            except Exception as e:  # not a UCI engine, crashed, no permission
                die(f"--stockfish {path}: cannot start it as a UCI engine ({type(e).__name__})")
        self.pool = ThreadPoolExecutor(workers)

    def _analyse(self, engine, fens):
        out = []
        for fen in fens:  # a new `game` object makes python-chess send ucinewgame, which clears the hash: deterministic
            infos = engine.analyse(chess.Board(fen), self.limit, multipv=5, game=object())
            infos = [i for i in infos if i.get("pv")]
            moves = [i["pv"][0].uci() for i in infos]
            evals = [i["score"].relative.score(mate_score=100000) / 100 for i in infos]  # mate in n: 1000 - n/100
            out.append((moves, evals))
        return out

    def analyse(self, fens):
        """[(moves, evals)] for each FEN: up to 5 UCI moves, best first, and the side to move's evals in pawns."""
        todo = [fen for fen in dict.fromkeys(fens) if fen not in self.cache]
        shares = [todo[i :: len(self.engines)] for i in range(len(self.engines))]
        for share, results in zip(shares, self.pool.map(self._analyse, self.engines, shares)):
            self.cache.update(zip(share, results))
        return [self.cache[fen] for fen in fens]

    def close(self):
        for engine in self.engines:
            engine.close()  # never raises, even for an engine that has died


PIECE_VALUES = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}


def material_analysis(fen):
    """The stand-in for Stockfish: every legal move scored one ply deep by material (mate 999.99, a drawn end 0.0),
    the mover's view, in pawns; the 5 best, best first (ties in python-chess's move order)."""
    board = chess.Board(fen)
    scored = []
    for move in board.legal_moves:
        board.push(move)
        signs = {board.turn: -1, not board.turn: 1}  # the mover's pieces count, the opponent's (now to move) subtract
        value = float(sum(PIECE_VALUES[p.piece_type] * signs[p.color] for p in board.piece_map().values()))
        if board.is_checkmate():
            value = 999.99
        elif board.is_game_over():
            value = 0.0
        board.pop()
        scored.append((value, move.uci()))
    scored.sort(key=lambda s: -s[0])
    return [m for _, m in scored[:5]], [v for v, _ in scored[:5]]


def illegal_attempt(board, rng):
    """A move the environment must refuse: a UCI-shaped illegal move, or now and then a malformed string."""
    if rng.random() < 0.2:
        return rng.choice(["e9e4", "a0a1", "xyz", "e2", "0000", "e7e8k"])
    while True:
        move = "".join(rng.choice("abcdefgh") + rng.choice("12345678") for _ in range(2))
        if move[:2] != move[2:] and chess.Move.from_uci(move) not in board.legal_moves:
            return move


def make_lines(n, rng, stockfish=None, best_move="stockfish", random_move_frac=0.25, illegal_frac=0.05, games=8):
    """n distinct RookWorld lines (P: and A: about half each), shuffled. Games start from the initial position with
    0-8 random plies; then each move is Stockfish's best (the P: analysis), or with probability random_move_frac a
    random legal move. Every position gives a P: line (moves and evals shuffled in pairs, as in the original data)
    and an A: line for the move played from it, or with probability illegal_frac for an illegal or malformed one."""
    lines = {}  # a dict: the lines in the order made, each once
    boards = [None] * games  # the games in play
    openings = [0] * games  # each game's random plies at its start
    while len(lines) < n:
        for g in range(games):
            if boards[g] is None or boards[g].is_game_over() or len(boards[g].move_stack) >= 200:
                boards[g] = chess.Board()
                openings[g] = rng.randint(0, 8)
        fens = [b.fen() for b in boards]
        if stockfish:
            analyses = stockfish.analyse(fens)
        else:
            analyses = [material_analysis(f) for f in fens]
        for board, fen, (moves, evals), opening in zip(boards, fens, analyses, openings):
            history = [m.uci() for m in board.move_stack]
            pairs = list(zip(moves, evals))
            rng.shuffle(pairs)
            shuffled_moves, shuffled_evals = zip(*pairs)
            best = best_of_analysis(fen, moves, best_move)
            lines[format_p_prompt(fen) + format_p_completion(shuffled_moves, shuffled_evals, best)] = None
            random_move = len(history) < opening or rng.random() < random_move_frac
            move = rng.choice([m.uci() for m in board.legal_moves]) if random_move else moves[0]
            attempt = move
            if rng.random() < illegal_frac:
                attempt = illegal_attempt(board, rng)
            step = env_step(fen, attempt, history)  # (new_fen, reward, terminated, truncated)
            lines[format_a_prompt(fen, attempt, history) + format_a_completion(*step)] = None
            board.push_uci(move)
    out = list(lines)[:n]
    rng.shuffle(out)
    return out


def run_make_data(cfg):
    """--make_data N --out FILE: write N lines of both tasks and exit."""
    check(cfg.out, "--make_data needs --out FILE, the file to write")
    check(not os.path.exists(cfg.out), f"--out {cfg.out} already exists; it is never overwritten")
    stockfish = None
    if cfg.stockfish:
        stockfish = Stockfish(cfg.stockfish, cfg.sf_depth, cfg.sf_nodes, cfg.sf_workers)
    t0 = time.time()
    rng = random.Random(cfg.seed)
    lines = make_lines(cfg.make_data, rng, stockfish, cfg.best_move, cfg.random_move_frac, cfg.illegal_frac)
    os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
    if stockfish:  # the engines' threads would keep the process alive
        stockfish.close()
    with open(cfg.out, "x") as f:  # "x": never over an existing file
        f.write("\n".join(lines) + "\n")
    n_p = sum(line.startswith("P: ") for line in lines)
    source = "Stockfish" if stockfish else "a one-ply material count (no --stockfish)"
    print(f"wrote {len(lines)} lines ({n_p} P:) to {cfg.out} in {time.time() - t0:.0f} s; P: annotated by {source}")


# ----------------------------------------------------------------------------------------------------------
# Data


def read_records(path, best_move, master=True):
    """The P: and A: records of a RookWorld text file. A line in neither format is counted and skipped; A: lines that
    python-chess disagrees with are counted (and kept as written). No usable line is an error."""
    lines = [line for line in read_text(path).splitlines() if line.strip()]
    records = [r for r in (split_line(line, best_move) for line in lines) if r is not None]
    bad = len(lines) - len(records)
    check(records, f"{path}: no P: or A: line ({bad} line(s) in neither format)")
    a_records = [r for r in records if r["task"] == "A"]
    steps = [format_a_completion(*env_step(r["fen"], r["move"], r["history"])) for r in a_records]
    disagree = sum(parse_a(step) != parse_a(r["target"]) for step, r in zip(steps, a_records))
    if master and bad:
        print(f"{path}: skipped {bad} line(s) in neither format, kept {len(records)}", file=sys.stderr)
    if master and disagree:
        print(f"{path}: {disagree} A: line(s) differ from python-chess (kept as written)", file=sys.stderr)
    return records


def split_tasks(records):
    """(the P: records, the A: records)."""
    return [r for r in records if r["task"] == "P"], [r for r in records if r["task"] == "A"]


def hold_out(records, eval_size):
    """A fixed held-out set (whatever --seed): up to eval_size records of each task, at most a fifth of it."""
    train = []
    held = []
    for part in split_tasks(records):
        order = random.Random(0).sample(range(len(part)), len(part))
        n = min(eval_size, len(part) // 5)
        held += [part[i] for i in order[:n]]
        train += [part[i] for i in order[n:]]
    return train, held


def set_stockfish_targets(records, stockfish, best_move):
    """P: targets from Stockfish's analysis of each record's position (cached per FEN)."""
    p = [r for r in records if r["task"] == "P" and "sf" not in r]
    for record, (moves, evals) in zip(p, stockfish.analyse([r["fen"] for r in p])):
        if moves:
            record["target"] = format_p_completion(moves, evals, best_of_analysis(record["fen"], moves, best_move))
        record["sf"] = True


# ----------------------------------------------------------------------------------------------------------
# Evaluation


def p_metrics(record, text):
    """Greedy P: completion: parses, B is legal in the position, B equals the target's, share of the target's moves
    listed (the original RookWorld top-5 accuracy)."""
    got = parse_p(text)
    want = parse_p(record["target"])
    if got is None:
        return {"eval/p_format": 0.0, "eval/p_legal_best": 0.0, "eval/p_best_acc": 0.0, "eval/p_top5_acc": 0.0}
    legal_moves = {m.uci() for m in chess.Board(record["fen"]).legal_moves}
    return {
        "eval/p_format": 1.0,
        "eval/p_legal_best": float(got["best"] in legal_moves),
        "eval/p_best_acc": float(got["best"] == want["best"]),
        "eval/p_top5_acc": len(set(got["moves"]) & set(want["moves"])) / len(want["moves"]),
    }


def a_metrics(record, text):
    """Greedy A: completion: parses, the exact new FEN, both flags right, the whole completion exact."""
    got = parse_a(text)
    want = parse_a(record["target"])
    if got is None:
        return {"eval/a_format": 0.0, "eval/a_fen_acc": 0.0, "eval/a_flags_acc": 0.0, "eval/a_line_acc": 0.0}
    flags = (got["terminated"], got["truncated"]) == (want["terminated"], want["truncated"])
    return {
        "eval/a_format": 1.0,
        "eval/a_fen_acc": float(got["fen"] == want["fen"]),
        "eval/a_flags_acc": float(flags),
        "eval/a_line_acc": float(text.strip() == record["target"].strip()),
    }


@torch.no_grad()
def evaluate_held_out(run, step):
    """Greedy completions of the held-out prompts (every rank the same, FSDP's forwards are collective), scored per
    task and logged; the first 3 of each task go to samples.txt."""
    cfg = run.cfg
    texts = []
    chunk = cfg.batch_size * cfg.group_size
    for i in range(0, len(run.held), chunk):
        prompts = [r["ids"] for r in run.held[i : i + chunk]]
        _, _, greedy = complete_prompts(run.model, prompts, 0.0, None, cfg, run.rt, run.tok, run.stop_ids)
        texts += greedy
    found = {"P": [], "A": []}  # each completion's metrics, by task
    shown = {"P": [], "A": []}
    for record, text in zip(run.held, texts):
        task = record["task"]
        reward = score_record(record, text, cfg.reward_mode)
        if task == "P":
            row = p_metrics(record, text)
            row["eval/p_reward"] = reward
        else:
            row = a_metrics(record, text)
            row["eval/a_reward"] = reward
        found[task].append(row)
        shown[task].append(f"{record['prompt']}|{text}\n    target:{record['target']}\n    reward {reward:.2f}")
    metrics = {}
    for rows in found.values():
        if rows:  # a task without held-out prompts logs nothing
            for name in rows[0]:
                metrics[name] = sum(r[name] for r in rows) / len(rows)
    if not run.first_eval:
        run.first_eval = metrics
    run.last_eval = metrics
    run.logger.log(step, {**metrics, "rl/tokens": run.tokens})
    if run.rt.master:
        with open(os.path.join(run.out_dir, "samples.txt"), "a") as f:
            f.write(f"--- step {step}\n" + "\n".join(shown["P"][:3] + shown["A"][:3]) + "\n")


# ----------------------------------------------------------------------------------------------------------
# Setup, checkpoints, main


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
    """Impossible settings: one line naming the flag, exit code 2, before anything is loaded or written."""
    positive = ["batch_size", "horizon", "max_steps", "num_iterations", "grad_accum", "eval_every", "log_every"]
    positive += ["save_every", "sf_workers", "lr", "target_kl", "kl_horizon", "clip_eps", "clip_eps_value"]
    positive += ["temperature"]  # temperature 0 (greedy) would make a group's completions identical
    for name in positive:
        value = getattr(cfg, name)
        check(value > 0, f"--{name} must be positive (got {value})")
    non_negative = ["eval_size", "make_data", "sf_depth", "sf_nodes", "beta_kl", "entropy_coef", "vf_coef"]
    non_negative += ["clip_eps_high", "grad_clip", "weight_decay", "warmup_steps", "top_k"]
    for name in non_negative:
        value = getattr(cfg, name)
        check(value >= 0, f"--{name} must be >= 0 (got {value})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    for name in ["task_mix", "random_move_frac", "illegal_frac", "gamma", "lam"]:
        value = getattr(cfg, name)
        check(0 <= value <= 1, f"--{name} must be in [0, 1] (got {value})")
    check(0 < cfg.ema_decay < 1, f"--ema_decay must be in (0, 1) (got {cfg.ema_decay})")
    choices = {
        "best_move": ["stockfish", "rookworld"],
        "reward_mode": ["ladder", "continuous"],
        "adv": ["group", "ema"],
        "scale_rewards": ["group", "batch", "none"],
        "loss_type": ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "reinforce"],
        "kl_type": ["forward", "reverse", "symmetric"],
    }
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        check(value in allowed, f"--{name} {value!r}: use one of {', '.join(allowed)}")
    smallest = 1 if cfg.adv == "ema" or cfg.value_head else 2  # group advantages compare a group's completions
    check(cfg.group_size >= smallest, f"--group_size must be >= {smallest} with --adv {cfg.adv} (got {cfg.group_size})")
    check(cfg.batch_size % cfg.grad_accum == 0, "--batch_size must be a multiple of --grad_accum (groups stay whole)")
    check(cfg.sf_depth > 0 or cfg.sf_nodes > 0, "Stockfish needs a limit: --sf_depth or --sf_nodes > 0")
    reverse_kl = cfg.kl_type != "forward" and (cfg.beta_kl > 0 or cfg.adaptive_kl)  # top_k: infinite where pi has 0
    check(not (cfg.top_k and reverse_kl), f"--kl_type {cfg.kl_type} with --top_k: KL(ref || pi) is infinite")
    check(not (cfg.value_head and cfg.parallel == "fsdp"), "--value_head runs in one process or under DDP, not FSDP")


def setup_training(cfg):
    """Runtime, run folder, data, models, optimizer and, with --resume, the run's state; every input is checked
    before the run folder is written. Returns `run`, what the training loop reads and updates."""
    rt = setup_runtime(cfg)
    run = SimpleNamespace(cfg=cfg, rt=rt, out_dir=prepare_out_dir(cfg, "rookworld_grpo", rt), stop=GracefulExit())
    run.ckpt_path = os.path.join(run.out_dir, "ckpt.pt")
    run.stockfish = None
    if cfg.stockfish:
        run.stockfish = Stockfish(cfg.stockfish, cfg.sf_depth, cfg.sf_nodes, cfg.sf_workers)
    run.train_p, run.train_a, run.held = load_data(cfg, rt, run.stockfish)
    run.model, run.actor, run.ref, run.ref_checksum, ckpt = load_models(cfg, rt, run.ckpt_path)
    run.tok = BPETokenizer()
    run.stop_ids = [run.tok.eot_id, *run.tok.encode("\n")]
    block_size = run.model.config.block_size
    for record in [*run.train_p, *run.train_a, *run.held]:
        record["ids"] = run.tok.encode(record["prompt"])
        longest = len(record["ids"]) + cfg.horizon
        check(longest <= block_size, f"prompts + --horizon ({longest}) exceed block_size {block_size}")

    run.policy = wrap_model(run.actor, rt, cfg.compile)
    run.optimizer = make_optimizer(run.actor, cfg.lr, cfg.weight_decay, (0.9, 0.99), rt.device)
    run.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    run.kl_ctl = AdaptiveKLController(cfg.beta_kl, cfg.target_kl, cfg.kl_horizon)  # fixed unless --adaptive_kl
    run.baselines = torch.full((2,), float("nan"), device=rt.device)  # --adv ema: running mean reward of P:, A:
    run.start_step = 0
    run.tokens = 0  # completion tokens trained on, over every rank
    run.first_eval = None  # the evaluation before training (final_results.json's "before")
    run.last_eval = {}
    if ckpt is not None:
        load_optimizer_state(run.actor, run.optimizer, ckpt["optimizer"], rt)
        if ckpt.get("scaler"):  # float16: the loss scale and its growth tracker (empty otherwise, absent in older runs)
            run.scaler.load_state_dict(ckpt["scaler"])
        restore_rng(ckpt, rt)
        run.start_step = ckpt["step"]
        run.tokens = ckpt["tokens"]
        run.first_eval = ckpt["first_eval"]
        run.baselines = torch.tensor(ckpt["baselines"], device=rt.device)
        if cfg.adaptive_kl:
            run.kl_ctl.value = ckpt["kl_coef"]
    if rt.master:  # the flags (loss, advantages, targets) are in config.json
        data = f"{len(run.train_p)} P: + {len(run.train_a)} A: training prompts, {len(run.held)} held out"
        print_start(run.model, rt, run.out_dir, data)
    save_config(cfg, run.out_dir, rt)  # every input is checked: from here on the run folder is written
    run.logger = Logger(cfg, run.out_dir, rt, cfg.max_steps, run.start_step)
    return run


def load_data(cfg, rt, stockfish):
    """The P: and A: training records and a fixed held-out set (with --stockfish, its P: targets from Stockfish)."""
    if cfg.data_path:
        records = read_records(cfg.data_path, cfg.best_move, rt.master)
    else:  # the same 1000 lines on every rank and after a resume
        lines = make_lines(1000, random.Random(0), stockfish, cfg.best_move, cfg.random_move_frac, cfg.illegal_frac)
        records = [split_line(line, cfg.best_move) for line in lines]
    if cfg.eval_path:
        train = records
        held = read_records(cfg.eval_path, cfg.best_move, rt.master)
        held = [r for part in split_tasks(held) for r in part[: cfg.eval_size]]
    else:
        train, held = hold_out(records, cfg.eval_size)
    train_p, train_a = split_tasks(train)
    check(train_p or cfg.task_mix == 0, f"--task_mix {cfg.task_mix} needs P: lines; the data has none")
    check(train_a or cfg.task_mix == 1, f"--task_mix {cfg.task_mix} needs A: lines; the data has none")
    if stockfish:
        set_stockfish_targets(held, stockfish, cfg.best_move)
    return train_p, train_a, held


def load_models(cfg, rt, ckpt_path):
    """The policy (a resumed run's, or --init_from: hub, Hugging Face folder, ckpt.pt; GPT-2 BPE only), the actor
    that trains (the policy, with a value head under --value_head) and the frozen reference: the starting policy
    (reloaded from --init_from on --resume, and checked against the checksum the run stored at its start), never
    wrapped, never trained. Returns (model, actor, reference or None, its checksum or None, the resumed checkpoint
    or None)."""
    model, spec, ckpt = load_model(ckpt_path if cfg.resume else cfg.init_from)
    if not cfg.resume:
        ckpt = None  # an --init_from ckpt.pt gives weights, not a run's state
    check(spec == "gpt2", f"--init_from {cfg.init_from}: its tokenizer is not the GPT-2 BPE the RookWorld tasks need")
    ref = None
    ref_checksum = None
    if cfg.beta_kl > 0 or cfg.adaptive_kl:
        ref = copy.deepcopy(model) if ckpt is None else load_model(cfg.init_from)[0]
        ref_checksum = weights_checksum(ref)
        same = ckpt is None or ckpt.get("ref_checksum") in (None, ref_checksum)  # None: no reference, or an older run
        check(same, f"--resume: the reference {cfg.init_from} changed since the run started")
        ref.to(rt.device).eval().requires_grad_(False)
    actor = ValueHeadGPT(model) if cfg.value_head else model
    if ckpt is not None and cfg.value_head:
        actor.v_head.load_state_dict(ckpt["value_head"])
    return model, actor.to(rt.device), ref, ref_checksum, ckpt


def write_checkpoint(run, step):
    """ckpt.pt: the policy as a plain GPT state dict (the value head apart), the optimizer, every rank's RNG, and
    what the loop carries (tokens, the first evaluation, the EMA baselines, beta, the loss scale, the reference's
    checksum). Every rank calls it (FSDP gathers shards); rank 0 writes."""
    model_sd, optim_sd = training_state(run.actor, run.optimizer, run.rt)
    rngs = all_rng_states(run.rt)
    if not run.rt.master:
        return
    ckpt = {
        "step": step,
        "tokens": run.tokens,
        "first_eval": run.first_eval,
        "baselines": run.baselines.tolist(),
        "kl_coef": run.kl_ctl.value,
        "scaler": run.scaler.state_dict(),
        "ref_checksum": run.ref_checksum,
        "model_config": dataclasses.asdict(run.model.config),
        "tokenizer": run.tok.spec,
        "optimizer": optim_sd,
        "rng": rngs[0],
        "rng_ranks": rngs,
        "config": dataclasses.asdict(run.cfg),
    }
    if run.cfg.value_head:  # the actor's keys are gpt.* and v_head.*: the policy is saved as a plain GPT
        ckpt["value_head"] = {k[7:]: v for k, v in model_sd.items() if k.startswith("v_head.")}
        model_sd = {k[4:]: v for k, v in model_sd.items() if k.startswith("gpt.")}
    ckpt["model"] = model_sd
    save_checkpoint(run.ckpt_path, ckpt)


def write_final_results(run, wall_time):
    """The last checkpoint, the curves, and final_results.json: the evaluation before and after training."""
    cfg = run.cfg
    rt = run.rt
    write_checkpoint(run, cfg.max_steps)
    run.logger.close()
    if run.stockfish:  # the engines' threads would keep the process alive
        run.stockfish.close()
    if rt.master:
        adv = "value_head" if cfg.value_head else cfg.adv
        results = dict(loss_type=cfg.loss_type, adv=adv, steps=cfg.max_steps, tokens=run.tokens, wall_time_s=wall_time)
        results["before"] = {k.removeprefix("eval/"): v for k, v in (run.first_eval or {}).items()}
        results["after"] = {k.removeprefix("eval/"): v for k, v in run.last_eval.items()}
        with open(os.path.join(run.out_dir, "final_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        summary = ", ".join(f"{k} {results['before'][k]:.3g} -> {v:.3g}" for k, v in results["after"].items())
        print_end(f"rookworld ({cfg.loss_type}): {summary}", run.out_dir, wall_time)
    cleanup(rt)


def main():
    cfg = resolve_clip(parse_config(Config))
    validate(cfg)
    if cfg.make_data:
        run_make_data(cfg)
        return
    run = setup_training(cfg)
    t_start = time.time()
    for step in range(run.start_step, cfg.max_steps + 1):
        if run.held and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            evaluate_held_out(run, step)
        if step == cfg.max_steps:
            break
        metrics, stop_requested = rl_step(run, step)
        run.logger.bar.update(1)
        run.logger.bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}")
        run.logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested:
            write_checkpoint(run, step + 1)
        if stop_requested:
            run.stop.exit(step + 1, run.out_dir, run.rt)
    write_final_results(run, time.time() - t_start)


def peak_memory_mb(rt):
    """Peak memory of the step: CUDA's allocator peak, else the process's peak resident set."""
    if rt.device.type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 2**10


def weights_checksum(model):
    """A fingerprint of a model's weights: the sum of every entry of its state dict, in float64 on the CPU (the same
    on every device). A run saves it in ckpt.pt, and a resumed run compares it with its own model's."""
    return float(sum(v.cpu().double().sum() for v in model.state_dict().values()))


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
