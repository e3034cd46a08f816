"""Run under torchrun (tests/test_grpo.py): each rank computes grpo.py's policy_loss on its share of a fixed batch,
with the sequence and token counts all-reduced as grpo.py does; the summed losses and gradients must equal one
process's loss and gradient on the whole batch, for every loss type. The ranks' shares hold very different token
counts, so a per-rank normaliser would fail. Writes "ok" or the mismatches to argv[1]."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

result_path = sys.argv[1]
rt = grpo.setup_runtime(grpo.Config(device="cpu", dtype="float32", seed=0))
torch.manual_seed(0)  # the same batch on every rank
N, T = 8, 6
logp = torch.randn(N, T) * 0.5 - 1.0
old_logp = logp + 0.3 * torch.randn(N, T)
adv = torch.randn(N)
mask = torch.ones(N, T)
mask[N // 2 :, 2:] = 0.0  # rank 1's sequences are short: 2 tokens each against rank 0's 6
rows = slice(rt.rank * N // 2, (rt.rank + 1) * N // 2)

errors = []
for loss_type in ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "reinforce"):
    whole = logp.clone().requires_grad_()
    loss, _ = grpo.policy_loss(whole, old_logp, adv, mask, loss_type, 0.2, 0.28, max_len=T)
    loss.backward()

    part = logp.clone().requires_grad_()
    n_seqs = grpo.all_reduce(torch.tensor(float(N // 2)), rt)
    n_tokens = grpo.all_reduce(mask[rows].sum(), rt)
    share, _ = grpo.policy_loss(
        part[rows], old_logp[rows], adv[rows], mask[rows], loss_type, 0.2, 0.28, T, num_seqs=n_seqs, num_tokens=n_tokens
    )
    share.backward()
    total = grpo.all_reduce(share.detach().clone(), rt)
    grad = grpo.all_reduce(part.grad.clone(), rt)
    if not torch.allclose(total, loss, atol=1e-6):
        errors.append(f"{loss_type}: loss {total.item():.6g} across ranks, {loss.item():.6g} in one process")
    if not torch.allclose(grad, whole.grad, atol=1e-6):
        errors.append(f"{loss_type}: gradient differs by {(grad - whole.grad).abs().max().item():.3g}")
if rt.master:
    Path(result_path).write_text("ok" if not errors else "\n".join(errors))
grpo.cleanup(rt)
