"""grpo.py and ppo.py with --best_of print the best-of-n table (n, gold accuracy, proxy score, KL_bon) when they
compute it, the same numbers as best_of_n.json."""

import json

import pytest
import torch
from test_heldout_rl import arithmetic_task, reward_checkpoint, task_runtime

import grpo
import ppo


@pytest.mark.parametrize("module", [grpo, ppo], ids=lambda m: m.__name__)
def test_best_of_n_table_is_printed_with_the_json_numbers(module, tmp_path, monkeypatch, capsys):
    """A stand-in policy answers every problem right; the step-0 evaluation prints a header and one row per n with
    best_of_n.json's gold accuracy, proxy score and KL_bon."""
    rm_path = reward_checkpoint(tmp_path / "rm.pt", "orm")
    task = arithmetic_task(module, tmp_path, digits=1, eval_size=20, reward_model=str(rm_path), best_of="1,2,4")

    def stand_in(model, prompts, horizon, temperature, top_k, eos_id, rt, generator=None):
        texts = [f"{eval(task.tok.decode(p)[:-1])}\n" for p in prompts]
        completion = torch.tensor([task.tok.encode(t.ljust(horizon, "\n")) for t in texts])
        mask = torch.tensor([[float(i < len(t)) for i in range(horizon)] for t in texts])
        return completion, mask

    monkeypatch.setattr(module, "sample_completions", stand_in)
    task.evaluate(None, None, task_runtime(module), task.tok, 0)
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "best_of_n.json").read_text())
    assert f"best-of-n of the initial policy on {len(task.eval_problems)} held-out problems" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["n"])
    assert "gold" in lines[header] and "proxy" in lines[header] and "KL" in lines[header]
    for line, r in zip(lines[header + 1 :], results):
        cells = line.split()
        assert int(cells[0]) == r["n"]
        assert float(cells[1]) == pytest.approx(r["gold_accuracy"], abs=1e-3) == 1.0
        assert float(cells[3]) == pytest.approx(r["gold_accuracy_se"], abs=1e-3)
        assert float(cells[4]) == pytest.approx(r["proxy_score"], abs=1e-4)
        assert float(cells[5]) == pytest.approx(r["kl_bon"], abs=1e-3)
    assert len(lines) >= header + 1 + len(results)
