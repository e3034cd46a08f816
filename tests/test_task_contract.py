"""The task contract: the task that docs/grpo.md ("Your own task") writes in one class runs through grpo.py's
training step and evaluation with no other change, and its rewards, reward mask, measures and held-out split are
what the page says."""

import random
import re
import zlib

import pytest
import torch
from conftest import ROOT

import grpo


def docs_task():
    """The class of the page's python block, defined among grpo.py's names (as if pasted beside its tasks)."""
    text = (ROOT / "docs" / "grpo.md").read_text()
    section = text[text.index("## Your own task") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    names = dict(vars(grpo))
    exec(code, names)
    return names["ReverseTask"]


def tiny_run(tmp_path, **overrides):
    """grpo.py's setup of a tiny char model on the arithmetic characters (digits, "=" and the newline), CPU."""
    settings = dict(task="arithmetic", out_dir=str(tmp_path / "run"), device="cpu", horizon=5, batch_size=4)
    settings.update(group_size=4, n_layer=1, n_head=2, n_embd=32, block_size=32, eval_size=8, warmup_steps=0)
    cfg = grpo.resolve_clip(grpo.Config(**{**settings, **overrides}))
    grpo.validate(cfg)
    return grpo.setup(cfg)


def spy(monkeypatch, name):
    calls = []
    original = getattr(grpo, name)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(grpo, name, wrapped)
    return calls


def test_the_docs_task_holds_its_numbers_out_and_rewards_exact_reversals_on_the_last_token(tmp_path):
    run = tiny_run(tmp_path)
    task = docs_task()(run.tok)
    random.seed(0)
    prompts, answers = task.sample(500)
    words = [run.tok.decode(p)[:-1] for p in prompts]
    assert all(zlib.crc32(f"{w}=".encode()) % 10 != 0 for w in words)  # training never draws a held-out number
    assert all(zlib.crc32(f"{w}=".encode()) % 10 == 0 for w in task.eval_words) and len(task.eval_words) == 64
    assert answers[:3] == [w[::-1] + "\n" for w in words[:3]]
    texts = [answers[0], answers[1][:-1] + "0", "1\n", answers[3]]  # right, no newline, wrong, right
    completion = torch.tensor([run.tok.encode(t.ljust(5, "\n")) for t in texts])
    mask = torch.tensor([[float(i < len(t)) for i in range(5)] for t in texts])
    rewards, reward_mask = task.rewards(prompts[:4], completion, mask, answers[:4])
    last = torch.tensor([[float(i == len(t) - 1) for i in range(5)] for t in texts])
    assert torch.equal(reward_mask, last)
    assert rewards.sum(1).tolist() == [1.0, 0.0, 0.0, 1.0] and torch.all(rewards[last == 0] == 0)
    assert task.measures(completion, mask, answers[:4])["rl/accuracy"].tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("partial", [False, True])
def test_the_docs_task_runs_through_the_training_step_and_the_evaluation(tmp_path, monkeypatch, partial):
    """The exact reward (a random model never reverses a number: no signal, no update) and the same class with
    partial credit for the first digit (signal: the policy moves). Either way the step's rewards are the task's,
    on each completion's last token, and its rl/ metrics come from them."""
    ReverseTask = docs_task()

    class FirstDigit(ReverseTask):
        def exact(self, completion, mask, answers):  # 1.0 where the first digit is right
            first = [self.tok.encode(a[0])[0] for a in answers]
            return (completion[:, 0] == torch.tensor(first)).float()

    run = tiny_run(tmp_path)
    run.task = FirstDigit(run.tok) if partial else ReverseTask(run.tok)
    batches = spy(monkeypatch, "collect")
    before = [p.detach().clone() for p in run.raw.parameters()]
    random.seed(0)
    torch.manual_seed(0)
    metrics = grpo.training_step(run, 0)
    batch = batches[0]
    texts = [run.tok.decode(t[m > 0].tolist()) for t, m in zip(batch["completion"], batch["mask"])]
    words = [run.tok.decode(p)[:-1] for p in batch["prompts"]]
    expected = [float(t == w[::-1] + "\n") for t, w in zip(texts, words)]
    if partial:
        expected = [float(t[:1] == w[-1]) for t, w in zip(texts, words)]
    assert batch["rewards"].sum(1).tolist() == expected
    assert batch["reward_mask"].sum(1).tolist() == [1.0] * len(texts)
    assert metrics["rl/reward_mean"] == pytest.approx(sum(expected) / len(expected))
    assert metrics["rl/accuracy"] == pytest.approx(sum(expected) / len(expected))
    groups = torch.tensor(expected).view(-1, 4)
    signal = (groups != groups[:, :1]).any(1)  # a group whose rewards differ
    assert metrics["rl/zero_std_frac"] == pytest.approx(1 - signal.float().mean().item())
    moved = any(not torch.equal(a, b) for a, b in zip(before, run.raw.parameters()))
    assert moved == bool(signal.any()) and moved == partial
    grpo.save_config(run.cfg, run.out_dir, run.rt)  # the run folder, as main() writes it
    logger = grpo.Logger(run.cfg, run.out_dir, run.rt, 1, 0)
    evaluation = grpo.evaluate_policy(run, 1, logger)
    logger.close()
    assert evaluation["eval/n_problems"] == 64 and 0 <= evaluation["eval/accuracy"] <= 1
