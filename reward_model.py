"""
reward_model.py: reward models for RLHF: a Bradley-Terry preference RM, an outcome RM (ORM), a process RM (PRM).

A reward model is the GPT body with a scalar head on its final hidden states: a score s_t = w . h_t + b at every
position t. Sequences are right-padded (causal attention: padding never changes a real position), and a
sequence's reward is the score at its last real token.

  --task preference (default; Bradley & Terry 1952, Ouyang et al. 2022): pairs of a prompt x and a chosen and a
      rejected response from HH-RLHF, r_c = r(x, y_c) and r_r = r(x, y_r), and
          L = mean(-log sigmoid(r_c - r_r - m)) + c * mean((r_c + r_r)^2)
      with a margin m (`--margin`, Touvron et al. 2023) and a centering weight c (`--center_coef`, Eisenstein et
      al. 2023) that keeps rewards near 0. Chosen and rejected rows go through one forward pass.
  --task orm (outcome RM, Cobbe et al. 2021): `a op b=` problems (--steps K: K operations, solved one step a
      line, `17+25-9=` `17+25=42\\n42-9=33\\n`) with their answer or one whose final result is off by 1-3 in one
      digit place; binary cross-entropy of sigmoid(s_t) against the outcome label (1: exactly the answer) at every
      answer token; the reward is the last token's score.
  --task prm (process RM, Lightman et al. 2023): the same problems (--steps K >= 2), a solution with one step's
      result off (any step, the later steps computing on from it); binary cross-entropy at the newline after each
      step up to and including the first wrong one (step_correct), none after it, as PRM800K is labelled: p_k =
      sigmoid(s) at step k estimates P(step k right | the steps before it right), and their product P(all right).
  --samples_from CKPT (orm, prm; a `gpt.py --data arithmetic` policy): the solutions are the policy's own instead,
      --samples_per_problem per problem at temperature 1, as Cobbe et al. train the verifier on the generator's
      samples: the policy's mistakes, not synthetic ones, are what RL will meet. The same seed gives orm and prm the
      same solutions; orm labels the final answer, prm each step, by the exact checker. The held-out AUC is logged
      pooled over all solutions (eval/auc) and within each problem (eval/auc_per_problem), the ranking best-of-n
      and RL use.
The losses are normalised by the number of pairs (preference) or labelled positions (orm, prm) of the whole
optimizer step, all ranks and micro-batches together, so they do not depend on how the batch is split.
--pos_weight w (orm, prm) counts each label-1 term of the cross-entropy w times (torch's BCEWithLogitsLoss pos_weight).

Where we depart from the papers, on purpose:
  - the margin is one constant for every pair (HH-RLHF has no ratings; Llama 2 takes it from the rating gap);
  - a step is wrong when it does not continue the chain from the previous step's result, so a right final answer
    reached through a wrong step is wrong (the exact checker stands in for PRM800K's human raters);
  - the training data are read in a fresh shuffled order per epoch, the global batch fixed by the step number,
    so a resumed run sees the same examples. Reward models overfit soon after one epoch: watch eval/loss.
The model and the losses are hand-written on purpose: reading them is the point.

Data: `--task preference` reads HH-RLHF (`--data Anthropic/hh-rlhf` through `datasets`: its train and test
splits) or `--data_path` to a local .jsonl/.jsonl.gz with `chosen` and `rejected` dialogues; then 1 record in 20
is held out, by gpt.py's hh_sft rule, so an SFT model made by gpt.py from the same file never saw them. Each
dialogue is split at its last "\\n\\nAssistant:" into prompt and response; a pair longer than --max_len loses the
start of its prompt, the same tokens for both responses (truncate_pair), so both are scored on one context.
Pairs with a missing field, no Assistant response, different prompts or identical responses are counted and
skipped. orm and prm generate their data, split by problem: a problem is held out iff zlib.crc32(prompt) % 10 == 0
(held_out), on the whole expression; no training example is of a held-out problem, every held-out example is
(and a prm chain trains only when none of its steps is a held-out problem either). Split by text instead,
every held-out problem would lose its right answer (one text) from training, but not its wrong ones. The run prints
how many distinct problems the held-out examples hold.

Best-of-n (--best_of 1,2,4,.. --policy CKPT, no training): the policy writes N = max n answers to each of grpo.py's
held-out evaluation problems at temperature 1, and best_of_n.json holds, for each n, the gold accuracy and the verifier
score of the verifier's favourite of n (unbiased: the mean over all n-subsets of the N), majority voting's gold (the
most frequent final answer of n, Wang et al. 2023), and the exact KL of best-of-n to the policy, pi_bon(y) = F(y)^n -
F(y-)^n with F the policy's cumulative probability in score order (best_of_n_kl), beside its bound log n - (n - 1)/n
(Beirami et al. 2024), and weighted majority voting (each vote weighted by the verifier's probability that its
solution is right: Uesato et al. 2022). A prm scores a solution by --prm_aggregate of its steps' p: prod (the
probability that all are right, Lightman et al.), min or last (the last step's alone).

The checkpoint (ckpt.pt) holds the body as a plain GPT (`model`, so any script takes it as --init_from) and the
head (`reward_head`, `reward_task`); ppo.py and grpo.py load it with load_reward_model() as --reward_model.
score(model, tok, texts, device) gives the rewards of texts.

Commands:
    python reward_model.py --data_path hh.jsonl.gz --init_from out/sft/ckpt.pt   # HH-RLHF pairs, an SFT model, CPU
    torchrun --standalone --nproc_per_node=8 reward_model.py --init_from gpt2-medium --lr 1e-5 --parallel fsdp
    python reward_model.py --task orm --samples_from out/arith/ckpt.pt  # a verifier of that policy's own answers
    python reward_model.py --task prm --steps 3 --samples_from out/arith3/ckpt.pt  # its steps, by the step checker
    python reward_model.py --init_from out/verifier/ckpt.pt --policy out/arith/ckpt.pt --best_of 1,2,4,8,16,32,64
From scratch, orm and prm learn little in a few CPU minutes (to judge an answer a model must do the arithmetic);
start them from a model that can, as Cobbe et al. start the verifier from the generator (a run from scratch says
so in one line on stderr). --samples_from starts from the policy unless --init_from names another model.

docs/reward_model.md: the implementation details, the flags, every metric, results and their commands.
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
from collections import Counter
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
    # the run: where it writes, what it starts from
    out_dir: str = ""  # run folder; default out/reward_model-<YYYYmmdd-HHMMSS>
    init_from: str = "scratch"  # scratch | gpt2 | gpt2-medium | ... | hub id | ckpt.pt of any script | HF folder
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    best_of: str = ""  # n values (e.g. 1,2,4,8): best_of_n.json of --policy under the --init_from verifier, exit
    policy: str = ""  # --best_of: ckpt.pt of the policy whose answers the verifier ranks
    # task and data
    task: str = "preference"  # preference (HH-RLHF pairs) | orm (outcome RM) | prm (process RM) on arithmetic
    data: str = "Anthropic/hh-rlhf"  # preference: hub dataset of chosen/rejected dialogues (train/test splits)
    data_path: str = ""  # preference: local .jsonl/.jsonl.gz with chosen/rejected dialogues instead of the hub
    tokenizer: str = "auto"  # auto | char | gpt2 (auto: the model's; a new model: gpt2 for preference, else char)
    max_len: int = 0  # longest training sequence in tokens (0: the model's block_size); longer ones lose prompt tokens
    # loss
    margin: float = 0.0  # preference: m in -log sigmoid(r_c - r_r - m)
    center_coef: float = 0.0  # preference: weight of mean((r_c + r_r)^2), which keeps rewards near 0
    pos_weight: float = None  # orm/prm: weight of the label-1 (right) terms in the cross-entropy; unset: no weighting
    # generated arithmetic (orm, prm)
    digits: int = 2  # orm/prm, --best_of: largest number of digits of an operand
    ops: str = "+-*"  # orm/prm: operators to draw from
    steps: int = 1  # orm/prm, --best_of: operations per problem (K), left to right, solved one step a line
    error_frac: float = 0.5  # orm/prm: fraction of corrupted answers / of chains with a wrong step
    n_train: int = 20000  # orm/prm: generated training examples (never of a held-out problem)
    n_val: int = 1000  # orm/prm: generated held-out examples (of held-out problems only)
    # a verifier of a policy's own answers (orm, prm)
    samples_from: str = ""  # orm/prm: train on answers sampled from this policy's ckpt.pt (by default start from it)
    samples_per_problem: int = 8  # --samples_from: answers sampled per problem (--n_train, --n_val: answers in all)
    prm_aggregate: str = "prod"  # --best_of, prm: a solution's score from its steps' probabilities: prod | min | last
    # model (a new one; a checkpoint brings its own)
    n_layer: int = 4  # transformer blocks (scratch only)
    n_head: int = 4  # attention heads (scratch only)
    n_embd: int = 128  # embedding width (scratch only)
    block_size: int = 256  # context length of the model (scratch only)
    dropout: float = 0.0  # dropout probability
    bias: bool = True  # biases in Linear and LayerNorm layers (scratch only)
    # optimisation
    batch_size: int = 16  # pairs (preference) or sequences (orm, prm) per micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 500  # optimizer steps
    lr: float = 3e-4  # peak learning rate (1e-5 suits a pretrained GPT-2)
    min_lr: float = None  # learning rate at the end of the cosine decay (unset: --lr / 10)
    warmup_steps: int = 50  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW weight decay on matrices
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    # evaluation, logging, checkpoints
    eval_size: int = 0  # held-out examples per evaluation (0: all); --best_of: held-out problem draws (0: 128)
    eval_every: int = 100  # steps between evaluations
    log_every: int = 25  # steps between log lines
    save_every: int = 500  # steps between checkpoints (one is always written at the end)
    # system
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA if supported)
    compile: bool = False  # torch.compile the reward model
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    seed: int = 1337  # random seed (each rank adds its rank)
    deterministic: bool = False  # torch.use_deterministic_algorithms
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rlhf-gpt"  # wandb project


# ----------------------------------------------------------------------------------------------------------
# ALGO LOGIC: pure functions, tensors in and tensors out.


def bradley_terry_loss(r_chosen, r_rejected, margin=0.0, center_coef=0.0):
    """Bradley-Terry loss of (N,) rewards: mean(-log sigmoid(r_c - r_r - margin)) + center_coef * mean((r_c + r_r)^2).
    margin is a number or (N,) per-pair margins."""
    return -F.logsigmoid(r_chosen - r_rejected - margin).mean() + center_coef * ((r_chosen + r_rejected) ** 2).mean()


def last_token_rewards(scores, lengths):
    """The reward of each right-padded row: its score at the last real token. (B, T), (B,) -> (B,)."""
    return scores.gather(1, (lengths - 1)[:, None]).squeeze(1)


def token_bce_sum(scores, labels, pos_weight=None):
    """Binary cross-entropy of sigmoid(scores) against 0/1 labels, summed over the labelled positions (labels -1
    elsewhere): (B, T), (B, T) -> scalar. pos_weight w weighs each label-1 term w times, as torch's BCEWithLogitsLoss
    pos_weight does: -(w y log sigmoid(s) + (1 - y) log(1 - sigmoid(s))); None: no weighting."""
    bce = F.binary_cross_entropy_with_logits(scores, labels.clamp(min=0).float(), reduction="none")  # (B, T)
    if pos_weight is not None:  # w > 1 pulls harder on the right answers (a minority when the policy errs often)
        bce = bce * torch.where(labels == 1, pos_weight, 1.0)
    return (bce * (labels >= 0)).sum()


def roc_auc(rewards, labels):
    """ROC AUC of (N,) rewards against (N,) 0/1 labels: the fraction of (right, wrong) pairs in which the right one
    has the higher reward, ties counting one half (Mann-Whitney U); nan without both labels (no pair). Every pair
    is compared, plainly: (right, wrong) floats in memory, fine for held-out sets of thousands."""
    d = rewards[labels == 1][:, None] - rewards[labels == 0]  # (right, wrong): each pair's reward difference
    return (d.sign().mean().item() + 1) / 2  # a pair scores (sign + 1) / 2: 1 if the right one is higher, 1/2 if tied


def per_problem_auc(rewards, labels, problems):
    """(mean AUC, count): roc_auc of (N,) rewards against (N,) 0/1 labels within each problem (problems: N keys, one
    per row), averaged over the problems that have both a right and a wrong answer, and how many those are. The
    others have no pair to rank and are skipped; (nan, 0) when none has both, as roc_auc gives nan. Best-of-n and
    RL rank the answers of one problem against each other, so this is the AUC they meet; the pooled AUC also credits
    a verifier for scoring easy problems above hard ones."""
    rows = {}  # problem -> its row indices, in order of first appearance
    for i, problem in enumerate(problems):
        rows.setdefault(problem, []).append(i)
    # the problems with both labels
    aucs = [roc_auc(rewards[index], labels[index]) for index in rows.values() if 0 < labels[index].sum() < len(index)]
    if not aucs:
        return math.nan, 0
    return sum(aucs) / len(aucs), len(aucs)


def best_of_n_kl(p, scores, n):
    """KL(pi_bon || pi) in nats of best-of-n sampling (draw n answers of the policy pi, keep the one the verifier
    scores highest), exactly, for a discrete policy. p (K,): the policy's probabilities of K distinct answers; their
    sum may be below 1, and the rest is one more answer ranked below all (the answers never sampled). scores (K,):
    the verifier's. In ascending score order (ties: the lower index ranks lower), with F the cumulative probability,
    best-of-n picks y with probability pi_bon(y) = F(y)^n - F(y-)^n: all n draws rank at most y, not all below it.
    0 at n = 1; at most log n - (n - 1)/n (Beirami et al. 2024), which it nears when many answers are each unlikely."""
    p = p.double() / p.double().sum().clamp(min=1)  # a sum above 1 is rounding (float32 log-probs): renormalise
    order = torch.argsort(scores, stable=True)  # ascending; a stable sort keeps ties in index order
    rest = (1 - p.sum()).clamp(min=0)
    q = torch.cat([rest[None], p[order]])  # (K + 1,) in rank order, the unsampled rest lowest
    F_hi = q.cumsum(0)  # F(y)
    F_lo = torch.cat([q.new_zeros(1), F_hi[:-1]])  # F(y-)
    pi_bon = F_hi**n - F_lo**n  # (K + 1,)
    terms = torch.where(pi_bon > 0, pi_bon * (pi_bon.log() - q.log()), 0.0)  # 0 log 0 = 0
    return max(terms.sum().item(), 0.0)  # not -1e-17 from rounding at n = 1


def best_of_n_weights(N, n):
    """(N,) weights of N samples in ascending score order whose dot product with their values is the mean, over all
    C(N, n) subsets of n samples, of the value of the subset's best: the i-th lowest (i from 0) is the best of
    C(i, n - 1) subsets. An unbiased estimate of best-of-n from N >= n i.i.d. samples (a U-statistic), with less
    variance than the best of the first n alone."""
    return torch.tensor([math.comb(i, n - 1) / math.comb(N, n) for i in range(N)], dtype=torch.float64)


# a prm label (encode) at the end of a step after the first wrong one: no loss there, but a step that is scored
AFTER_ERROR = -2


def aggregate_steps(scores, labels, how="prod"):
    """A solution's score from its steps': (B, T) logits of a prm and (B, T) labels, other than -1 at each step's end
    (as encode() writes them: 0, 1, or AFTER_ERROR) -> (B,). A prm trained on Lightman et al.'s labels (each step up
    to the first wrong one) reads p_k = sigmoid(score) at step k as P(step k right | the steps before it right), so:
    prod, P(every step right) (Lightman et al. 2023); min, the weakest step's p; last, the last step's p alone (the
    chance that the last step is right if all before it are). A row without a step scores 1 (prod, min) or its first
    position's p (last)."""
    is_step = labels != -1
    probs = torch.where(is_step, torch.sigmoid(scores), 1.0)  # (B, T): 1, the identity of prod and min, off the steps
    if how == "prod":
        return probs.prod(1)
    if how == "min":
        return probs.min(1).values
    last = is_step.long().cumsum(1).argmax(1)  # (B,): where the count of steps first reaches its total
    return probs.gather(1, last[:, None]).squeeze(1)


