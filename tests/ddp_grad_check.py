"""Run under torchrun (tests/test_gpt_train.py): DDP or FSDP gradients of gpt.py's training loss (the fused
linear cross-entropy) on a split global batch must equal one process's gradients of the plain cross-entropy of
the logits on the whole batch. Writes "ok" or the mismatch to argv[2]."""

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
n_global = (y != -1).sum()
F.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").div(n_global).backward()

wrapped = gpt.wrap_model(model, rt)
rows = slice(2 * rt.rank, 2 * rt.rank + 2)
for micro in range(2):  # two micro-batches per rank, gradients synchronised on the last one only
    gpt.grad_sync(wrapped, micro == 1)
    xs, ys = x[rows][micro : micro + 1], y[rows][micro : micro + 1]
    loss = wrapped(xs, ys, return_logits=False)[1] * (ys != -1).sum()  # as in gpt.py's training loop
    (loss * rt.world_size / n_global).backward()

errors = []
for (name, p), q in zip(model.named_parameters(), reference.parameters()):
    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    if not torch.allclose(grad, q.grad, atol=1e-6, rtol=1e-4):
        errors.append(f"{name}: max diff {(grad - q.grad).abs().max().item():.3g}")
if rt.master:
    Path(result_path).write_text("ok" if not errors else "\n".join(errors))
gpt.cleanup(rt)
