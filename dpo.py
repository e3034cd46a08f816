"""
dpo.py: direct alignment on preference pairs: DPO and its family, side by side in a few lines each.

DPO (Rafailov et al. 2023) fits a policy to pairs (x, y_c, y_r), y_c preferred, with no reward model and no
sampling: the implicit reward of a response is r = beta * (log pi(y|x) - log pi_ref(y|x)), log-probs summed over
the response tokens, and the loss is a function of a = log-ratio of y_c, b = log-ratio of y_r and h = a - b.
With s = sigmoid, eps = --label_smoothing, x = beta * h, the losses (`--loss_type`), per pair:

    sigmoid    -(1-eps) log s(x) - eps log s(-x)                DPO, Rafailov et al. 2023; eps > 0: cDPO, Mitchell 2023
    robust     ((1-eps)(-log s(x)) + eps log s(-x)) / (1-2eps)      rDPO, Chowdhury et al. 2024
    hinge      max(0, 1 - x)                                        SLiC-HF, Zhao et al. 2023
    ipo        (h' - 1/(2 beta))^2, h' = a/|y_c| - b/|y_r|            IPO, Azar et al. 2023 (per-token log-ratios)
    exo_pair   s(x)(log s(x) - log(1-eps)) + s(-x)(log s(-x) - log eps)   EXO, Ji et al. 2024 (eps = 0 -> 1e-3)
    nca_pair   -log s(beta a) - 1/2 log s(-beta a) - 1/2 log s(-beta b)   NCA, Chen et al. 2024
    bco_pair   -log s(beta a - delta) - log s(-(beta b - delta))          BCO, Jung et al. 2024
    sppo_hard  (a - 1/(2 beta))^2 + (b + 1/(2 beta))^2                    SPPO, Wu et al. 2024
    apo_zero   1 - s(beta a) + s(beta b)                            APO-zero, D'Oosterlinck et al. 2024
    apo_down   s(beta a) + 1 - s(x)                                 APO-down, D'Oosterlinck et al. 2024
    discopop   (1 - m)(-log s(x)) + m exp(-x), m = s(x / tau)       DiscoPOP (LRML), Lu et al. 2024
    simpo      -log s(beta (avg_c - avg_r) - gamma), avg: mean token log-prob, no reference    SimPO, Meng et al. 2024
    sigmoid_norm  sigmoid on x = beta h', h' = a/|y_c| - b/|y_r|       TRL 1.16's DPO on per-token log-ratios
    aot        sigmoid on x = beta (sort(pi_c - pi_r) - sort(ref_c - ref_r)) over the batch   AOT, Melnyk et al. 2024
    aot_unpaired  sigmoid on x = beta (sort(a) - sort(b)) over the batch          unpaired AOT, Melnyk et al. 2024
    orpo       -avg_c - lambda log s(log odds_c - log odds_r), odds = p/(1-p), p = exp(avg)    ORPO, Hong et al. 2024
    kto        chosen w_d (1 - s(beta (a - z0))), rejected w_u (1 - s(beta (z0 - b)))        KTO, Ethayarajh et al. 2024
`--sft_weight w` adds w times the chosen response's mean token NLL to any of them (RPO, Pang et al. 2024).
`--f_divergence` (f-DPO, Wang et al. 2023) puts beta f'(u), u = pi/pi_ref, in place of the log-ratio before the
losses built on h alone (sigmoid, robust, hinge, ipo, exo_pair, discopop, sigmoid_norm; others are refused):

    reverse_kl  f'(u) = log u                            DPO itself (the default)
    forward_kl  f'(u) = 1 - 1/u
    js          f'(u) = log(2u / (1 + u))
    alpha       f'(u) = (u^(alpha-1) - 1) / (alpha - 1)    alpha = --f_alpha in (0, 1)
`--ld_alpha` (LD-DPO, Liu et al. 2024) weighs the tokens of the longer response past the shorter one's length by
ld_alpha; `--ref_sync_steps tau --ref_mixup alpha` (TR-DPO, Gorbatovski et al. 2024) moves the reference to
alpha policy + (1 - alpha) reference after every tau-th step (sync_reference).

Where we depart from the papers or from TRL, on purpose:
  - ipo averages each log-ratio over the response's tokens, as TRL does (its authors confirmed the form with the
    IPO authors); rlhf-book and OpenRLHF sum them;
  - bco_pair's delta is the mean reward of all earlier steps (0 at the first; TRL includes the current
    micro-batch), so the loss does not depend on how a batch is split over micro-batches and ranks;
  - kto is trained on the pairs, unpaired: every chosen response is desirable, every rejected one undesirable; its
    reference point z0 is the mean log-ratio of mismatched rows (the prompt of pair i with the responses of pair i+1),
    averaged over all ranks, clamped at 0 and detached;
  - reward accuracy counts ties as 1/2, so the reference itself scores 0.5;
  - simpo and orpo train without the reference; it is still loaded for eval/logratio_* and --judge;
  - aot and aot_unpaired sort the pairs of one micro-batch of one rank (TRL: of one device's batch), so unlike the
    other losses they change with --grad_accum and the number of ranks;
  - label smoothing applies to sigmoid_norm, aot and aot_unpaired as to sigmoid (TRL smooths aot, not sigmoid_norm).
A pair longer than --max_len loses the start of its prompt, the same tokens for both responses (truncate_pair). The
loss is the sum over pairs divided by the number of pairs of the whole step (all micro-batches and ranks).
The model and the losses are hand-written on purpose: reading them is the point.

Data: HH-RLHF dialogues split at the last "\\n\\nAssistant:", from the hub (`--data`) or a local `--data_path`
.jsonl/.jsonl.gz whose held-out 5% is exactly gpt.py --data hh_sft's. `--data arithmetic`: the starting policy samples
answers to training problems and the exact-answer checker (or a reward_model.py checkpoint, `--judge`) picks chosen
and rejected; a problem is held out iff zlib.crc32(prompt) % 10 == 0, and eval/accuracy counts greedy exact answers
on held-out problems only. `--steps K`: problems of K operations, an answer being K lines, one step a line.

Commands:
    python gpt.py --data hh_sft --data_path hh.jsonl.gz --block_size 256 --out_dir out/sft   # SFT first (CPU)
    python dpo.py --init_from out/sft/ckpt.pt --data_path hh.jsonl.gz --lr 2e-4 --max_steps 40   # CPU, ~5 min
    torchrun --standalone --nproc_per_node=8 dpo.py --init_from gpt2-medium --loss_type ipo --beta 0.5 --parallel fsdp
    python dpo.py --data arithmetic --init_from out/arith/ckpt.pt --lr 3e-4 --sft_weight 1   # a gpt.py arithmetic SFT

docs/dpo.md: every loss's formula, the implementation details, the flags, every metric, results and their commands.
"""