def majority_vote(finals, truth, weights=None):
    """Self-consistency's gold of one set of answers (Wang et al. 2023): 1.0 when the most frequent final result is
    truth; ties among the most frequent split the credit (the expected gold of a random pick among them). finals:
    each answer's final result (a string), None for an answer that is not well formed, which does not vote; 0.0
    when none votes. weights: each answer's vote, for verifier-weighted majority voting (Uesato et al. 2022, Li et
    al. 2023: a final result's votes are the verifier's probabilities that its solutions are right); None: one each."""
    votes = Counter()
    for final, weight in zip(finals, weights or [1] * len(finals)):
        if final is not None:
            votes[final] += weight
    if not votes:
        return 0.0
    most = max(votes.values())
    winners = [f for f, count in votes.items() if count == most]
    return (truth in winners) / len(winners)


def truncate_pair(prompt, chosen, rejected, max_len):
    """Cut a pair of token-id lists to fit max_len: (prompt, chosen, rejected) with len(prompt) + len(response) <=
    max_len for both responses. The prompt is cut once, from its start (its end, next to the responses, stays), to
    as many tokens as fit beside the longer response, so both responses are scored on the same context; it never
    becomes empty. A response is cut, from its end, only where even a one-token prompt does not fit beside it."""
    keep = max(1, max_len - max(len(chosen), len(rejected)))  # prompt tokens beside the longer response
    prompt = prompt[-keep:]
    return prompt, chosen[: max_len - len(prompt)], rejected[: max_len - len(prompt)]


