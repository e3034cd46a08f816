"""Run under torchrun (tests/test_grpo.py) with a mode and a result path; writes "ok" or the mismatches there.

normaliser: each rank computes grpo.py's policy_loss on its share of a fixed batch, with the sequence and token counts
all-reduced as grpo.py does; the summed losses and gradients must equal one process's loss and gradient on the whole
batch, for every loss type. The ranks' shares hold very different token counts, so a per-rank normaliser would fail.

rollouts: each rank holds half of a fixed batch of rollouts (its own groups); grpo.py's compute_advantages (every kind
and --scale_rewards) and rollout_metrics must give each rank the rows and the numbers that one process computes on
the whole batch. Rank 1's rewards spread four times wider than rank 0's, so a per-rank std would fail."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402


def check_normaliser(rt):
    torch.manual_seed(0)  # the same batch on every rank
    N, T = 8, 6
    logp = torch.randn(N, T) * 0.5 - 1.0
    old_logp = logp + 0.3 * torch.randn(N, T)
    adv = torch.randn(N)
    mask = torch.ones(N, T)
    mask[N // 2 :, 2:] = 0.0  # rank 1's sequences are short: 2 tokens each against rank 0's 6
    rows = slice(rt.rank * N // 2, (rt.rank + 1) * N // 2)
    errors = []
    for loss_type in ("grpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "reinforce", "sapo"):
        whole = logp.clone().requires_grad_()
        loss, _ = grpo.policy_loss(whole, old_logp, adv, mask, loss_type, 0.2, 0.28, max_len=T)
        loss.backward()

        part = logp.clone().requires_grad_()
        n_seqs = grpo.all_reduce(torch.tensor(float(N // 2)), rt)
        n_tokens = grpo.all_reduce(mask[rows].sum(), rt)
        share, _ = grpo.policy_loss(
            part[rows],
            old_logp[rows],
            adv[rows],
            mask[rows],
            loss_type,
            0.2,
            0.28,
            T,
            num_seqs=n_seqs,
            num_tokens=n_tokens,
        )
        share.backward()
        total = grpo.all_reduce(share.detach().clone(), rt)
        grad = grpo.all_reduce(part.grad.clone(), rt)
        if not torch.allclose(total, loss, atol=1e-6):
            errors.append(f"{loss_type}: loss {total.item():.6g} across ranks, {loss.item():.6g} in one process")
        if not torch.allclose(grad, whole.grad, atol=1e-6):
            errors.append(f"{loss_type}: gradient differs by {(grad - whole.grad).abs().max().item():.3g}")
    return errors


def check_rollouts(rt):
    torch.manual_seed(1)  # the same batch on every rank
    G, N, H = 4, 16, 5  # two groups per rank
    rewards = torch.randint(0, 3, (N,)).float() / 2  # 0, 0.5 or 1 (1: a correct answer)
    rewards[N // 2 :] *= 4  # rank 1: 0, 2 or 4
    token_rewards = torch.randn(N, H) * torch.linspace(1, 4, N)[:, None]
    lengths = torch.randint(1, H + 1, (N, 1))
    mask = (torch.arange(H) < lengths).float()  # (N, H)
    truncated = lengths[:, 0] == H
    rollout_kl = torch.rand(N)  # k1 summed over each completion
    outcome, outcome_mask = grpo.at_last_token(rewards, mask)  # (N, H) each: a reward on each last real token

    def measures(completion, mask, info):  # info: the outcome rewards, 1.0 for a right answer
        return {"rl/accuracy": (info == 1.0).float(), "rl/gold_reward": None}

    task = SimpleNamespace(eos_id=0, measures=measures)
    one = grpo.Runtime(torch.device("cpu"), torch.float32)  # a single process
    rows = slice(rt.rank * N // 2, (rt.rank + 1) * N // 2)
    errors = []
    cases = [("group", s, outcome, outcome_mask) for s in ("group", "batch", "none")]
    cases += [("group", "batch", token_rewards, mask), ("rloo", "group", outcome, outcome_mask)]
    cases += [("process", "group", token_rewards, mask)]
    for kind, scale, r, m in cases:
        whole = grpo.compute_advantages(r, m, mask, kind, G, scale, one)
        part = grpo.compute_advantages(r[rows], m[rows], mask[rows], kind, G, scale, rt)
        if not torch.allclose(part, whole[rows], atol=1e-6):
            shape = "outcome" if m is outcome_mask else "dense"
            errors.append(f"{kind} advantages, scale {scale}, {shape} rewards: rank {rt.rank} differs")
    for r, m, kind in ((outcome, outcome_mask, "group"), (token_rewards, mask, "process")):
        first = {"completion": None, "info": rewards, "rewards": r, "reward_mask": m, "mask": mask}
        first["rollout_kl"] = rollout_kl
        whole = grpo.rollout_metrics(task, first, {"mask": mask, "truncated": truncated}, G, one, kind)
        first = {
            "completion": None,
            "info": rewards[rows],
            "rewards": r[rows],
            "reward_mask": m[rows],
            "mask": mask[rows],
            "rollout_kl": rollout_kl[rows],
        }
        part = grpo.rollout_metrics(task, first, {"mask": mask[rows], "truncated": truncated[rows]}, G, rt, kind)
        for k, v in whole.items():
            if v is None and part[k] is None:  # a metric this task does not have (rl/gold_reward)
                continue
            if not math.isclose(part[k], v, rel_tol=1e-6, abs_tol=1e-9):
                errors.append(f"{k} ({kind}): {part[k]:.6g} on rank {rt.rank}, {v:.6g} in one process")
    return errors


result_path = sys.argv[2]
rt = grpo.setup_runtime(grpo.Config(device="cpu", dtype="float32", seed=0))
errors = {"normaliser": check_normaliser, "rollouts": check_rollouts}[sys.argv[1]](rt)
everyone = [None] * rt.world_size
torch.distributed.all_gather_object(everyone, errors)  # every rank's mismatches
if rt.master:
    Path(result_path).write_text("\n".join(e for errs in everyone for e in errs) or "ok")
grpo.cleanup(rt)