import argparse
import copy
import dataclasses
import functools
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
from collections import Counter
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
    # run
    out_dir: str = ""  # run folder; default out/dpo-<YYYYmmdd-HHMMSS>
    # task: where the preference pairs come from
    data: str = "Anthropic/hh-rlhf"  # hub dataset of chosen/rejected dialogues (train, test), or arithmetic
    data_path: str = ""  # local .jsonl/.jsonl.gz of HH-RLHF records instead of --data (1 in 20 held out)
    digits: int = 1  # arithmetic: most digits per operand
    ops: str = "+-*"  # arithmetic: operators to draw from
    steps: int = 1  # arithmetic: operations per problem (K), evaluated left to right, solved one step a line
    pair_prompts: int = 256  # arithmetic: training problems whose sampled answers give the pairs
    pair_samples: int = 8  # arithmetic: answers sampled per problem (temperature 1); a pair is two of them
    # models: the policy, the reference, a run to continue
    init_from: str = "gpt2"  # policy: ckpt.pt of gpt.py (SFT) or any script, Hugging Face GPT-2 folder, or hub id
    reference: str = ""  # reference model (same forms); default: a frozen copy of the starting policy
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    # loss
    loss_type: str = "sigmoid"  # a loss of the table above: sigmoid, ipo, simpo, kto, ... (LOSS_TYPES)
    f_divergence: str = "reverse_kl"  # f-DPO: f' of reverse_kl (DPO), forward_kl, js or alpha maps the log-ratios
    f_alpha: float = 0.5  # alpha of --f_divergence alpha, in (0, 1): near 0 forward KL, near 1 reverse KL
    ld_alpha: float = 1.0  # LD-DPO: weight of the tokens past the shorter response's length, in [0, 1] (1: off)
    beta: float = 0.1  # inverse temperature of the implicit reward (SimPO: about 2)
    label_smoothing: float = 0.0  # eps: assumed share of flipped labels (sigmoid -> cDPO, robust, exo_pair, simpo)
    gamma: float = 0.0  # SimPO's target reward margin (the paper: gamma / beta about 0.5)
    discopop_tau: float = 0.05  # DiscoPOP's temperature of the log-ratio modulation
    orpo_lambda: float = 0.1  # ORPO's weight of the odds-ratio term
    kto_desirable_weight: float = 1.0  # KTO's weight of desirable (chosen) responses
    kto_undesirable_weight: float = 1.0  # KTO's weight of undesirable (rejected) responses
    sft_weight: float = 0.0  # add this times the chosen response's mean token NLL (RPO)
    precompute_ref: bool = False  # compute the reference log-probs of every pair once, before training
    ref_sync_steps: int = 0  # TR-DPO: every this many steps the reference moves toward the policy (0: off)
    ref_mixup: float = 0.6  # TR-DPO's alpha: the reference becomes alpha policy + (1 - alpha) reference (0: off)
    # batches
    max_len: int = 0  # tokens per sequence (prompt + response; 0: the models' block_size): prompts lose their start
    batch_size: int = 8  # pairs per optimizer step per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    # optimisation
    max_steps: int = 100  # optimizer steps
    lr: float = 1e-5  # peak learning rate (a small model SFT'd by gpt.py takes about 2e-4)
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 10  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay on matrices
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    dropout: float = 0.0  # dropout of the policy (DPO usually trains without)
    # evaluation
    eval_every: int = 25  # steps between evaluations on the held-out pairs
    eval_size: int = 256  # held-out pairs per evaluation (0: all); arithmetic: held-out draws (> 0), distinct kept
    judge: str = ""  # ckpt.pt of reward_model.py: scores greedy responses at the end; arithmetic: also ranks pairs
    judge_prompts: int = 64  # held-out prompts the judge scores
    reward_model: str = ""  # arithmetic: ckpt.pt of reward_model.py whose score of sampled answers eval/ logs (a proxy)
    num_samples: int = 4  # greedy held-out responses written to samples.txt
    sample_tokens: int = 64  # longest greedy response (tokens)
    # logging and checkpoints
    log_every: int = 10  # steps between log lines
    save_every: int = 50  # steps between checkpoints (one is always written at the end)
    # system
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA if supported)
    compile: bool = False  # torch.compile the policy's training forward
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank); also orders the training pairs
    deterministic: bool = False  # torch.use_deterministic_algorithms
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rlhf-gpt"  # wandb project


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: the losses, pure functions of per-sequence log-probs. tests/test_dpo.py checks each
# against its formula and its properties.

# the losses of preference_loss, on the chosen-minus-rejected log-ratios of a pair
PAIR_LOSSES = (
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "simpo",
    "sigmoid_norm",
    "aot",
    "aot_unpaired",
)
LOSS_TYPES = (*PAIR_LOSSES, "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")  # trained without the reference
PER_TOKEN = ("ipo", "simpo", "sigmoid_norm")  # on mean token log-probs or log-ratios: response lengths needed
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")
# the losses of h = a - b alone, whose f-DPO form maps a and b through f' (TRL's set; the others use a or b alone,
# or no reference, or sort the log-ratios)
F_DIVERGENCE_LOSSES = ("sigmoid", "robust", "hinge", "ipo", "exo_pair", "discopop", "sigmoid_norm")


def preference_loss(
    pi_chosen,
    pi_rejected,
    ref_chosen,
    ref_rejected,
    loss_type="sigmoid",
    beta=0.1,
    label_smoothing=0.0,
    chosen_len=None,
    rejected_len=None,
    gamma=0.0,
    bco_delta=0.0,
    discopop_tau=0.05,
    f_divergence="reverse_kl",
    f_alpha=0.5,
):
    """Per-pair losses (B,) from response log-probs (B,) summed over tokens, under the policy (pi_*) and the reference
    (ref_*). Returns (losses, chosen_rewards, rejected_rewards); the rewards are the implicit beta * (pi - ref),
    detached (simpo: beta * mean token log-prob, with chosen_len and rejected_len the response token counts).
    a = pi_chosen - ref_chosen, b = pi_rejected - ref_rejected, h = a - b, x = beta * h; the formulas are the
    docstring's table (s = torch.sigmoid, log s = F.logsigmoid). ipo and sigmoid_norm first average the log-ratios
    per token, a / chosen_len and b / rejected_len (TRL's form; rlhf-book and OpenRLHF sum), and their rewards are beta
    times those averages. f_divergence other than reverse_kl replaces a and b by f'(pi / ref) of that divergence
    (f_prime, with f_alpha), and the rewards by beta times those, f-DPO's implicit rewards. aot and aot_unpaired sort
    across the batch: their loss of a pair depends on the other pairs. bco_delta is BCO's reward shift, a running mean
    of earlier rewards that the caller keeps (the function stays pure); discopop_tau is DiscoPOP's temperature."""
    eps = label_smoothing
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if loss_type in PER_TOKEN and (chosen_len is None or rejected_len is None):
        raise ValueError(f"{loss_type} needs chosen_len and rejected_len")
    if f_divergence != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSSES:
        raise ValueError(f"f_divergence {f_divergence!r} needs a loss of {', '.join(F_DIVERGENCE_LOSSES)}")
    if loss_type == "simpo":  # no reference: the policy's log-probs take the log-ratios' place
        a = pi_chosen
        b = pi_rejected
    else:  # (B,) log-ratios, through f' (reverse_kl: unchanged)
        a = f_prime(pi_chosen - ref_chosen, f_divergence, f_alpha)
        b = f_prime(pi_rejected - ref_rejected, f_divergence, f_alpha)
    if loss_type in PER_TOKEN:
        # per token: simpo's mean token log-probs; ipo's target 1/(2 beta) then does not depend on response lengths
        a = a / chosen_len
        b = b / rejected_len
    h = a - b
    x = beta * h
    if loss_type == "simpo":
        x = x - gamma  # SimPO's target margin gamma
    elif loss_type == "aot":  # the quantiles of the policy's pair margins against the reference's
        x = beta * ((pi_chosen - pi_rejected).sort().values - (ref_chosen - ref_rejected).sort().values)
    elif loss_type == "aot_unpaired":  # the quantiles of the chosen log-ratios against those of the rejected
        x = beta * (a.sort().values - b.sort().values)

    if loss_type in ("sigmoid", "simpo", "sigmoid_norm", "aot", "aot_unpaired"):  # all sigmoid, on their own x
        losses = -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)
    elif loss_type == "robust":  # unbiased under label noise eps (eps < 1/2)
        losses = (-(1 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - x)
    elif loss_type == "ipo":  # regresses h onto 1/(2 beta) instead of pushing it to infinity
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "exo_pair":
        # the reverse KL from the model's pair distribution s(+-x) to the labels (1-eps, eps)
        e = eps or 1e-3  # eps = 0 would put log 0 in the loss
        chosen_term = torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-e))
        rejected_term = torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(e))
        losses = chosen_term + rejected_term
    elif loss_type == "nca_pair":  # absolute rewards, so the chosen one rises, not only the gap
        losses = -F.logsigmoid(beta * a) - 0.5 * F.logsigmoid(-beta * a) - 0.5 * F.logsigmoid(-beta * b)
    elif loss_type == "bco_pair":  # a binary classifier: chosen rewards above delta, rejected ones below
        losses = -F.logsigmoid(beta * a - bco_delta) - F.logsigmoid(-(beta * b - bco_delta))
    elif loss_type == "sppo_hard":
        losses = (a - 1 / (2 * beta)) ** 2 + (b + 1 / (2 * beta)) ** 2
    elif loss_type == "apo_zero":  # anchored: chosen up and rejected down, each against the reference
        losses = 1 - torch.sigmoid(beta * a) + torch.sigmoid(beta * b)
    elif loss_type == "apo_down":  # anchored: both down, the rejected more
        losses = torch.sigmoid(beta * a) + 1 - torch.sigmoid(x)
    else:  # discopop: m exp(-x) as exp(log m - x), so m = 0 never meets exp(-x) = inf
        m = torch.sigmoid(x / discopop_tau)  # (B,) the modulation
        losses = -(1 - m) * F.logsigmoid(x) + torch.exp(F.logsigmoid(x / discopop_tau) - x)
    return losses, (beta * a).detach(), (beta * b).detach()