# ----------------------------------------------------------------------------------------------------------
# The training step: rows -> scores -> rewards -> loss -> update. main() picks this rank's rows of each step with
# batch_indices and calls reward_model_step; held_out_metrics runs the same batch_loss on the held-out rows, and
# for orm and prm also eval/auc of every held-out row's reward (batch_loss returns them), and for orm the AUC within
# each held-out problem (per_problem_auc).
#
# A row, as encode() makes it (token ids: a list of ints, at most --max_len long):
#   preference   (chosen_ids, rejected_ids)   prompt + response (+ <|endoftext|>), the same prompt tokens in both
#   orm, prm     (ids, labels)                labels: an int per token, 1 right, 0 wrong, -1 no loss there;
#                                             prm: AFTER_ERROR (no loss) at the end of a step after the first wrong
# batch_loss's statistics, {name: (2,) tensor [sum, count]}, are added up by name over micro-batches, summed over
# ranks and divided by summarize() (a count of 0 gives 0.0), then logged as train/<name> and eval/<name>:
#   every task   loss                     train/loss, eval/loss                  per pair or labelled position
#   preference   reward_acc, margin       train/reward_acc, train/margin         per pair
#                chosen_mean              train/chosen_mean                      per pair
#                rejected_mean            train/rejected_mean                    per pair
#   orm          label_acc                train/label_acc                        per sequence
#                accuracy_correct         train/accuracy_correct                 per right answer
#                accuracy_wrong           train/accuracy_wrong                   per wrong answer
#                reward_correct           train/reward_correct                   per right answer
#                reward_wrong             train/reward_wrong                     per corrupted answer
#   prm          step_accuracy            train/step_accuracy                    per labelled step


