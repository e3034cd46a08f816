"""Reruns docs/gpt.md's variants table: the standard GPT, --attention mla and --objective denoise on char-level tiny
Shakespeare, the default model, 300 steps each; prints parameters, final validation loss, the KV cache's bytes per
token (measured on the cache after a full-context prefill) and the sampling speed of samples.txt (wall clock).

    python experiments/gpt_variants.py                 # the documented runs: seed 1337 (~3 x 1.5 min)
    python experiments/gpt_variants.py --seeds 1 2 3   # mean +- s.e. over three seeds
    python experiments/gpt_variants.py --quick         # a tiny model for a few steps: does it still run?
"""

import os
import sys

import torch
from common import ROOT, final_results, fmt, parse_args, print_table, run

sys.path.insert(0, str(ROOT))
import gpt  # noqa: E402  (the KV cache is measured on the model itself)

VARIANTS = {
    "standard (`--attention mha`)": [],
    "`--attention mla`": ["--attention", "mla"],
    "`--objective denoise`": ["--objective", "denoise"],
}


def kv_bytes_per_token(out_dir):
    """Bytes the KV cache holds per token after a full-context prefill (None: the denoiser keeps no cache)."""
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    if ckpt["model_config"].get("objective") == "denoise":
        return None
    model = gpt.make_model(ckpt["model_config"])
    model.load_state_dict(ckpt["model"])
    n = model.config.block_size
    cache = gpt.KVCache(model.config, 1, n, "cpu")
    with torch.no_grad():
        model(torch.zeros(1, n, dtype=torch.long), cache=cache)
    held = [t for t in (cache.k, cache.v, getattr(cache, "latent", None)) if t is not None]
    return sum(t.numel() * t.element_size() for t in held) // n


args = parse_args("gpt_variants", __doc__, seeds=(1337,))
flags = ["--max_steps", "300", "--eval_every", "100"]
if args.quick:
    flags = ["--max_steps", "10", "--eval_every", "10", "--eval_iters", "2", "--n_layer", "1", "--n_embd", "48"]
    flags += ["--block_size", "32", "--batch_size", "4", "--sample_tokens", "16", "--denoise_steps", "4"]
rows = []
for name, variant in VARIANTS.items():
    results = []
    for seed in args.seeds:
        out_dir = os.path.join(args.out, f"{variant[-1] if variant else 'mha'}-seed{seed}")
        results.append(final_results(run("gpt.py", [*flags, *variant, "--seed", seed], out_dir)))
    kv = kv_bytes_per_token(out_dir)
    rows.append(
        [
            name,
            f"{results[0]['params']:,}",
            fmt([r["final_val_loss"] for r in results]),
            "none" if kv is None else f"{kv:,}",
            fmt([r["sample_tokens_per_s"] for r in results], 0),
        ]
    )
header = ["run", "parameters", "val loss", "KV cache bytes per token", "sampled tokens/s (wall)"]
print_table(header, rows)