def f_prime(logratio, f_divergence, f_alpha):
    """f'(u) of an f-divergence at u = pi / pi_ref, from log u (Wang et al. 2023, Table 1, in TRL's forms). With D_f in
    place of DPO's reverse KL, the implicit reward is beta f'(u) (f-DPO, Theorem 1). f_alpha is TRL's alpha, the
    paper's 1 - alpha. Two forms differ from the paper's by a constant c: reverse_kl drops its + 1 (c = -1) and
    forward_kl adds 1 to its -1/u (c = +1); the rewards shift by beta c. The losses of h = a - b cancel c; ipo and
    sigmoid_norm do not: they divide a and b by the response lengths first, so their h shifts by
    c (1/|y_c| - 1/|y_r|) against the paper's form (for reverse_kl their form is TRL's IPO on log u, the usual one).
    The exponent of forward_kl and alpha is capped at the log of the dtype's largest number (88.7228 in float32; alpha:
    less log 1/(1 - f_alpha), which the division then takes back): a log-ratio far below 0 (forward_kl -110, alpha -200
    in float32) would make exp overflow to inf and the loss or its gradient NaN; capped, f' stays finite and that
    log-ratio gets no gradient, while log-ratios within the cap keep their values exactly. TRL 1.16 has no such cap
    (its forward_kl overflows; its alpha clamps the exponent at 80, which also changes values below the overflow)."""
    cap = math.floor(math.log(torch.finfo(logratio.dtype).max) * 1e4) / 1e4  # log of the largest number, rounded down
    if f_divergence == "forward_kl":  # f'(u) = 1 - 1/u
        return 1 - torch.exp((-logratio).clamp(max=cap))
    if f_divergence == "js":  # f'(u) = log(2u / (1 + u))
        return math.log(2) + F.logsigmoid(logratio)
    if f_divergence == "alpha":  # f'(u) = (u^(f_alpha - 1) - 1) / (f_alpha - 1)
        exponent = ((f_alpha - 1) * logratio).clamp(max=cap + math.log(1 - f_alpha))  # |f'| <= the largest number
        return torch.expm1(exponent) / (f_alpha - 1)
    return logratio  # reverse_kl: f'(u) = log u (+ 1)


@torch.no_grad()
def sync_reference(ref, policy, alpha):
    """TR-DPO's reference update (Gorbatovski et al. 2024), in place: every reference weight becomes
    alpha * policy + (1 - alpha) * ref; alpha = 1 copies the policy (the hard update), 0 leaves ref as it is.
    parameters() lists a tied weight once. Under FSDP2 each policy weight is gathered whole: every rank calls it."""
    for r, p in zip(ref.parameters(), policy.parameters()):
        if hasattr(p, "full_tensor"):  # a DTensor shard of FSDP2
            p = p.full_tensor()
        r.lerp_(p, alpha)  # r + alpha (p - r), exact at alpha = 0 and 1


def orpo_loss(avg_logp_chosen, avg_logp_rejected, nll_chosen, lam):
    """ORPO per pair (B,): nll_chosen - lam * log sigmoid(log odds(chosen) - log odds(rejected)), where
    odds = p / (1 - p) of p = exp(mean token log-prob) (no reference). Returns (losses, chosen_rewards,
    rejected_rewards) with rewards lam * mean token log-prob, detached."""
    # log(1 - p), finite for p -> 1
    log1m_chosen = torch.log(-torch.expm1(avg_logp_chosen.clamp(max=-1e-7)))
    log1m_rejected = torch.log(-torch.expm1(avg_logp_rejected.clamp(max=-1e-7)))
    log_odds = (avg_logp_chosen - avg_logp_rejected) - (log1m_chosen - log1m_rejected)
    losses = nll_chosen - lam * F.logsigmoid(log_odds)
    return losses, (lam * avg_logp_chosen).detach(), (lam * avg_logp_rejected).detach()