def reward_model_step(model, optimizer, scaler, rows, lr, cfg, rt):
    """One optimizer step on this rank's rows (--grad_accum micro-batches of --batch_size): (train/ metrics, real
    tokens of all ranks)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    # ALGO LOGIC: the loss sums every pair's (or labelled position's) term over the whole step, all ranks and
    # micro-batches, and divides by their global count, so it does not depend on how the batch is split
    n_tokens = sum(len(ids) for ids, _ in rows)  # preference: the chosen rows' tokens, and below the rejected rows'
    if cfg.task == "preference":
        terms = len(rows)
        n_tokens += sum(len(rejected) for _, rejected in rows)
    else:
        terms = sum(y >= 0 for _, labels in rows for y in labels)
    # the step's terms and real tokens over all ranks, in one all-reduce
    all_terms, all_tokens = all_reduce(torch.tensor([terms, n_tokens], device=rt.device), rt)
    stats = {}
    for micro in range(cfg.grad_accum):
        grad_sync(model, micro == cfg.grad_accum - 1)  # DDP syncs gradients on the last micro-batch only
        batch = rows[micro * cfg.batch_size : (micro + 1) * cfg.batch_size]
        loss_sum, batch_stats, _ = batch_loss(model, batch, cfg, rt)
        # ranks' gradients are averaged, so each rank's share is scaled by world_size
        loss = loss_sum * rt.world_size / all_terms
        scaler.scale(loss).backward()
        for name, value in batch_stats.items():
            stats[name] = stats.get(name, 0.0) + value
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    metrics = summarize(stats, rt, "train/")  # the table above
    metrics["train/lr"] = lr
    metrics["train/grad_norm"] = grad_norm.item()
    return metrics, all_tokens.item()


def batch_loss(model, batch, cfg, rt):
    """(loss summed over the batch's terms, statistics {name: (2,) tensor [sum, count]} of the batch (the table
    above), the rewards of its rows). A metric is its sum over the micro-batches and ranks divided by its count
    (summarize)."""
    seqs = [ids for ids, _ in batch]  # one row per example; preference: the chosen rows
    if cfg.task == "preference":
        # then the rejected rows, one right-padded forward pass; no attention mask is needed: padding only follows
        # real tokens, and positions count from 0 in every row
        seqs += [rejected for _, rejected in batch]
    idx, lengths = pad_right(seqs, rt.device)  # (B, T), (B,); preference: 2B rows
    with rt.autocast():
        scores = model(idx)  # (B, T) float32
    rewards = last_token_rewards(scores, lengths)  # (B,); preference: chosen rows, then rejected rows
    if cfg.task == "preference":
        loss = bradley_terry_loss(*rewards.chunk(2), cfg.margin, cfg.center_coef) * len(batch)
        r_c, r_r = rewards.detach().chunk(2)  # (B,), (B,): chosen, rejected
        d = r_c - r_r  # (B,)
        terms = d.new_tensor(len(batch))
        values = {
            "reward_acc": (d > 0).float() + 0.5 * (d == 0).float(),  # ties count one half
            "margin": d,
            "chosen_mean": r_c,
            "rejected_mean": r_r,
        }
    else:
        labels, _ = pad_right([y for _, y in batch], rt.device, value=-1)  # (B, T)
        loss = token_bce_sum(scores, labels, cfg.pos_weight)
        labelled = labels >= 0  # (B, T)
        terms = labelled.sum().float()
        if cfg.task == "orm":
            r = rewards.detach()
            y = last_token_rewards(labels, lengths)  # (B,) outcome labels
            right = r[y == 1]  # the rewards of right answers
            wrong = r[y == 0]  # and of wrong ones
            values = {
                "label_acc": ((r > 0) == (y == 1)).float(),
                "accuracy_correct": (right > 0).float(),
                "accuracy_wrong": (wrong <= 0).float(),
                "reward_correct": right,
                "reward_wrong": wrong,
            }
        else:
            rewards = aggregate_steps(scores.detach(), labels, "prod")  # (B,) P(every step right)
            values = {"step_accuracy": ((scores > 0) == (labels == 1))[labelled].float()}
    stats = {"loss": torch.stack([loss.detach(), terms])}
    for name, value in values.items():
        stats[name] = torch.stack([value.sum(), value.new_tensor(value.numel())])
    return loss, stats, rewards


def pad_right(seqs, device="cpu", value=0):
    """Right-padded (B, T) LongTensor of lists of ints, and their lengths (B,), on device."""
    idx = nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True, padding_value=value)  # (B, T)
    return idx.to(device), torch.tensor([len(s) for s in seqs], device=device)


def summarize(stats, rt, prefix):
    """Metrics (prefix + name) of {name: [sum, count]} statistics summed over micro-batches: each sum over all
    ranks divided by its count over all ranks."""
    totals = all_reduce(torch.stack(list(stats.values())), rt)  # (K, 2): one all-reduce for all
    return {prefix + name: total / max(count, 1) for name, (total, count) in zip(stats, totals.tolist())}


@torch.no_grad()
def held_out_metrics(model, eval_data, cfg, rt, problems):
    """eval/ metrics of the held-out rows; problems: each row's problem (orm: its prompt), for eval/auc_per_problem.
    The rows are dealt out over ranks, which all run the same number of batches (under FSDP a forward pass is
    collective), the last ones possibly on a dummy row with weight 0."""
    model.eval()
    mine = eval_data[rt.rank :: rt.world_size]
    most = math.ceil(len(eval_data) / rt.world_size)  # the most rows any rank holds
    stats = {}
    found = []  # the rewards of this rank's rows, in order
    for b in range(0, most, cfg.batch_size):
        batch = mine[b : b + cfg.batch_size]
        weight = 1.0 if batch else 0.0  # a rank out of rows runs a dummy batch that counts for nothing
        _, batch_stats, rewards = batch_loss(model, batch or eval_data[:1], cfg, rt)
        for name, value in batch_stats.items():
            stats[name] = stats.get(name, 0.0) + weight * value
        found.append(rewards[: len(batch)])
    model.train()
    metrics = summarize(stats, rt, "eval/")  # the table above
    if cfg.task != "preference":  # the AUC needs every row's reward: each rank fills in its own rows
        rewards = torch.zeros(len(eval_data), device=rt.device)
        rewards[rt.rank :: rt.world_size] = torch.cat(found)
        # a solution is right when its last label is (prm: the last step is labelled only if every step before is right)
        outcomes = torch.tensor([int(labels[-1] == 1) for _, labels in eval_data])
        rewards = all_reduce(rewards, rt).cpu()
        metrics["eval/auc"] = roc_auc(rewards, outcomes)
        if cfg.task == "orm" or cfg.samples_from:  # within each problem, as best-of-n and RL rank answers
            auc, n_problems = per_problem_auc(rewards, outcomes, problems)
            metrics["eval/auc_per_problem"] = auc  # nan when no problem has both labels
            metrics["eval/auc_problems"] = n_problems
    return metrics


def batch_indices(n, step, per_rank, rank, world_size, seed):
    """This rank's example indices at an optimizer step. Each epoch reads the n examples in a fresh random order;
    a step's global batch is the next world_size * per_rank of them, one disjoint slice per rank. The step alone
    decides them, so a resumed run continues with exactly the examples it would have seen."""
    start = (step * world_size + rank) * per_rank  # position p is example orders[p // n][p % n]
    epochs = range(start // n, (start + per_rank - 1) // n + 1)
    orders = {e: torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist() for e in epochs}
    return [orders[p // n][p % n] for p in range(start, start + per_rank)]


# ----------------------------------------------------------------------------------------------------------
# The reward model. grpo.py, ppo.py and dpo.py carry verbatim copies of RewardModel and load_reward_model.


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
def score(model, tok, texts, device, max_len=None, batch_size=32):
    """Rewards (a list of floats) of whole texts (prompt and response) under a reward model: each text tokenized,
    <|endoftext|> appended when the tokenizer has one, truncated from the left to max_len (default: the model's
    block_size), right-padded in batches; a text's reward is the score at its last token."""
    max_len = max_len or model.body.config.block_size
    end = [tok.eot_id] if tok.eot_id is not None else []
    rewards = []
    for i in range(0, len(texts), batch_size):
        seqs = [(tok.encode(t) + end)[-max_len:] for t in texts[i : i + batch_size]]
        idx, lengths = pad_right(seqs, device)
        rewards += last_token_rewards(model(idx), lengths).tolist()
    return rewards


# ----------------------------------------------------------------------------------------------------------
# Data: HH-RLHF pairs (preference) and generated arithmetic (orm, prm). An example is (prompt, chosen, rejected)
# texts (preference), (prompt, answer, label) (orm) or steps ((text, label), ...) (prm); encode() makes its row.


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


