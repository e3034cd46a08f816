"""Run under torchrun (tests/test_gpt_train.py): DDP or FSDP gradients on a split global batch must equal one
process's gradients on the whole batch, for gpt.py's training loss (the fused linear cross-entropy, against the
plain cross-entropy of the logits) and for an RL objective of forward(..., output="logprobs") (linear_logprobs,
against token_logprobs and the entropy of the logits). Each rank writes "ok" or its mismatches to argv[2] + ".rank<r>"
before leaving the process group."""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpt  # noqa: E402

parallel, result_path = sys.argv[1], sys.argv[2]
rt = gpt.setup_runtime(gpt.Config(device="cpu", dtype="float32", parallel=parallel, seed=0))
torch.manual_seed(0)  # the same model and batch on every rank
model = gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=16))
x = torch.randint(40, (4, 16))
y = torch.randint(40, (4, 16))
y[0, :10] = -1  # uneven target counts: the normaliser must be the global count, not a per-rank mean
y[3, 5:] = -1
reference = copy.deepcopy(model)
rl_model, rl_reference = copy.deepcopy(model), copy.deepcopy(model)
n_global = (y != -1).sum()
F.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").div(n_global).backward()

wrapped = gpt.wrap_model(model, rt)
rows = slice(2 * rt.rank, 2 * rt.rank + 2)
for micro in range(2):  # two micro-batches per rank, gradients synchronised on the last one only
    gpt.grad_sync(wrapped, micro == 1)
    xs, ys = x[rows][micro : micro + 1], y[rows][micro : micro + 1]
    loss = wrapped(xs, ys, output="loss")[1] * (ys != -1).sum()  # as in gpt.py's training loop
    (loss * rt.world_size / n_global).backward()

# RL: log-probs and entropy of the last 6 positions, weighted per token (advantages, an entropy bonus)
targets, a, b = y[:, -6:].clamp(min=0), torch.randn(4, 6), torch.randn(4, 6)
logq = torch.log_softmax(rl_reference(x, keep_last=6)[0], -1)
entropy = -(logq.exp() * logq).sum(-1)
((gpt.token_logprobs(logq, targets) * a).sum() + (entropy * b).sum()).backward()
rl_wrapped = gpt.wrap_model(rl_model, rt)
for micro in range(2):
    gpt.grad_sync(rl_wrapped, micro == 1)
    r = slice(2 * rt.rank + micro, 2 * rt.rank + micro + 1)
    logp, ent = rl_wrapped(x[r], targets[r], keep_last=6, output="logprobs")
    (((logp * a[r]).sum() + (ent * b[r]).sum()) * rt.world_size).backward()

errors = []
for kind, ours, theirs in (("loss", model, reference), ("rl", rl_model, rl_reference)):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not torch.allclose(grad, q.grad, atol=1e-6, rtol=1e-4):
            errors.append(f"{kind} {name}: max diff {(grad - q.grad).abs().max().item():.3g}")
Path(f"{result_path}.rank{rt.rank}").write_text("ok" if not errors else "\n".join(errors))
gpt.cleanup(rt)