def kto_loss(logps, ref_logps, desirable, beta, kl_ref, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO per sequence (N,), unpaired: with r = logps - ref_logps and the reference point z0 = kl_ref (detached:
    a baseline, not a target), desirable rows lose w_d (1 - sigmoid(beta (r - z0))), undesirable rows
    w_u (1 - sigmoid(beta (z0 - r))). desirable is a (N,) bool mask. Returns (losses, rewards beta * r detached)."""
    r = logps - ref_logps  # (N,)
    z0 = torch.as_tensor(kl_ref, dtype=r.dtype, device=r.device).detach()
    gain = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    loss = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable, gain, loss), (beta * r).detach()


def pair_losses(cfg, logp, n_tokens, ref_logp, kl_ref=None, bco_delta=0.0):
    """The --loss_type loss per pair (B,) and the chosen and rejected rewards (B,) of B pairs, from the policy's
    summed response log-probs (2B,) and response token counts (2B,) (chosen rows, then rejected rows) and the
    reference's log-probs (None for simpo and orpo). kl_ref is KTO's reference point z0, bco_delta BCO's reward
    shift; --sft_weight adds the chosen response's mean token NLL (RPO)."""
    pi_c, pi_r = logp.chunk(2)  # (B,) each
    len_c, len_r = n_tokens.clamp(min=1).chunk(2)
    if cfg.loss_type == "orpo":
        nll_c = -pi_c / len_c  # the chosen response's mean token NLL
        losses, chosen_r, rejected_r = orpo_loss(pi_c / len_c, pi_r / len_r, nll_c, cfg.orpo_lambda)
    elif cfg.loss_type == "kto":
        desirable = torch.arange(len(logp), device=logp.device) < len(pi_c)  # the chosen rows
        row_losses, rewards = kto_loss(
            logp,
            ref_logp,
            desirable,
            cfg.beta,
            kl_ref,
            desirable_weight=cfg.kto_desirable_weight,
            undesirable_weight=cfg.kto_undesirable_weight,
        )
        losses = 0.5 * sum(row_losses.chunk(2))  # a pair is two unpaired examples: the loss is their mean
        chosen_r, rejected_r = rewards.chunk(2)
    else:
        ref_c = None  # simpo: no reference
        ref_r = None
        if ref_logp is not None:
            ref_c, ref_r = ref_logp.chunk(2)
        losses, chosen_r, rejected_r = preference_loss(
            pi_c,
            pi_r,
            ref_c,
            ref_r,
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            chosen_len=len_c,
            rejected_len=len_r,
            gamma=cfg.gamma,
            bco_delta=bco_delta,
            discopop_tau=cfg.discopop_tau,
            f_divergence=cfg.f_divergence,
            f_alpha=cfg.f_alpha,
        )
    losses = losses - cfg.sft_weight * pi_c / len_c  # RPO: the chosen response's mean token NLL (0: none)
    return losses, chosen_r, rejected_r


def win_score(d):
    """1 where d > 0, 1/2 on a tie (d == 0), else 0: accuracies and win rates count ties as half."""
    return (d > 0).float() + 0.5 * (d == 0).float()


def pair_stats(losses, chosen_r, rejected_r, logp, ref_logp):
    """Per-pair statistics (B,) each, by metric name (train/ and eval/ log their means): the loss, reward accuracy,
    margin, chosen and rejected rewards, chosen and rejected log-probs, and DPO's log-ratio accuracy and margin h
    (0 without reference log-probs)."""
    pi_c, pi_r = logp.detach().chunk(2)
    if ref_logp is None:  # simpo and orpo: every log-ratio counts as 0
        ref_c, ref_r = pi_c, pi_r
    else:
        ref_c, ref_r = ref_logp.chunk(2)
    h = (pi_c - ref_c) - (pi_r - ref_r)  # (B,)
    margin = chosen_r - rejected_r
    return {
        "loss": losses.detach(),
        "reward_acc": win_score(margin),
        "margin": margin,
        "chosen_reward": chosen_r,
        "rejected_reward": rejected_r,
        "chosen_logp": pi_c,
        "rejected_logp": pi_r,
        "logratio_acc": win_score(h),
        "logratio_margin": h,
    }


# ----------------------------------------------------------------------------------------------------------
# The training step: the step's pairs -> log-probs of policy and reference -> per-pair loss -> update. A micro-batch
# of b pairs, as train_step and evaluate hold it (rows: the b chosen responses, then the b rejected ones):
#   rows        (b,) indices of the pairs in their split (the key of --precompute_ref's table)
#   batch       b (prompt, chosen, rejected) texts; encode_pair tokenizes them and cuts them to --max_len
#   logp        (2b,) policy log-probs, summed over each response's tokens
#   n_tokens    (2b,) response token counts
#   ref_logp    (2b,) reference log-probs; None for simpo and orpo (trained without the reference)
#   kl_ref      () KTO's reference point z0, one for the whole step; None for every other loss
#   losses, chosen_r, rejected_r   (b,) per pair (pair_losses)


def train_step(run, step):
    """One optimizer step on the step's pairs (--batch_size per rank); returns its train/ metrics."""
    cfg = run.cfg
    rt = run.rt
    lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    # ALGO LOGIC 1. the step's pairs: ranks take disjoint slices of one fixed order per epoch
    n = len(run.train_pairs)
    start = (step * rt.world_size + rt.rank) * cfg.batch_size  # the run's position of this rank's first pair
    indices = [epoch_order(n, cfg.seed, pos // n)[pos % n] for pos in range(start, start + cfg.batch_size)]
    pairs = [run.train_pairs[i] for i in indices]
    kl_ref = None
    if cfg.loss_type == "kto":  # KTO's reference point, from mismatched pairs
        kl_ref = kto_reference_point(run, pairs)
    n_pairs = cfg.batch_size * rt.world_size  # the loss normaliser: the pairs of the step, on all ranks
    sums = {}  # per-pair statistics summed over the micro-batches, by name
    batches = micro_slices(cfg, indices, pairs)
    for k, (rows, batch) in enumerate(batches):
        grad_sync(run.policy, k == len(batches) - 1)  # DDP: one all-reduce of the gradients, after the last
        # 2. log-probs of chosen and rejected responses: one forward of the policy, the reference without grad.
        # The output layer is called outside the wrapper: DDP and FSDP2 (root unsharded after forward) still see
        # its gradient, as it is the embedding's (tied) weight.
        logp, n_tokens = pair_logprobs(run, run.policy, batch, head=run.model.lm_head)  # (2b,) each
        ref_logp = None
        if cfg.loss_type not in REFERENCE_FREE:
            ref_logp = reference_logprobs(run, "train", rows, batch)  # (2b,)
        # 3. the loss, summed over pairs and divided by the pairs of the whole step (all micro-batches and ranks)
        losses, chosen_r, rejected_r = pair_losses(cfg, logp, n_tokens, ref_logp, kl_ref, run.bco_delta)  # (b,) each
        run.scaler.scale(losses.sum() / n_pairs * rt.world_size).backward()  # DDP averages ranks' gradients
        add_stats(sums, pair_stats(losses, chosen_r, rejected_r, logp, ref_logp))

    # 4. update
    run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(run.policy, cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if cfg.ref_sync_steps and (step + 1) % cfg.ref_sync_steps == 0:  # TR-DPO: the reference follows the policy
        sync_reference(run.ref, run.model, cfg.ref_mixup)
        run.ref_checksum = weights_checksum(run.ref)  # a resumed run checks the synced weights

    mean = pair_means(sums, n_pairs, rt)  # over the step's pairs on all ranks: floats by name
    metrics = {
        "train/loss": mean["loss"],
        "train/reward_acc": mean["reward_acc"],
        "train/margin": mean["margin"],
        "train/chosen_reward": mean["chosen_reward"],
        "train/rejected_reward": mean["rejected_reward"],
        "train/chosen_logp": mean["chosen_logp"],
        "train/rejected_logp": mean["rejected_logp"],
        "train/kto_kl": kl_ref,  # None (not logged) but for kto
    }
    if cfg.loss_type == "bco_pair":  # delta: the running mean of every chosen and rejected reward of earlier steps
        metrics["train/bco_delta"] = run.bco_delta
        n_new = 2 * n_pairs  # a chosen and a rejected reward per pair
        new_sum = (mean["chosen_reward"] + mean["rejected_reward"]) * n_pairs
        new_count = run.bco_count + n_new
        run.bco_delta = (run.bco_delta * run.bco_count + new_sum) / new_count
        run.bco_count = new_count
    run.pairs_seen += n_pairs
    metrics["train/lr"] = lr
    metrics["train/grad_norm"] = grad_norm.item()
    metrics["train/pairs"] = run.pairs_seen
    return metrics


@functools.lru_cache(maxsize=2)
def epoch_order(n, seed, epoch):
    """The order of n training pairs in an epoch: a fixed shuffle per epoch, independent of --resume."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def micro_slices(cfg, *lists):
    """A step's forward passes: consecutive slices of --batch_size // --grad_accum items of each of the lists,
    as [[slice of the first list, slice of the second, ...], ...]."""
    micro = cfg.batch_size // cfg.grad_accum
    return [[items[i : i + micro] for items in lists] for i in range(0, len(lists[0]), micro)]


@torch.no_grad()
def kto_reference_point(run, pairs):
    """KTO's z0: the mean log-ratio of mismatched rows (the prompt of pair i, the responses of pair i+1), over all
    ranks, clamped at 0. The policy's share is detached: z0 is a baseline, not a target."""
    rt = run.rt
    shifted = [(p, c, r) for (p, _, _), (_, c, r) in zip(pairs, pairs[1:] + pairs[:1])]
    total = torch.zeros((), device=rt.device)  # the sum of this rank's log-ratios
    for [rows] in micro_slices(run.cfg, shifted):
        logp, _ = pair_logprobs(run, run.model, rows)
        ref_logp, _ = pair_logprobs(run, run.ref, rows)
        total += (logp - ref_logp).sum()
    z0 = all_reduce(total, rt) / (2 * len(pairs) * rt.world_size)  # every rank has len(pairs) pairs, 2 rows each
    return z0.clamp(min=0)


def pair_logprobs(run, net, pairs, head=None):
    """Summed response log-probs (2B,) and response token counts (2B,) of B pairs under net (the policy, raw or
    wrapped, or the reference): the chosen rows, then the rejected rows, right-padded into one forward pass
    (encode_pair cuts each pair to --max_len). head: the output layer, where net is a DDP/FSDP wrapper (default
    net.lm_head)."""
    cfg = run.cfg
    rt = run.rt
    encoded = [encode_pair(run.tok, *pair, cfg.max_len) for pair in pairs]  # (chosen ids, rejected ids, prompt length)
    chosen_rows = [(chosen, n_prompt) for chosen, _, n_prompt in encoded]
    rejected_rows = [(rejected, n_prompt) for _, rejected, n_prompt in encoded]
    ids, mask = collate(chosen_rows + rejected_rows)  # (2B, T) each
    if cfg.ld_alpha != 1:  # LD-DPO: past the shorter response's length, a token's log-prob counts ld_alpha times
        shared = torch.minimum(*mask.sum(1).chunk(2)).repeat(2)  # (2B,): the pair's shorter response length
        mask[mask.cumsum(1) > shared[:, None]] *= cfg.ld_alpha  # (2B, T)
    if head is None:
        head = net.lm_head
    with rt.autocast():
        return sequence_logprobs(net, head, ids.to(rt.device), mask.to(rt.device))


def collate(rows, pad_id=0):
    """Right-pad (token ids, prompt length) rows into ids (N, T) and the response mask (N, T)."""
    ids = nn.utils.rnn.pad_sequence([torch.tensor(row) for row, _ in rows], batch_first=True, padding_value=pad_id)
    pos = torch.arange(ids.size(1))  # (T,)
    # the response: from the end of the prompt to the end of the row
    mask = torch.stack([(pos >= n_prompt) & (pos < len(row)) for row, n_prompt in rows]).float()  # (N, T)
    return ids, mask


def sequence_logprobs(model, head, ids, mask):
    """Log-probs of right-padded rows ids (N, T) summed over the tokens where mask (N, T) is above 0, each times its
    mask value: 1.0 on the response (LD-DPO: --ld_alpha past the shorter response's length), 0 on prompt and padding.
    Returns (summed log-probs (N,), counts of the tokens summed (N,)). Token t is scored by the
    hidden state at t-1, so padding on the right never reaches a scored token. Only scored positions go through the
    output layer `head` (the model's lm_head, weights tied to the embedding): prompts are most of an HH dialogue,
    and a 50k-vocabulary output layer over them would be most of the compute and memory."""
    h, _ = model(ids[:, :-1], output="hidden")  # (N, T-1, C)
    scored = mask[:, 1:] > 0  # (N, T-1)
    logp = token_logprobs(head(h[scored]), ids[:, 1:][scored]) * mask[:, 1:][scored]  # (n,): every scored token
    row = scored.nonzero()[:, 0]  # (n,): the row of each scored token
    sums = torch.zeros(len(ids), device=ids.device).index_add(0, row, logp)  # (N,)
    return sums, scored.sum(1).float()


def reference_logprobs(run, split, indices, pairs):
    """The reference log-probs (2B,) of pairs (chosen rows, then rejected rows) of split ("train" or "eval"): their
    rows `indices` of the table --precompute_ref made, or without one a forward of the frozen reference (no gradient:
    its weights require none)."""
    if split not in run.ref_cache:
        return pair_logprobs(run, run.ref, pairs)[0]
    table = run.ref_cache[split][indices]  # (B, 2): chosen, rejected
    return table.t().flatten().to(run.rt.device)  # (2B,): chosen, then rejected


def add_stats(sums, stats, weight=None):
    """Add a micro-batch's per-pair statistics (B,), by name, summed over its pairs (each times weight (B,) if given),
    to the running sums, by the same names."""
    table = torch.stack(list(stats.values()), 1)  # (B, k): a column per statistic, all summed in one reduction
    if weight is not None:
        table = table * weight[:, None]
    for name, total in zip(stats, table.sum(0)):
        sums[name] = sums.get(name, 0) + total


def pair_means(sums, n, rt):
    """Sums of per-pair statistics, by name, summed over ranks (one collective for all) and divided by n: floats by
    the same names."""
    total = all_reduce(torch.stack(list(sums.values())), rt) / n
    return dict(zip(sums, total.tolist()))


@torch.no_grad()
def evaluate(run, step, logger):
    """eval/ metrics of the held-out pairs, each rank scoring a share, logged at step and returned; the reference's
    log-probs for every loss type (eval/logratio_* compare runs of different losses). Arithmetic adds eval/accuracy:
    the share of the held-out problems whose greedy answer is exactly right (arithmetic_reward), grpo.py's."""
    cfg = run.cfg
    rt = run.rt
    run.model.eval()
    idx, weight = shard(len(run.eval_pairs), rt)
    mine = [run.eval_pairs[i] for i in idx]
    kl_ref = None
    if cfg.loss_type == "kto":
        kl_ref = kto_reference_point(run, mine)
    sums = {}  # per-pair statistics summed over the micro-batches, by name
    for rows, batch, w in micro_slices(cfg, idx, mine, weight):
        logp, n_tokens = pair_logprobs(run, run.model, batch)
        ref_logp = reference_logprobs(run, "eval", rows, batch)
        losses, chosen_r, rejected_r = pair_losses(cfg, logp, n_tokens, ref_logp, kl_ref, run.bco_delta)
        add_stats(sums, pair_stats(losses, chosen_r, rejected_r, logp, ref_logp), w)  # w: 0 on shard's repeats
    mean = pair_means(sums, len(run.eval_pairs), rt)
    metrics = {
        "eval/loss": mean["loss"],
        "eval/reward_acc": mean["reward_acc"],
        "eval/margin": mean["margin"],
        "eval/chosen_reward": mean["chosen_reward"],
        "eval/rejected_reward": mean["rejected_reward"],
        "eval/chosen_logp": mean["chosen_logp"],
        "eval/rejected_logp": mean["rejected_logp"],
        "eval/logratio_acc": mean["logratio_acc"],
        "eval/logratio_margin": mean["logratio_margin"],
    }
    if run.problems:  # arithmetic: greedy answers to the held-out problems, each rank a share
        idx, weight = shard(len(run.problems), rt)
        answers = respond(run.model, [run.problems[i][0] for i in idx], run.tok, cfg, rt)
        rewards = [arithmetic_reward(text, run.problems[i][1]) for text, i in zip(answers, idx)]
        right = torch.tensor(rewards, device=rt.device)
        n_right = all_reduce((right * weight).sum(), rt)
        metrics["eval/accuracy"] = (n_right / len(run.problems)).item()
        metrics["eval/n_problems"] = len(run.problems)  # distinct, all held out
    if run.rm is not None:
        metrics.update(sampled_measures(run))
    run.model.train()
    logger.log(step, metrics)
    return metrics


@torch.no_grad()
def sampled_measures(run):
    """--reward_model's eval/ metrics, as grpo.py measures over-optimisation: four answers to each held-out problem
    sampled at temperature 1 (a generator of their own), their exact share (over all problems, and over those at even
    and odd places, to pick a peak on one half and report it on the other), the reward model's mean score, and k1
    summed over each answer against the reference, mean (nats). Every rank computes all of it."""
    rows = [problem for problem in run.problems for _ in range(4)]  # four rows a problem, in a row
    generator = torch.Generator(run.rt.device).manual_seed(0)
    texts = respond(run.model, [prompt for prompt, _ in rows], run.tok, run.cfg, run.rt, 1.0, generator)
    right = torch.tensor([arithmetic_reward(text, answer) for text, (_, answer) in zip(texts, rows)])
    per_problem = right.view(-1, 4).mean(1)  # (E,)
    triples = [(prompt, text, text) for text, (prompt, _) in zip(texts, rows)]
    kl = []
    for i in range(0, len(triples), run.cfg.batch_size):
        batch = triples[i : i + run.cfg.batch_size]
        logp = pair_logprobs(run, run.model, batch)[0][: len(batch)]  # (b,): the rows of the first response
        ref_logp = pair_logprobs(run, run.ref, batch)[0][: len(batch)]
        kl.append(logp - ref_logp)
    return {
        "eval/sample_accuracy": per_problem.mean().item(),
        "eval/sample_accuracy_a": per_problem[0::2].mean().item(),
        "eval/sample_accuracy_b": per_problem[1::2].mean().item(),
        "eval/sample_rm_score": judge_scores(run, triples, run.rm)[:, 0].mean().item(),
        "eval/sample_kl": torch.cat(kl).mean().item(),
    }


def shard(n, rt):
    """This rank's equal share of n items as (indices, weights): the last ranks repeat items with weight 0, so
    every rank runs the same number of forward passes (FSDP's forward is collective)."""
    per_rank = math.ceil(n / rt.world_size)
    idx = range(rt.rank * per_rank, (rt.rank + 1) * per_rank)
    indices = [i % n for i in idx]  # past n: the first items again
    weights = torch.tensor([float(i < n) for i in idx], device=rt.device)
    return indices, weights


# ----------------------------------------------------------------------------------------------------------
# Data: HH-RLHF records -> (prompt, chosen, rejected). read_jsonl, split_hh, hh_pairs, encode_pair and truncate_pair
# are copied verbatim in reward_model.py (read_jsonl and split_hh also elsewhere); tests/test_dpo.py checks that both
# give the same results.


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


def truncate_pair(prompt, chosen, rejected, max_len):
    """Cut a pair of token-id lists to fit max_len: (prompt, chosen, rejected) with len(prompt) + len(response) <=
    max_len for both responses. The prompt is cut once, from its start (its end, next to the responses, stays), to
    as many tokens as fit beside the longer response, so both responses are scored on the same context; it never
    becomes empty. A response is cut, from its end, only where even a one-token prompt does not fit beside it."""
    keep = max(1, max_len - max(len(chosen), len(rejected)))  # prompt tokens beside the longer response
    prompt = prompt[-keep:]
    return prompt, chosen[: max_len - len(prompt)], rejected[: max_len - len(prompt)]


def split_hh(text):
    """An HH-RLHF dialogue as (prompt, response): the prompt runs through the last "\\n\\nAssistant:", the response is
    that final Assistant turn. None when there is no Assistant turn or its response is blank."""
    before, turn, response = text.rpartition("\n\nAssistant:")  # turn: "" when there is none
    if not turn or not response.strip():
        return None
    return before + turn, response


def hh_pairs(records):
    """(prompt, chosen, rejected) triples of HH-RLHF records {"chosen": dialogue, "rejected": dialogue}, and a
    dict counting the records skipped for each reason (missing field, no response, prompts differ, identical)."""
    pairs = []
    skipped = {}
    for rec in records:
        chosen = rec.get("chosen")
        rejected = rec.get("rejected")
        if not (isinstance(chosen, str) and isinstance(rejected, str) and chosen and rejected):
            reason = "missing field"
        else:
            c = split_hh(chosen)  # (prompt, response) or None
            r = split_hh(rejected)
            if c is None or r is None:
                reason = "no Assistant response"
            elif c[0] != r[0]:
                reason = "prompts differ"
            elif c[1].strip() == r[1].strip():
                reason = "chosen == rejected"
            else:
                pairs.append((c[0], c[1], r[1]))
                continue
        skipped[reason] = skipped.get(reason, 0) + 1
    return pairs, skipped


def encode_pair(tok, prompt, chosen, rejected, max_len):
    """Token ids of prompt + chosen and of prompt + rejected (each response + <|endoftext|> when the tokenizer has
    one), cut together by truncate_pair, and how many of them are the prompt, which both rows share."""
    end = [tok.eot_id] if tok.eot_id is not None else []
    p, c, r = truncate_pair(tok.encode(prompt), tok.encode(chosen) + end, tok.encode(rejected) + end, max_len)
    return p + c, p + r, len(p)


def load_pairs(cfg, rt):
    """(train, held-out) lists of (prompt, chosen, rejected); rank 0 notes the records skipped. A local file is split
    exactly as gpt.py --data hh_sft splits it (a fixed 5%, whatever --seed), so an SFT checkpoint of gpt.py never saw
    the held-out dialogues."""
    if cfg.data_path:
        records = read_jsonl(cfg.data_path, ["chosen"])  # as gpt.py reads it: the same records, the same split
        order = random.Random(0).sample(range(len(records)), len(records))
        n_val = max(1, len(records) // 20)
        train_records = [records[i] for i in order[n_val:]]
        val_records = [records[i] for i in order[:n_val]]
    else:
        try:
            import datasets
            import huggingface_hub

            if not huggingface_hub.constants.HF_HUB_OFFLINE:  # one quick request: datasets retries for a minute
                huggingface_hub.dataset_info(cfg.data, timeout=10)
            hub = datasets.load_dataset(cfg.data)
            train_records = hub["train"].to_list()  # records {"chosen": ..., "rejected": ...}
            val_records = hub["test"].to_list()
        except Exception as e:
            die(f"cannot load {cfg.data} from the hub ({type(e).__name__}); pass --data_path FILE.jsonl.gz")
    train, skip_train = hh_pairs(train_records)
    val, skip_val = hh_pairs(val_records)
    skipped = Counter(skip_train) + Counter(skip_val)
    summary = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    check(train and val, f"{cfg.data_path or cfg.data}: a split without usable pairs (skipped: {summary or 'none'})")
    if rt.master and summary:
        note(f"skipped records: {summary}; kept {len(train)} train, {len(val)} held-out pairs")
    return train, val


# ----------------------------------------------------------------------------------------------------------
# Data: arithmetic problems and their gold reward, copied verbatim from grpo.py, and the pairs of sampled answers.


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


def answer_tokens(digits, steps):
    """Most tokens a right answer takes, its newlines included, and one more: its characters (a BPE token holds one
    or more). One operation: a result of up to 2 * digits digits (or a sign), a newline. Several: step i's line
    "x op y=r" with x of up to i * digits digits and r of up to (i + 1) * digits, each maybe signed."""
    if steps == 1:
        return 2 * digits + 2
    return digits * steps * (steps + 3) + 5 * steps + 1  # the sum over i of (2 i + 2) * digits + 5, and one


def first_lines(text, k):
    """The text up to and including its k-th newline, or the whole text when it has fewer (an answer of k lines)."""
    return re.match(rf"(?:[^\n]*\n){{,{k - 1}}}[^\n]*\n?", text).group()  # k - 1 lines at most, then one more


def arithmetic_pairs(run, out_dir):
    """--data arithmetic: (train, held-out) pairs (prompt, chosen, rejected). Rank 0 builds them (arithmetic_records)
    and writes them to pairs.jsonl before training, or on --resume reads that file back; every rank gets rank 0's.
    Sets run.problems, the held-out problems, and run.agreement: the share of pairs whose chosen answer is right and
    rejected wrong (1 without --judge)."""
    cfg = run.cfg
    path = os.path.join(out_dir, "pairs.jsonl")
    run.problems = held_out_problems(cfg.digits, cfg.ops, cfg.eval_size, cfg.steps)  # grpo.py's, whatever --seed
    if isinstance(run.tok, CharTokenizer):
        lacking = "".join(sorted(set(f"0123456789=\n{cfg.ops}") - set(run.tok.chars)))
        check(
            not lacking, f"--data arithmetic: the policy's char vocabulary lacks {lacking!r} (a newline ends answers)"
        )
    records = None  # pairs.jsonl's records: rank 0 reads or builds them, then every rank gets them
    if run.rt.master and cfg.resume:
        # chosen or rejected may be an empty answer (a BPE policy's first token <|endoftext|>): not required non-empty
        records = read_jsonl(path, ["split", "prompt", "answer"])
    elif run.rt.master:
        records = arithmetic_records(run)
    records = broadcast_object(records, run.rt)
    train = [(r["prompt"], r["chosen"], r["rejected"]) for r in records if r["split"] == "train"]
    val = [(r["prompt"], r["chosen"], r["rejected"]) for r in records if r["split"] == "heldout"]
    check(train and val, "--data arithmetic: a split without pairs: every problem's answers all right or all wrong")
    # the gold reward: chosen right and rejected wrong
    agree = [
        arithmetic_reward(r["chosen"], r["answer"]) > arithmetic_reward(r["rejected"], r["answer"]) for r in records
    ]
    run.agreement = sum(agree) / len(agree)
    if run.rt.master and not cfg.resume:  # before training: nothing after this can fail on bad input
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return train, val


@torch.no_grad()
def arithmetic_records(run):
    """pairs.jsonl's records {split, prompt, answer, chosen, rejected}: --pair_samples answers of the starting policy
    (temperature 1) to each of --pair_prompts training problems (random.Random(--seed)) and each held-out problem;
    chosen is the answer scored highest, rejected the lowest (the first of equals), by arithmetic_reward or, with
    --judge, by the reward model. Problems whose answers all score the same (all right, all wrong, a tie of the
    judge) give none."""
    cfg = run.cfg
    G = cfg.pair_samples
    rng = random.Random(cfg.seed)
    problems = [("train", *draw_problem(rng, cfg.digits, cfg.ops, False, cfg.steps)) for _ in range(cfg.pair_prompts)]
    problems += [("heldout", *p) for p in run.problems]
    rows = [row for row in problems for _ in range(G)]  # (split, prompt, answer), each problem G times in a row
    prompts = [prompt for _, prompt, _ in rows]
    generator = torch.Generator(run.rt.device).manual_seed(cfg.seed)
    texts = respond(run.model, prompts, run.tok, cfg, run.rt, 1.0, generator, G)  # a problem a batch
    if run.judge is None:  # gold
        scores = [arithmetic_reward(text, answer) for text, (_, _, answer) in zip(texts, rows)]
    else:  # each answer as a pair of itself, twice (as reward_model.py's encode_orm)
        triples = [(prompt, text, text) for prompt, text in zip(prompts, texts)]
        scores = judge_scores(run, triples, run.judge)[:, 0].tolist()
    records = []
    for i in range(0, len(rows), G):
        group = range(i, i + G)  # the rows of one problem
        best = max(group, key=scores.__getitem__)
        worst = min(group, key=scores.__getitem__)
        if scores[best] > scores[worst]:
            split, prompt, answer = rows[best]
            records.append(dict(split=split, prompt=prompt, answer=answer, chosen=texts[best], rejected=texts[worst]))
    return records


def response_tokens(cfg):
    """Tokens of a generated response: --sample_tokens, or arithmetic's longest answer and one more
    (answer_tokens)."""
    return answer_tokens(cfg.digits, cfg.steps) if cfg.data == "arithmetic" else cfg.sample_tokens


def respond(net, prompts, tok, cfg, rt, temperature=0.0, generator=None, batch=0):
    """Responses (text) of a model to prompts, in batches of `batch` (default --batch_size): greedy, or sampled at
    temperature with generator; response_tokens(cfg) tokens, cut at <|endoftext|> (HH) or after the --steps-th
    newline (arithmetic: one step a line). No early stop at the end: under FSDP every rank must run as many forwards.
    Leaves the model in eval mode."""
    net.eval()
    n_tokens = response_tokens(cfg)
    batch = batch or cfg.batch_size
    texts = []
    for i in range(0, len(prompts), batch):
        # each prompt keeps its last block_size - n_tokens tokens: room for the response
        ids = [tok.encode(p)[n_tokens - net.config.block_size :] for p in prompts[i : i + batch]]
        with rt.autocast():
            out, _ = generate(net, ids, n_tokens, temperature, generator=generator)
        for row in out.tolist():
            if tok.eot_id in row:
                row = row[: row.index(tok.eot_id)]
            texts.append(tok.decode(row))
    if cfg.data == "arithmetic":  # an answer ends at its --steps-th newline
        texts = [first_lines(t, cfg.steps) for t in texts]
    return texts


# ----------------------------------------------------------------------------------------------------------
# The judge: reward_model.py's model and loader, copied so that this file stands alone.


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


def load_scorer(run, path, flag):
    """--judge's or --reward_model's reward_model.py checkpoint, whose vocabulary must encode the policy's responses:
    (model, tokenizer)."""
    model, spec, task = load_reward_model(path)
    # a prm labels steps up to the first wrong one: its last token's score judges the last step alone
    check(task != "prm", f"--{flag} {path} is a prm; a whole answer's score at its last token needs an orm")
    tok = get_tokenizer(spec)
    fits = spec == "gpt2" or (run.tok.spec != "gpt2" and set(run.tok.chars) <= set(tok.chars))
    check(fits, f"--{flag} {path}: its char vocabulary cannot encode this policy's responses")
    return model.to(run.rt.device), tok


def judge_scores(run, triples, scorer):
    """A scorer's (load_scorer's) rewards (n, 2) of both responses of (prompt, response, response) triples: each the
    score at its last token, as reward_model.py scores; the two are encoded as a pair, on the same prompt tokens."""
    model, tok = scorer
    block_size = model.body.config.block_size
    pairs = [encode_pair(tok, *triple, block_size) for triple in triples]
    scores = []
    for i in range(0, len(pairs), run.cfg.batch_size):
        # the rows: each pair's first response, then its second
        rows = [row for first, second, _ in pairs[i : i + run.cfg.batch_size] for row in (first, second)]
        ids, _ = collate([(row, 0) for row in rows])
        last = torch.tensor([len(row) - 1 for row in rows])  # each row's last token
        with run.rt.autocast():
            score = model(ids.to(run.rt.device)).cpu()  # (2b, T)
        scores.append(score[torch.arange(len(rows)), last].view(-1, 2))  # (b, 2)
    return torch.cat(scores)


# ----------------------------------------------------------------------------------------------------------
# Setup, the training loop, main()


def validate(cfg):
    positive = ["batch_size", "grad_accum", "max_steps", "eval_every", "log_every", "save_every", "sample_tokens"]
    positive += ["lr", "beta", "discopop_tau", "orpo_lambda", "kto_desirable_weight", "kto_undesirable_weight"]
    positive += ["digits", "steps", "pair_prompts"]
    non_negative = ["eval_size", "judge_prompts", "num_samples", "warmup_steps", "weight_decay"]
    non_negative += ["grad_clip", "sft_weight", "gamma", "ref_sync_steps"]
    for name in positive:
        check(0 < getattr(cfg, name) < math.inf, f"--{name} must be positive (got {getattr(cfg, name)})")
    for name in non_negative:
        check(0 <= getattr(cfg, name) < math.inf, f"--{name} must be >= 0 (got {getattr(cfg, name)})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    check(cfg.loss_type in LOSS_TYPES, f"--loss_type {cfg.loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    check(
        cfg.f_divergence in F_DIVERGENCES, f"--f_divergence {cfg.f_divergence!r}: use one of {', '.join(F_DIVERGENCES)}"
    )
    check(  # reverse_kl is every loss's; another f-divergence needs a loss built on it
        cfg.f_divergence == "reverse_kl" or cfg.loss_type in F_DIVERGENCE_LOSSES,
        f"--f_divergence {cfg.f_divergence} needs a --loss_type of {', '.join(F_DIVERGENCE_LOSSES)}",
    )
    check(0 < cfg.f_alpha < 1, f"--f_alpha must be in (0, 1) (got {cfg.f_alpha})")
    check(0 <= cfg.ld_alpha <= 1, f"--ld_alpha must be in [0, 1] (got {cfg.ld_alpha})")
    check(0 <= cfg.ref_mixup <= 1, f"--ref_mixup must be in [0, 1] (got {cfg.ref_mixup})")
    # TR-DPO moves the starting policy's copy: not another model, nor cached log-probs
    check(
        not cfg.ref_sync_steps or not (cfg.reference or cfg.precompute_ref),
        "--ref_sync_steps: no --reference, no --precompute_ref",
    )
    check(0 <= cfg.label_smoothing < 0.5, f"--label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing})")
    check(0 <= cfg.dropout < 1, f"--dropout must be in [0, 1) (got {cfg.dropout})")
    check(
        cfg.max_len == 0 or cfg.max_len >= 2,
        f"--max_len must be 0 or >= 2: a prompt and a response token (got {cfg.max_len})",
    )
    check(cfg.batch_size % cfg.grad_accum == 0, "--batch_size must be a multiple of --grad_accum")
    check(cfg.loss_type != "kto" or cfg.batch_size >= 2, "--loss_type kto needs --batch_size >= 2: z0 uses other pairs")
    check(not cfg.data_path or os.path.isfile(cfg.data_path), f"data file {cfg.data_path} does not exist")
    check(not cfg.judge or os.path.isfile(cfg.judge), f"--judge {cfg.judge}: no such checkpoint")
    check(not cfg.reward_model or cfg.data == "arithmetic", "--reward_model scores answers of --data arithmetic")
    check(cfg.steps == 1 or cfg.data == "arithmetic", "--steps is for --data arithmetic")
    # eval/sample_kl is the over-optimisation axis: the KL to the SFT model, which a moving reference hides
    check(
        not (cfg.reward_model and cfg.ref_sync_steps),
        "--ref_sync_steps with --reward_model: eval/sample_kl is the KL to the SFT model, not to a moving reference",
    )
    check(not cfg.reward_model or os.path.isfile(cfg.reward_model), f"--reward_model {cfg.reward_model}: no checkpoint")
    check(cfg.ops and set(cfg.ops) <= set("+-*"), f"--ops {cfg.ops!r}: use operators of +-*")
    check(cfg.pair_samples >= 2, "--pair_samples must be >= 2: a pair is two answers to one problem")
    check(cfg.data != "arithmetic" or cfg.eval_size > 0, "--data arithmetic needs --eval_size > 0: held-out problems")


def weights_checksum(model):
    """A fingerprint of a model's weights: the sum of every entry of its state dict, in float64 on the CPU (the same
    on every device). A run saves it in ckpt.pt, and a resumed run compares it with its own model's."""
    return float(sum(v.cpu().double().sum() for v in model.state_dict().values()))


def reference_table(run, ref, pairs):
    """--precompute_ref: the reference log-probs (n, 2) [chosen, rejected] of every pair; each rank computes a
    share, then a sum over ranks fills the table."""
    rt = run.rt
    table = torch.zeros(len(pairs), 2, device=rt.device)
    indices, weight = shard(len(pairs), rt)
    for rows, w in micro_slices(run.cfg, indices, weight):
        logp, _ = pair_logprobs(run, ref, [pairs[j] for j in rows])  # (2b,): chosen rows, then rejected
        table[rows] = logp.view(2, -1).t() * w[:, None]  # (b, 2); a repeated pair adds 0
    return all_reduce(table, rt).cpu()


def setup(cfg, out_dir, rt):
    """The run as a namespace: policy (raw and wrapped), reference, tokenizer, judge, pairs, optimizer, loss scaler, and
    what --resume restores (step, pairs seen, BCO's running mean, cached reference log-probs)."""
    run = SimpleNamespace(cfg=cfg, rt=rt, ckpt_path=os.path.join(out_dir, "ckpt.pt"), problems=[], judge=None, rm=None)
    # the policy: the run's ckpt.pt on --resume, else --init_from; the reference: --reference, else a frozen copy of
    # the starting policy (reloaded from --init_from on --resume)
    model, spec, ckpt = load_model(run.ckpt_path if cfg.resume else cfg.init_from, cfg.dropout)
    reference = cfg.reference or cfg.init_from
    if cfg.reference or cfg.resume:
        ref, ref_spec, _ = load_model(reference)
        check(ref_spec == spec, f"the reference {reference} uses another tokenizer than the policy")
    else:
        ref = copy.deepcopy(model)
    if cfg.resume and "ref_model" in ckpt:  # --ref_sync_steps: the reference as synced when the run stopped
        ref.load_state_dict(ckpt["ref_model"])
    run.ref_checksum = weights_checksum(ref)
    if cfg.resume:
        check(ckpt["ref_checksum"] == run.ref_checksum, f"--resume: the reference {reference} changed")
    block = min(model.config.block_size, ref.config.block_size)
    if not cfg.max_len:  # unset: as long as the models allow
        cfg.max_len = block
    check(cfg.max_len <= block, f"--max_len {cfg.max_len} is longer than the models' block_size {block}")
    prompt_len = 1  # a response needs a prompt token before it; arithmetic: the longest prompt, whole
    if cfg.data == "arithmetic":
        prompt_len = (cfg.steps + 1) * (cfg.digits + 1)
    longest = prompt_len + response_tokens(cfg)
    check(
        longest <= block, f"a prompt and its response (--sample_tokens, or --digits and --steps) exceed {block} tokens"
    )
    run.model = model.to(rt.device)
    run.tok = get_tokenizer(spec)
    ref.to(rt.device).eval().requires_grad_(False)
    if cfg.judge:
        run.judge = load_scorer(run, cfg.judge, "judge")
    if cfg.reward_model:
        run.rm = load_scorer(run, cfg.reward_model, "reward_model")

    # data: pairs as text, tokenized per batch (encode_pair truncates to --max_len)
    if cfg.data == "arithmetic":
        run.train_pairs, run.val_pairs = arithmetic_pairs(run, out_dir)
    else:
        run.train_pairs, run.val_pairs = load_pairs(cfg, rt)
    if isinstance(run.tok, CharTokenizer):
        used = set().union(*(set("".join(pair)) for pair in run.train_pairs + run.val_pairs))
        unknown = used - set(run.tok.chars)
        check(not unknown, f"the data has characters {''.join(sorted(unknown)[:10])!r} outside the model's vocabulary")
    run.eval_pairs = run.val_pairs[: cfg.eval_size or None]

    # state: optimizer, step, BCO's running mean of rewards, cached reference log-probs
    run.policy = wrap_model(run.model, rt, cfg.compile)
    run.optimizer = make_optimizer(run.model, cfg.lr, cfg.weight_decay, (0.9, 0.99), rt.device)
    run.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    run.start_step = 0
    run.pairs_seen = 0
    run.bco_delta = 0.0  # bco_pair's delta: the mean of the rewards counted so far
    run.bco_count = 0  # the chosen and rejected rewards counted
    run.ref_cache = {}  # --precompute_ref: {"train": (n, 2), "eval": (n, 2)} reference log-probs
    if cfg.resume:
        load_optimizer_state(run.model, run.optimizer, ckpt["optimizer"], rt)
        run.scaler.load_state_dict(ckpt.get("scaler") or run.scaler.state_dict())  # float16's loss scale, else empty
        restore_rng(ckpt, rt)
        run.start_step = ckpt["step"]
        run.pairs_seen = ckpt["pairs"]
        run.bco_delta = ckpt["bco_delta"]
        run.bco_count = ckpt["bco_count"]
        run.ref_cache = ckpt.get("ref_logps") or {}  # older checkpoints saved None without --precompute_ref
    if cfg.precompute_ref and not run.ref_cache:
        run.ref_cache = {
            "train": reference_table(run, ref, run.train_pairs),
            "eval": reference_table(run, ref, run.eval_pairs),
        }
    run.ref = ref
    if cfg.precompute_ref and cfg.loss_type != "kto" and run.judge is None and run.rm is None:
        run.ref = None  # every reference log-prob is cached (kto's z0, --judge and --reward_model still need it)
    if rt.master:
        sizes = f"{len(run.train_pairs)} train and {len(run.eval_pairs)} held-out pairs"
        print_start(run.model, rt, out_dir, f"{cfg.loss_type}, {sizes}")
    return run


def save(run, step):
    """ckpt.pt (the format every script reads) and this script's extras: pairs seen, BCO's running mean, the
    reference's checksum and its cached log-probs."""
    model_sd, optim_sd = training_state(run.model, run.optimizer, run.rt)
    rngs = all_rng_states(run.rt)
    if run.rt.master:
        ckpt = {
            "model": model_sd,
            "model_config": dataclasses.asdict(run.model.config),
            "tokenizer": run.tok.spec,
            "step": step,
            "optimizer": optim_sd,
            "scaler": run.scaler.state_dict(),
            "rng": rngs[0],
            "rng_ranks": rngs,
            "config": dataclasses.asdict(run.cfg),
            "pairs": run.pairs_seen,
            "bco_delta": run.bco_delta,
            "bco_count": run.bco_count,
            "ref_checksum": run.ref_checksum,
            "ref_logps": run.ref_cache,
        }
        if run.cfg.ref_sync_steps:  # TR-DPO: the reference as synced, which --reference no longer holds
            ckpt["ref_model"] = run.ref.state_dict()
        save_checkpoint(run.ckpt_path, ckpt)


def train(cfg, out_dir, rt):
    """One DPO-family run into out_dir: the training loop, then held_out_outputs. Returns the final results."""
    stop = GracefulExit()
    run = setup(cfg, out_dir, rt)
    save_config(cfg, out_dir, rt)  # every input is checked: from here on the run folder is written
    logger = Logger(cfg, out_dir, rt, cfg.max_steps, run.start_step)
    t_start = time.time()
    last_eval = {}
    for step in range(run.start_step, cfg.max_steps):
        if step % cfg.eval_every == 0:
            last_eval = evaluate(run, step, logger)
        t0 = time.time()
        metrics = train_step(run, step)
        stop_requested = stop.requested(step + 1, rt)
        stop_if_not_finite(metrics["train/loss"], step, run.ckpt_path, rt)
        dt = time.time() - t0
        logger.bar.update(1)
        logger.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{last_eval.get('eval/reward_acc', 0):.3f}")
        metrics["perf/pairs_per_s"] = cfg.batch_size * rt.world_size / dt
        metrics["perf/step_ms"] = 1000 * dt
        logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or stop_requested or step + 1 == cfg.max_steps:
            save(run, step + 1)
        if stop_requested:
            stop.exit(step + 1, out_dir, rt)
    last_eval = evaluate(run, cfg.max_steps, logger)
    return held_out_outputs(run, out_dir, logger, last_eval, t_start)


def held_out_outputs(run, out_dir, logger, last_eval, t_start):
    """After training: greedy responses of policy and reference to held-out prompts (every rank takes part: under
    FSDP the forward is collective), the judge's win rate, final_results.json and samples.txt. Returns the final
    results: last_eval without eval/ and the run's counts."""
    cfg = run.cfg
    rt = run.rt
    n_prompts = max(cfg.num_samples, cfg.judge_prompts if cfg.judge else 0)
    prompts = [prompt for prompt, _, _ in run.val_pairs[:n_prompts]]
    responses = respond(run.model, prompts, run.tok, cfg, rt)
    ref_responses = None  # no reference model: --precompute_ref cached its log-probs
    if run.ref is not None:
        ref_responses = respond(run.ref, prompts, run.tok, cfg, rt)
    if run.judge is not None:
        scores = judge_scores(run, list(zip(prompts, responses, ref_responses)), run.judge)  # (n, 2): policy, ref
        win_rate = win_score(scores[:, 0] - scores[:, 1]).mean().item()
        last_eval["eval/win_rate"] = win_rate
        logger.log(cfg.max_steps, {"eval/win_rate": win_rate})
    logger.close()
    results = {
        "loss_type": cfg.loss_type,
        "steps": cfg.max_steps,
        "pairs": run.pairs_seen,
        "train_pairs": len(run.train_pairs),
        "heldout_pairs": len(run.eval_pairs),
        "wall_time_s": time.time() - t_start,
    }
    for name, value in last_eval.items():
        results[name.removeprefix("eval/")] = value
    if rt.master and run.problems:  # arithmetic: greedy accuracy at step 0 (first line of metrics.jsonl), pairs
        results["accuracy_before"] = read_metrics(logger.path)[0]["eval/accuracy"]
        results["heldout_problems"] = len(run.problems)
        results["gold_agreement"] = run.agreement
    if rt.master:  # samples.txt: held-out prompts, the greedy responses of policy and reference, the chosen one
        with open(os.path.join(out_dir, "samples.txt"), "w") as f:
            for i, (prompt, chosen, _) in enumerate(run.val_pairs[: cfg.num_samples]):
                f.write(f"=== held-out prompt {i} (last 400 characters)\n{prompt[-400:]}\n")
                f.write(f"--- policy (greedy)\n{responses[i]}\n")
                if ref_responses is not None:
                    f.write(f"--- reference (greedy)\n{ref_responses[i]}\n")
                f.write(f"--- chosen in the data\n{chosen}\n\n")
        with open(os.path.join(out_dir, "final_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        keys = ("accuracy_before", "accuracy", "gold_agreement", "reward_acc", "margin", "logratio_acc", "win_rate")
        summary = "held-out " + ", ".join(f"{k} {results[k]:.4f}" for k in keys if k in results)
        print_end(summary, out_dir, results["wall_time_s"])
    return results


def main():
    cfg = parse_config(Config)
    validate(cfg)
    rt = setup_runtime(cfg)
    train(cfg, prepare_out_dir(cfg, "dpo", rt), rt)
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