def load_preference_data(cfg, rt):
    """(train, held-out) lists of (prompt, chosen, rejected) and the count of skipped records per reason, which rank
    0 also prints in one line."""
    source = cfg.data_path or cfg.data
    if cfg.data_path:
        # gpt.py's hh_sft split (it needs only "chosen"), so an SFT model made from this file never saw the held-out
        records = read_jsonl(cfg.data_path, ["chosen"])
        records = random.Random(0).sample(records, len(records))  # fixed split, whatever --seed
        n_val = max(1, len(records) // 20)
        train_records = records[n_val:]
        val_records = records[:n_val]
    else:
        try:
            import datasets
            import huggingface_hub

            if not huggingface_hub.constants.HF_HUB_OFFLINE:  # one quick request: datasets retries for a minute
                huggingface_hub.dataset_info(cfg.data, timeout=10)
            hub = datasets.load_dataset(cfg.data)
            train_records = hub["train"].to_list()  # dicts with "chosen" and "rejected"
            val_records = hub["test"].to_list()
        except Exception as e:
            die(f"cannot load {cfg.data} from the hub ({type(e).__name__}); pass --data_path FILE.jsonl.gz")
    train, skipped_train = hh_pairs(train_records)
    val, skipped_val = hh_pairs(val_records)
    skipped = Counter(skipped_train) + Counter(skipped_val)
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "none"
    check(train, f"{source}: no usable preference pair ({sum(skipped.values())} skipped: {reasons})")
    check(val, f"{source}: the held-out split has no usable preference pair")
    if skipped and rt.master:
        kept = f"kept {len(train)} train and {len(val)} held-out"
        print(f"{source}: skipped {sum(skipped.values())} pair(s) ({reasons}); {kept}", file=sys.stderr)
    return train, val, skipped


# The char vocabulary of `gpt.py --data arithmetic --tokenizer char`: a new orm or prm model takes it, and a model
# to start from must have it (its reward scores any arithmetic text a policy writes)
ARITHMETIC_CHARS = "\n*+-0123456789="


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


def sampled_example(task, prompt, answer, y):
    """The example of a policy's answer y to a problem (prompt, answer). orm: (prompt, y, label), label 1 when y is
    exactly the answer (arithmetic_reward). prm: y's lines as a chain of steps ((text, label), ...), the first with
    the prompt before it ("17+25-9=17+25=42"), labelled as Lightman et al. label PRM800K: each step up to and
    including the first wrong one by step_correct (1 right, 0 wrong), every step after it AFTER_ERROR (no label:
    whether it is right says nothing once the solution has gone wrong). A last line without its newline is not a
    finished step and is wrong."""
    if task == "orm":
        return prompt, y, int(arithmetic_reward(y, answer))
    right = step_correct(prompt, y)
    right[-1] = right[-1] and y.endswith("\n")
    first_wrong = right.index(False) if False in right else len(right)
    labels = [int(r) for r in right[: first_wrong + 1]] + [AFTER_ERROR] * (len(right) - first_wrong - 1)
    lines = y.splitlines()
    lines[0] = prompt + lines[0]
    return tuple(zip(lines, labels))


def first_lines(text, k):
    """The text up to and including its k-th newline, or the whole text when it has fewer (an answer of k lines)."""
    return re.match(rf"(?:[^\n]*\n){{,{k - 1}}}[^\n]*\n?", text).group()  # k - 1 lines at most, then one more


def corrupt(rng, value):
    """A wrong result near value: off by 1 to 3 in one of its digit places (7 -> 5, 42 -> 12, 42 -> 43), the kind of
    slip a model makes."""
    place = 10 ** rng.randrange(len(str(abs(value))))
    return value + rng.choice((-3, -2, -1, 1, 2, 3)) * place


def synthetic_example(rng, cfg):
    """An orm or prm example of a drawn problem of --steps operations (arithmetic_problem) with a written solution:
    with probability --error_frac one step's result is corrupted (orm: the last step's; prm: any step's), and the
    steps after it compute on from the wrong value, as a real solution would. Labelled as a policy's answer is
    (sampled_example): orm by its final answer, prm step by step up to the wrong one (0), none after it."""
    prompt, answer = arithmetic_problem(rng, cfg.digits, cfg.ops, cfg.steps)
    wrong = cfg.steps  # the index of the corrupted step; --steps: none
    if rng.random() < cfg.error_frac:
        wrong = cfg.steps - 1 if cfg.task == "orm" else rng.randrange(cfg.steps)
    x = int(re.match(r"\d+", prompt).group())
    y = ""
    for i, (op, b) in enumerate(re.findall(r"([-+*])(\d+)", prompt)):
        result = operate(x, op, int(b))
        if i == wrong:
            result = corrupt(rng, result)
        y += f"{x}{op}{b}={result}\n"
        x = result
    if cfg.steps == 1:  # one operation: the answer is its result alone
        y = f"{x}\n"
    return sampled_example(cfg.task, prompt, answer, y)


def step_problems(task, example):
    """The problems of an example: its prompt, for a preference or orm example (["12+3="]), or each step's problem,
    for a prm chain (["3+4=", "7*2=", ...]). The first is the example's problem."""
    if task == "prm":
        return [text.split("=")[0] + "=" for text, _ in example]
    return example[:1]


def synthetic_data(cfg):
    """(train, held-out) lists of orm examples (prompt, answer, label) or prm chains, and {} (nothing is skipped).
    They are split by problem (held_out), not by text: a problem's right answer is one text, and holding out
    texts would take the right answers of every held-out problem out of training, but not its wrong ones. A prm
    chain is held out when its first step's problem is, and trains only when none of its steps' problems is: a
    chain whose first step is not held out but a later one is, is drawn again."""
    rng = random.Random(cfg.seed)
    train = []
    val = []
    while len(train) < cfg.n_train or len(val) < cfg.n_val:
        example = synthetic_example(rng, cfg)
        problems = step_problems(cfg.task, example)
        if held_out(problems[0]):
            val.append(example)
        elif not any(map(held_out, problems)):
            train.append(example)
    return train[: cfg.n_train], val[: cfg.n_val], {}


@torch.no_grad()
def sampled_data(cfg, tok, rt):
    """(train, held-out) lists of orm examples or prm chains whose answers the --samples_from policy wrote (Cobbe et
    al. 2021: the verifier learns the generator's own mistakes), and {}. Batches of 64 problems, each
    --samples_per_problem times, sampled at temperature 1 until --n_train (--n_val) answers, the last batch cut;
    training problems are never held out, held-out ones always (held_out). An answer ends at its --steps-th newline
    (sample_answers); sampled_example labels it, orm by its final answer, prm step by step. The draws depend on
    --seed only, so an orm and a prm run of one seed learn the same answers."""
    policy, spec, _ = load_model(cfg.samples_from)
    check(spec == tok.spec, f"--samples_from {cfg.samples_from}: its tokenizer is not the reward model's")
    policy.to(rt.device)
    rng = random.Random(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    splits = []
    for n, held in ((cfg.n_train, False), (cfg.n_val, True)):
        examples = []
        while len(examples) < n:
            # a generation batch: 64 problems, each --samples_per_problem times, sorted so that a problem's answers
            # sit side by side and cutting the last batch leaves at most one problem short
            batch = [draw_problem(rng, cfg.digits, cfg.ops, held, cfg.steps) for _ in range(64)]
            batch = sorted(batch * cfg.samples_per_problem)
            for (prompt, answer), y in zip(batch, sample_answers(policy, tok, batch, cfg, generator)):
                examples.append(sampled_example(cfg.task, prompt, answer, y))
        splits.append(examples[:n])
    return splits[0], splits[1], {}


def sample_answers(policy, tok, problems, cfg, generator):
    """The policy's answers to (prompt, answer) problems, sampled at temperature 1 in answer_tokens(--digits, --steps)
    tokens (more than any right answer takes), each cut after its --steps-th newline (first_lines): texts."""
    prompts = [tok.encode(prompt) for prompt, _ in problems]
    tokens, _ = generate(policy, prompts, answer_tokens(cfg.digits, cfg.steps), generator=generator)
    return [first_lines(tok.decode(ids), cfg.steps) for ids in tokens.tolist()]


def encode(task, tok, example, max_len):
    """The training row of an example. preference: the token ids of prompt + chosen and prompt + rejected, cut
    together by truncate_pair. orm and prm: token ids (+ <|endoftext|>) and a label per token, -1 where there is no
    loss. orm puts the outcome label on every answer token. prm writes one step a line, as gpt.py's arithmetic data,
    and puts each step's label on the newline after it (a cut-off last line gets one, as grpo.py scores it): 1 or 0,
    or AFTER_ERROR for a step after the first wrong one, which is scored but not trained on."""
    if task == "preference":
        return encode_pair(tok, *example, max_len)[:2]  # prompt + chosen, prompt + rejected
    if task == "orm":
        prompt, answer, label = example
        ids, _, n_prompt = encode_pair(tok, prompt, answer, answer, max_len)  # a pair of one answer, twice
        return ids, [-1] * n_prompt + [label] * (len(ids) - n_prompt)
    ids = []
    labels = []
    for text, label in example:
        step = tok.encode(text + "\n")  # the newline is a token of its own, in BPE as in chars
        ids += step
        labels += [-1] * (len(step) - 1) + [label]
    check(len(ids) <= max_len, f"a prm chain takes {len(ids)} tokens, more than --max_len {max_len}; raise it")
    return ids, labels


# ----------------------------------------------------------------------------------------------------------
# Setup, main() and their helpers.


def validate(cfg):
    positive = ["batch_size", "grad_accum", "max_steps", "eval_every", "log_every", "save_every", "n_train", "n_val"]
    positive += ["digits", "steps", "n_layer", "n_head", "n_embd", "block_size", "lr", "samples_per_problem"]
    for name in positive:
        check(getattr(cfg, name) > 0, f"--{name} must be positive (got {getattr(cfg, name)})")
    for name in ("eval_size", "center_coef", "warmup_steps", "grad_clip", "weight_decay"):
        check(getattr(cfg, name) >= 0, f"--{name} must be >= 0 (got {getattr(cfg, name)})")
    check(
        cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.lr,
        f"--min_lr {cfg.min_lr}: the decay ends at or below --lr {cfg.lr}",
    )
    check(cfg.pos_weight is None or cfg.pos_weight > 0, f"--pos_weight must be positive (got {cfg.pos_weight})")
    choices = {
        "task": ["preference", "orm", "prm"],
        "tokenizer": ["auto", "char", "gpt2"],
        "prm_aggregate": ["prod", "min", "last"],
    }
    for name, allowed in choices.items():
        check(getattr(cfg, name) in allowed, f"--{name} {getattr(cfg, name)!r}: use one of {' '.join(allowed)}")
    check(cfg.max_len == 0 or cfg.max_len >= 2, f"--max_len must be 0 (the block size) or >= 2 (got {cfg.max_len})")
    check(cfg.ops and set(cfg.ops) <= set("+-*"), f"--ops {cfg.ops!r}: use operators from +-*")
    check(0 <= cfg.error_frac <= 1, f"--error_frac must be in [0, 1] (got {cfg.error_frac})")
    check(0 <= cfg.dropout < 1, f"--dropout must be in [0, 1) (got {cfg.dropout})")
    check(cfg.n_embd % cfg.n_head == 0, f"--n_embd {cfg.n_embd} must be a multiple of --n_head {cfg.n_head}")
    check(not cfg.data_path or cfg.task == "preference", "--data_path is for --task preference; orm/prm make data")
    check(not cfg.samples_from or cfg.task != "preference", "--samples_from is for --task orm or prm")
    check(cfg.steps == 1 or cfg.task != "preference" or cfg.best_of, "--steps is for --task orm or prm (arithmetic)")
    check(cfg.steps > 1 or cfg.task != "prm", "--task prm needs --steps K >= 2: a one-step solution has no process")
    check(cfg.pos_weight is None or cfg.task != "preference", "--pos_weight is for --task orm or prm")
    n_values = re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", cfg.best_of)
    check(not cfg.best_of or n_values, f"--best_of {cfg.best_of!r}: positive integers n, comma-separated (1,2,4,8)")
    check(bool(cfg.best_of) == bool(cfg.policy), "--best_of n,n,.. and --policy CKPT go together")
    check(not cfg.best_of or os.path.isfile(cfg.init_from), "--best_of needs --init_from PATH/ckpt.pt of a verifier")


def make_tokenizer(cfg, spec, texts):
    """The model's tokenizer (spec from a checkpoint), whose char vocabulary must cover every character of the
    texts; for a new model GPT-2 BPE, or the characters of the texts."""
    chars = set().union(*texts)
    if spec is None:
        gpt2 = cfg.tokenizer == "gpt2" or (cfg.tokenizer == "auto" and cfg.task == "preference")
        return BPETokenizer() if gpt2 else CharTokenizer(sorted(chars))
    kind = "gpt2" if spec == "gpt2" else "char"
    check(cfg.tokenizer in ("auto", kind), f"--tokenizer {cfg.tokenizer} does not match the model's {kind} one")
    tok = get_tokenizer(spec)
    unknown = sorted(chars - set(tok.stoi)) if kind == "char" else []
    check(not unknown, f"the text has characters {''.join(unknown[:10])!r} outside the model's char vocabulary")
    return tok


def build_reward_model(cfg, ckpt_path, texts, rt):
    """(reward model, the same wrapped for training, tokenizer, optimizer, loss scaler, first step). The model: the
    run's own ckpt.pt with --resume, with its optimizer, loss scale and RNG streams; else the --init_from body (a
    checkpoint of any script, GPT-2 weights) with its head if it is a reward model, or a new head; else a new model.
    A new head (or model) is seeded alike on every rank: FSDP does not broadcast it."""
    init_from = ckpt_path if cfg.resume else cfg.init_from
    if init_from == "scratch":
        body, spec, ckpt = None, None, None
    else:
        body, spec, ckpt = load_model(init_from, cfg.dropout)
    tok = make_tokenizer(cfg, spec, texts)
    config = GPTConfig(cfg.block_size, tok.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.bias)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        raw = RewardModel(config if body is None else body.config)
    if body is not None:
        raw.body = body
    if ckpt is not None and "reward_head" in ckpt:
        raw.head.load_state_dict(ckpt["reward_head"])
    block_size = raw.body.config.block_size
    check(cfg.max_len <= block_size, f"--max_len {cfg.max_len} is longer than the model's block_size {block_size}")
    model = wrap_model(raw.to(rt.device), rt, cfg.compile)
    optimizer = make_optimizer(raw, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    start_step = 0
    if cfg.resume:
        load_optimizer_state(raw, optimizer, ckpt["optimizer"], rt)
        if ckpt.get("scaler"):  # float16's loss scale (empty without float16; absent in older checkpoints)
            scaler.load_state_dict(ckpt["scaler"])
        restore_rng(ckpt, rt)
        start_step = ckpt["step"]
    return raw, model, tok, optimizer, scaler, start_step


def save_reward_model(path, raw, optimizer, scaler, tok, step, cfg, rt):
    """ckpt.pt: the body as a plain GPT (`model`: any script's --init_from) and the head (`reward_head`)."""
    state, optim_sd = training_state(raw, optimizer, rt)
    rngs = all_rng_states(rt)
    if rt.master:
        body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
        head = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
        ckpt = {
            "model": body,
            "reward_head": head,
            "reward_task": cfg.task,
            "tokenizer": tok.spec,
            "step": step,
            "model_config": dataclasses.asdict(raw.body.config),
            "config": dataclasses.asdict(cfg),
            "optimizer": optim_sd,
            "scaler": scaler.state_dict(),
            "rng": rngs[0],  # rank 0's streams, as every script's ckpt.pt; rng_ranks: each rank's, for --resume
            "rng_ranks": rngs,
        }
        save_checkpoint(path, ckpt)


def main():
    cfg = parse_config(Config)
    validate(cfg)
    rt = setup_runtime(cfg)
    out_dir = prepare_out_dir(cfg, "reward_model", rt)
    if cfg.best_of:  # no training: best-of-n of the --policy under the --init_from verifier, and exit
        best_of_n(cfg, rt, out_dir)
        cleanup(rt)
        return
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if cfg.samples_from and cfg.init_from == "scratch":  # the verifier starts from its generator, as Cobbe et al.'s
        cfg.init_from = cfg.samples_from
    texts = [ARITHMETIC_CHARS]  # orm, prm
    if cfg.task == "preference":
        train_text, val_text, skipped = load_preference_data(cfg, rt)
        texts = [t for pair in train_text + val_text for t in pair]  # a char vocabulary must cover them
    elif not cfg.samples_from:
        train_text, val_text, skipped = synthetic_data(cfg)
    raw, model, tok, optimizer, scaler, start_step = build_reward_model(cfg, ckpt_path, texts, rt)
    if cfg.samples_from:
        train_text, val_text, skipped = sampled_data(cfg, tok, rt)
    max_len = cfg.max_len or raw.body.config.block_size
    train_data = [encode(cfg.task, tok, ex, max_len) for ex in train_text]
    val_text = val_text[: cfg.eval_size or None]
    eval_data = [encode(cfg.task, tok, ex, max_len) for ex in val_text]
    eval_problems = [step_problems(cfg.task, ex)[0] for ex in val_text]  # each held-out row's problem (or prompt)
    problems = len(set(eval_problems))  # distinct held-out problems (or prompts)
    if rt.master:
        data_size = f"{cfg.task}, {len(train_data)} train / {len(eval_data)} held-out ({problems} distinct problems)"
        print_start(raw.body, rt, out_dir, f"vocab {tok.vocab_size}, {data_size}")
    if rt.master and cfg.task != "preference" and cfg.init_from == "scratch":
        note(
            "a model from scratch cannot do arithmetic, so this reward model stays near chance; start from one that"
            " can: --init_from (or --samples_from) the ckpt.pt of `python gpt.py --data arithmetic --tokenizer char`"
        )

    stop = GracefulExit()
    save_config(cfg, out_dir, rt)  # every input is checked: from here on the run folder is written
    logger = Logger(cfg, out_dir, rt, cfg.max_steps, start_step)
    per_rank = cfg.batch_size * cfg.grad_accum
    t_start = time.time()
    last_eval = {}
    for step in range(start_step, cfg.max_steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            last_eval = held_out_metrics(model, eval_data, cfg, rt, eval_problems)
            logger.log(step, last_eval)
        if step == cfg.max_steps:
            break
        t0 = time.time()
        lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
        indices = batch_indices(len(train_data), step, per_rank, rt.rank, rt.world_size, cfg.seed)
        rows = [train_data[i] for i in indices]
        metrics, n_tokens = reward_model_step(model, optimizer, scaler, rows, lr, cfg, rt)
        stop_requested = stop.requested(step + 1, rt)
        stop_if_not_finite(metrics["train/loss"], step, ckpt_path, rt)
        dt = time.time() - t0
        logger.bar.update(1)
        logger.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        # passes over the training data: examples per optimizer step, all ranks, times steps, over examples
        metrics["train/epoch"] = (step + 1) * per_rank * rt.world_size / len(train_data)
        metrics["perf/tokens_per_s"] = n_tokens / dt
        metrics["perf/step_ms"] = 1000 * dt
        logger.log(step, metrics, echo=step % cfg.log_every == 0)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps or stop_requested:
            save_reward_model(ckpt_path, raw, optimizer, scaler, tok, step + 1, cfg, rt)
        if stop_requested:
            stop.exit(step + 1, out_dir, rt)
    logger.close()
    if rt.master:
        results = {
            "task": cfg.task,
            **{name.removeprefix("eval/"): value for name, value in last_eval.items()},
            "skipped": skipped,  # the preference records skipped per reason ({} for orm, prm)
            "eval_examples": len(eval_data),
            "eval_problems": problems,  # distinct held-out problems (orm, prm) or prompts (preference)
            "train_examples": len(train_data),
            "wall_time_s": time.time() - t_start,
        }
        with open(os.path.join(out_dir, "final_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        summary = f"{cfg.task}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in last_eval.items())
        print_end(summary, out_dir, results["wall_time_s"])
    cleanup(rt)


@torch.no_grad()
def best_of_n(cfg, rt, out_dir):
    """best_of_n.json: for each n of --best_of, best-of-n of the --policy's answers to held-out problems under the
    --init_from verifier (orm; or prm, a solution scored by --prm_aggregate of its steps), and majority voting over the
    same answers. The problems are grpo.py's evaluation problems: --eval_size draws of held-out problems (0: 128) from
    random.Random(1234), the distinct ones kept. N = max n answers a problem at temperature 1 (an answer ends at its
    --steps-th newline, as in sampled_data); gold, proxy: best_of_n_weights' unbiased estimate from the N, per
    problem, then the mean over problems (gold_se: their standard error); majority: majority_vote's gold, the mean
    over 64 random n-subsets of the N; weighted_majority: the same subsets' votes weighted by the verifier's
    probability that each answer is right (orm: sigmoid of its score; prm: the --prm_aggregate). kl: best_of_n_kl
    of the distinct answers sampled, p(y) the policy's probability of y's tokens (the newlines included), the rest
    (uncovered: its mean) one answer ranked lowest. Every rank computes the same; rank 0 writes and prints."""
    t_start = time.time()
    verifier, spec, task = load_reward_model(cfg.init_from)
    check(task in ("orm", "prm"), f"--best_of needs an arithmetic verifier (--task orm or prm), not a {task} model")
    policy, policy_spec, _ = load_model(cfg.policy)
    check(policy_spec == spec, f"--policy {cfg.policy}: its tokenizer is not the verifier's")
    if rt.master:
        print_start(policy, rt, out_dir, f"best-of-{cfg.best_of} under the {task} {cfg.init_from}")
    tok = get_tokenizer(spec)
    policy.to(rt.device)  # dropout 0: train and eval mode agree
    verifier.to(rt.device)
    every_n = [int(n) for n in cfg.best_of.split(",")]
    N = max(every_n)
    problems = held_out_problems(cfg.digits, cfg.ops, cfg.eval_size or 128, cfg.steps)  # grpo.py's evaluation problems
    E = len(problems)
    generator = torch.Generator().manual_seed(cfg.seed)
    rows = [problem for problem in problems for _ in range(N)]  # N rows a problem, in a row
    answers = []  # the text of each row's answer
    for i in range(0, len(rows), 1024):
        answers += sample_answers(policy, tok, rows[i : i + 1024], cfg, generator)
    row_pairs = [(prompt, y) for (prompt, _), y in zip(rows, answers)]  # each row's (prompt, answer)
    # each problem's distinct answers, in order of first appearance: their verifier score and policy log-prob
    pairs = list(dict.fromkeys(row_pairs))
    scores = solution_scores(verifier, tok, task, pairs, cfg.prm_aggregate, rt.device)
    logps = answer_logprobs(policy, tok, pairs, rt.device)
    found = dict(zip(pairs, zip(scores, logps)))  # (prompt, answer) -> (its score, its log-prob)
    # every row's score and gold, each problem's rows sorted by score (ties in sample order): (E, N) each
    s = torch.tensor([found[pair][0] for pair in row_pairs], dtype=torch.float64)
    s, order = s.view(E, N).sort(stable=True)
    # each row's gold, from one check: 1.0 right, 0.5 well formed but wrong, 0.0 not well formed
    checked = [arithmetic_reward(y, answer, 0.5) for (_, answer), y in zip(rows, answers)]
    right = (torch.tensor(checked) == 1.0).double().view(E, N).gather(1, order)
    W = torch.stack([best_of_n_weights(N, n) for n in every_n])  # (len(every_n), N)
    gold = right @ W.T  # (E, len(every_n)): each problem's estimate for each n
    proxy = s @ W.T
    # each answer's final result, None where it is not well formed
    finals = [y.split("=")[-1].strip() if c > 0 else None for y, c in zip(answers, checked)]
    # each answer's vote in weighted majority voting: the verifier's probability that it is right
    votes = [found[pair][0] for pair in row_pairs]
    if task == "orm":
        votes = torch.sigmoid(torch.tensor(votes)).tolist()
    majority = torch.zeros_like(gold)
    weighted = torch.zeros_like(gold)
    kl = torch.zeros_like(gold)
    uncovered = 0.0
    for e, (prompt, answer) in enumerate(problems):
        truth = answer.split("=")[-1].strip()
        mine = finals[e * N : (e + 1) * N]
        my_votes = votes[e * N : (e + 1) * N]
        distinct = dict.fromkeys(answers[e * N : (e + 1) * N])  # the problem's K distinct answers
        s_y, logp_y = torch.tensor([found[prompt, y] for y in distinct], dtype=torch.float64).T  # (K,) each
        uncovered += (1 - logp_y.exp().sum()).clamp(min=0).item() / E
        for j, n in enumerate(every_n):
            # 64 random n-subsets, from the random stream --seed set (rank 0's: rank 0 writes the results); plain
            # and weighted voting count the same subsets
            for _ in range(64):
                subset = random.sample(range(N), n)
                picked = [mine[i] for i in subset]
                majority[e, j] += majority_vote(picked, truth) / 64
                weighted[e, j] += majority_vote(picked, truth, [my_votes[i] for i in subset]) / 64
            kl[e, j] = best_of_n_kl(logp_y.exp(), s_y, n)
    columns = {  # (len(every_n),) each: a mean over the problems, or its standard error (nan for one problem)
        "gold": gold.mean(0),  # exact answers of the pick
        "gold_se": gold.std(0) / math.sqrt(E),
        "gold_a": gold[0::2].mean(0),  # the problems at even places: pick a peak on one half,
        "gold_b": gold[1::2].mean(0),  # report it on the other
        "majority": majority.mean(0),  # majority voting's gold over the same answers
        "majority_se": majority.std(0) / math.sqrt(E),
        "weighted_majority": weighted.mean(0),  # votes weighted by the verifier's probability that each is right
        "weighted_majority_se": weighted.std(0) / math.sqrt(E),
        "proxy": proxy.mean(0),  # the verifier's score of the pick
        "kl": kl.mean(0),  # exact, of the sampled answers and the uncovered rest
    }
    results = [  # a row per n
        {
            "n": n,
            **{name: values[j].item() for name, values in columns.items()},
            "kl_bound": math.log(n) - (n - 1) / n,
            "n_problems": E,
            "uncovered": uncovered,  # the policy's probability of the answers never sampled, mean over problems
            "samples_per_problem": N,
        }
        for j, n in enumerate(every_n)
    ]
    if rt.master:
        save_config(cfg, out_dir, rt)
        with open(os.path.join(out_dir, "best_of_n.json"), "w") as f:
            json.dump(results, f, indent=2)
        for row in results:  # a row per n, as best_of_n.json holds them
            print(json.dumps(row))
        summary = f"best-of-n on {E} held-out problems, {N} answers each (uncovered {uncovered:.4f})"
        print_end(summary, out_dir, time.time() - t_start)


def solution_scores(verifier, tok, task, pairs, aggregate="prod", device="cpu"):
    """The verifier's scores (a list of floats) of (prompt, answer) texts. orm: the score at the last token (score).
    prm: each answer encoded as a chain of steps, as it trains (sampled_example, encode), and aggregate_steps of its
    steps' scores."""
    if task == "orm":
        return score(verifier, tok, [prompt + y for prompt, y in pairs], device)
    block_size = verifier.body.config.block_size
    chains = [encode("prm", tok, sampled_example("prm", prompt, "", y), block_size) for prompt, y in pairs]
    out = []
    for i in range(0, len(chains), 256):
        ids, labels = zip(*chains[i : i + 256])  # the batch's token ids and labels
        idx, _ = pad_right(ids, device)  # (B, T)
        labels, _ = pad_right(labels, device, value=-1)  # (B, T)
        out += aggregate_steps(verifier(idx), labels, aggregate).tolist()
    return out


@torch.no_grad()
def answer_logprobs(policy, tok, pairs, device, batch_size=256):
    """log p(answer | prompt) under the policy at temperature 1 of (prompt, answer) texts: the sum over the answer's
    tokens, its newline included. A list of floats."""
    out = []
    for i in range(0, len(pairs), batch_size):
        batch = [(tok.encode(prompt), tok.encode(y)) for prompt, y in pairs[i : i + batch_size]]
        idx, _ = pad_right([p + a for p, a in batch], device)  # (B, T)
        # (B, T - 1): 1 where the target, the token at t + 1, is an answer's
        is_answer, _ = pad_right([[0] * (len(p) - 1) + [1] * len(a) for p, a in batch], device)
        logp, _ = policy(idx[:, :-1], idx[:, 1:], output="logprobs")  # (B, T - 1)
        out += (logp * is_answer).sum(1).tolist()
    return out


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
