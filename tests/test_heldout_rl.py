"""Issue #29 in grpo.py and ppo.py: arithmetic's held-out rule (no training draw is held out, every evaluation problem
is, distinct and counted), the sampled gold reward on each half of the held-out problems, the reward
model's checksum on --resume, the reward models the arithmetic task accepts, the hint for a model from scratch, and
grpo's KL axis under --mask_truncated / --dynamic_sampling."""

import math
import random
import shutil
import zlib

import pytest
import torch
from conftest import char_checkpoint, run_main, run_script
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
import ppo

MODULES = [grpo, ppo]
CHARS = grpo.ARITHMETIC_CHARS


def held(prompt):
    """SPEC section 8, written out here: a problem is held out iff crc32 of its prompt is 0 mod 10."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def reward_checkpoint(path, task, seed=1):
    """A tiny random char reward model of the arithmetic characters, saved as reward_model.py --task TASK saves one."""
    char_checkpoint(path, CHARS, block_size=32, seed=seed, reward_head=True)
    ckpt = torch.load(path, weights_only=True)
    ckpt["reward_task"] = task
    torch.save(ckpt, path)
    return path


def arithmetic_task(module, out_dir, **overrides):
    """module.ArithmeticTask on the char tokenizer, CPU float32."""
    cfg = module.Config(**{"task": "arithmetic", "init_from": "init.pt", "horizon": 4, **overrides})
    rt = module.Runtime(torch.device("cpu"), torch.float32)
    tok = module.CharTokenizer(CHARS)
    return module.ArithmeticTask(cfg, tok, rt)


def tiny_policy(module):
    torch.manual_seed(0)
    return module.GPT(module.GPTConfig(32, len(CHARS), 1, 2, 16, 0.0, True))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    digits=st.integers(1, 3),
    ops=st.sampled_from(["+", "-", "*", "+-", "+-*"]),
    want_held=st.booleans(),
)
def test_draw_problem_draws_by_the_held_out_rule(seed, digits, ops, want_held):
    for module in MODULES:
        prompt, answer = module.draw_problem(random.Random(seed), digits, ops, want_held)
        assert held(prompt) == want_held == module.held_out(prompt)
        assert answer == f"{eval(prompt[:-1])}\n"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_no_training_draw_is_held_out_and_every_evaluation_problem_is(module, tmp_path, monkeypatch):
    """3000 training draws of 2-digit problems: none held out (today's draws hold out about one in ten). The greedy
    evaluation asks exactly the task's evaluation problems, each once, all held out; eval/n_problems counts them."""
    task = arithmetic_task(module, tmp_path, digits=2, ops="+-", eval_size=300)
    random.seed(0)
    prompts, answers = task.sample(3000)
    texts = [task.tok.decode(p) for p in prompts]
    assert not [t for t in texts if held(t)]
    assert all(a == f"{eval(t[:-1])}\n" for t, a in zip(texts, answers))
    asked = []
    real = module.sample_completions

    def recording(model, prompts, *args, **kwargs):  # the real sampler, noting what it was asked
        asked.extend(task.tok.decode(p) for p in prompts)
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(module, "sample_completions", recording)
    metrics, _ = task.evaluate(tiny_policy(module), None, task_runtime(module), task.tok, 5)
    assert asked and all(held(p) for p in asked)
    assert len(set(asked)) == len(asked) == metrics["eval/n_problems"]
    assert sorted(asked) == sorted(p for p, _ in task.eval_problems)
    assert len(asked) > 150  # 300 draws of 2-digit problems: 188 distinct (one-digit operands repeat)


def task_runtime(module):
    return module.Runtime(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_sampled_gold_on_each_half_of_the_problems_is_that_halfs_share_of_exact_answers(module, tmp_path, monkeypatch):
    """A stand-in policy answers each problem right or off by one, at random. eval/sample_accuracy is the share of
    exact sampled answers (four a problem, temperature 1); eval/sample_accuracy_a and _b the same over the problems at
    even and odd places of the sorted held-out list, each a mean over its problems."""
    rm_path = reward_checkpoint(tmp_path / "rm.pt", "orm")
    task = arithmetic_task(module, tmp_path, digits=1, eval_size=60, reward_model=str(rm_path))
    rng = random.Random(0)
    sampled = {}  # prompt -> the answers sampled at temperature 1, in order

    def stand_in(model, prompts, horizon, temperature, top_k, eos_id, rt, generator=None, n_ends=1):
        texts = []
        for p in prompts:
            prompt = task.tok.decode(p)
            text = f"{eval(prompt[:-1]) + rng.choice([0, 0, 1, -1])}\n"
            texts.append(text)
            if temperature > 0:
                assert (temperature, top_k) == (1.0, None)  # the policy itself: every token
                sampled.setdefault(prompt, []).append(text)
        completion = torch.tensor([task.tok.encode(t.ljust(horizon, "\n")) for t in texts])
        mask = torch.tensor([[float(i < len(t)) for i in range(horizon)] for t in texts])
        return completion, mask

    monkeypatch.setattr(module, "sample_completions", stand_in)
    metrics, _ = task.evaluate(tiny_policy(module), tiny_policy(module), task_runtime(module), task.tok, 0)
    prompts = [p for p, _ in task.eval_problems]
    assert sorted(sampled) == prompts and all(len(answers) == 4 for answers in sampled.values())
    right = [sum(a == f"{eval(p[:-1])}\n" for a in sampled[p]) / 4 for p in prompts]  # per problem
    assert metrics["eval/sample_accuracy"] == pytest.approx(sum(right) / len(right), abs=1e-6)
    half_a = right[0::2]
    half_b = right[1::2]
    assert metrics["eval/sample_accuracy_a"] == pytest.approx(sum(half_a) / len(half_a), abs=1e-6)
    assert metrics["eval/sample_accuracy_b"] == pytest.approx(sum(half_b) / len(half_b), abs=1e-6)
    assert metrics["eval/n_problems"] == len(prompts) == len(half_a) + len(half_b)


def test_grpo_logs_the_kl_of_the_rollouts_the_rewards_score(tmp_path):
    """With --mask_truncated or --dynamic_sampling, the batch trained on differs from the first sampling round, whose
    rewards are logged: rl/rollout_kl is the first round's k1 summed over every token of each
    completion. collect measures it in a pass of its own (sampling policy against the reference), and leaves
    old_logp unset: with one update per batch the update never depends on what is logged."""
    rm_path = reward_checkpoint(tmp_path / "rm.pt", "orm")
    task = arithmetic_task(grpo, tmp_path, reward_model=str(rm_path), eval_size=4)
    rt = task_runtime(grpo)
    torch.manual_seed(1)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    first = {
        "completion": torch.randint(len(CHARS), (4, 4)),
        "mask": mask,
        "info": ["1\n", "2\n", "3\n", "4\n"],
        "rollout_kl": torch.tensor([0.5, 1.0, 1.5, 4.0]),
    }
    first["rewards"], first["reward_mask"] = grpo.at_last_token(torch.randn(4), mask)  # one reward per completion
    batch = {"mask": mask[:2].repeat(2, 1), "truncated": torch.tensor([True, False, True, False])}  # other rows
    metrics = grpo.rollout_metrics(task, first, batch, 2, rt, "group")
    assert metrics["rl/rollout_kl"] == pytest.approx(1.75)
    cfg = grpo.Config(task="arithmetic", reward_model=str(rm_path), horizon=4, group_size=2, mask_truncated=True)
    policy = tiny_policy(grpo)
    reference = tiny_policy(grpo)
    with torch.no_grad():
        reference.lm_head.weight.mul_(2.0)  # another model: a KL to measure
    collected = grpo.collect(task, policy, reference, cfg, rt, 2)
    assert collected["old_logp"] is None
    seq, attn = grpo.join(collected["prompts"], collected["completion"])
    logp = grpo.completion_logprobs(policy, seq, attn, 4, temperature=cfg.temperature, top_k=cfg.top_k or None)[0]
    expected = ((logp - collected["ref_logp"]) * collected["mask"]).sum(1)  # (N,)
    assert torch.allclose(collected["rollout_kl"], expected, rtol=1e-5, atol=1e-6)
    assert collected["rollout_kl"].abs().sum() > 0


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_the_arithmetic_task_takes_only_an_orm_or_a_prm(module, tmp_path, capsys):
    """A preference reward model (HH-RLHF pairs) is no verifier of arithmetic: one line, exit code 2. orm and prm
    models are taken."""
    for task in ("orm", "prm"):
        arithmetic_task(module, tmp_path, reward_model=str(reward_checkpoint(tmp_path / f"{task}.pt", task)))
    capsys.readouterr()
    preference = reward_checkpoint(tmp_path / "preference.pt", "preference")
    with pytest.raises(SystemExit) as e:
        arithmetic_task(module, tmp_path, reward_model=str(preference))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "preference" in lines[0] and "orm" in lines[0], lines


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_arithmetic_from_scratch_says_so_and_names_the_warm_start(module, tmp_path, capsys):
    """--init_from scratch on arithmetic: one line that a model from scratch cannot do arithmetic (every group
    scores alike: rl/zero_std_frac 1 at step 0) and the gpt.py warm start; a checkpoint start prints nothing of it."""
    arithmetic_task(module, tmp_path, init_from="scratch")
    lines = [line for line in capsys.readouterr().out.splitlines() if "scratch" in line]
    assert len(lines) == 1 and "rl/zero_std_frac" in lines[0] and "gpt.py" in lines[0], lines
    arithmetic_task(module, tmp_path)
    assert "scratch" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_resume_refuses_another_reward_model(tmp_path, script, monkeypatch):
    """ckpt.pt keeps a checksum of the reward model's weights: --resume with another reward model ends with one line
    and exit code 2; the same weights at another path resume."""
    init = char_checkpoint(tmp_path / "init.pt", CHARS, block_size=32)
    rm = reward_checkpoint(tmp_path / "rm.pt", "orm", seed=1)
    other = reward_checkpoint(tmp_path / "other.pt", "orm", seed=2)
    out = tmp_path / "run"
    args = ["--task", "arithmetic", "--init_from", init, "--horizon", "4", "--batch_size", "4", "--eval_size", "8"]
    if script == "grpo.py":
        args += ["--group_size", "2"]
    module = {"grpo.py": grpo, "ppo.py": ppo}[script]
    args += ["--reward_model", rm, "--max_steps", "2", "--eval_every", "2"]
    run_main(module, monkeypatch, *args, "--out_dir", out)
    bad = run_script(script, "--resume", "--out_dir", out, "--max_steps", "4", "--reward_model", other)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "--reward_model" in lines[0], lines
    same = shutil.copy(rm, tmp_path / "copy.pt")
    run_main(module, monkeypatch, "--resume", "--out_dir", out, "--max_steps", "4", "--reward_model", same)
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 4


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_sampled_evaluation_is_gold_proxy_and_kl_of_the_policys_own_answers(module, tmp_path, monkeypatch):
    """With a reward model and a reference, each evaluation also samples four answers a held-out problem at
    temperature 1: eval/sample_accuracy is the checker's share of exact answers among them, eval/sample_rm_score the
    reward model's mean score of each (prompt + answer) alone, eval/sample_kl the mean over answers of
    sum_t log pi(o_t) - log pi_ref(o_t), each recomputed here from full-vocabulary log-softmaxes, one answer at a
    time. A reference equal to the policy gives a KL of 0."""
    rm_path = reward_checkpoint(tmp_path / "rm.pt", "orm")
    task = arithmetic_task(module, tmp_path, digits=1, eval_size=40, reward_model=str(rm_path))
    policy = tiny_policy(module)
    torch.manual_seed(1)
    ref = module.GPT(policy.config)  # other weights
    sampled = []
    real = module.sample_completions

    def recording(model, prompts, horizon, temperature, top_k, eos_id, rt, generator=None, n_ends=1):
        completion, mask = real(model, prompts, horizon, temperature, top_k, eos_id, rt, generator, n_ends)
        if temperature > 0:
            sampled.extend(zip(prompts, completion.tolist(), mask.tolist()))
        return completion, mask

    monkeypatch.setattr(module, "sample_completions", recording)
    metrics, _ = task.evaluate(policy, ref, task_runtime(module), task.tok, 5)
    E = len(task.eval_problems)
    assert len(sampled) == 4 * E
    answers = dict(task.eval_problems)  # prompt -> the right answer, with its newline
    exact = []
    scores = []
    kls = []
    with torch.no_grad():
        for prompt, completion, mask in sampled:
            n = int(sum(mask))
            answer = completion[:n]
            text = task.tok.decode(answer)
            exact.append(float(text == answers[task.tok.decode(prompt)]))
            ids = torch.tensor([prompt + answer])
            scores.append(task.rm(ids)[0, -1].item())
            logp = 0.0
            for model, sign in [(policy, 1.0), (ref, -1.0)]:
                logits = model(ids[:, :-1])[0].double().log_softmax(-1)[0]  # (T - 1, V)
                for t in range(len(prompt), len(prompt) + n):
                    logp += sign * logits[t - 1, ids[0, t]].item()
            kls.append(logp)
    assert metrics["eval/sample_accuracy"] == pytest.approx(sum(exact) / len(exact), abs=1e-6)
    assert metrics["eval/sample_rm_score"] == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    assert metrics["eval/sample_kl"] == pytest.approx(sum(kls) / len(kls), abs=1e-4)
    assert abs(metrics["eval/sample_kl"]) > 1e-3  # the two models differ
    same, _ = task.evaluate(policy, policy, task_runtime(module), task.tok, 5)
    assert same["eval/sample_kl"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_a_learned_outcome_reward_is_an_orms_score_or_a_prms_product_of_step_probabilities(module, tmp_path):
    """The arithmetic task's learned reward of a completion: an orm's score at its last real token (with
    --rm_sigmoid, its sigmoid: the probability of a right answer); a prm's product of its steps' probabilities,
    P(every step right) under Lightman et al.'s labels, each step scored at its newline (a cut-off last step at a
    newline written after it), never the last token's score alone."""
    tok = module.CharTokenizer(CHARS)
    prompts = [tok.encode(p) for p in ("1+2*4=", "9*9-1=")]
    texts = ["1+2=3\n3*4=12\n", "9*9=81\n81-1=8"]
    completion = torch.tensor([tok.encode(t.ljust(14, "\n")) for t in texts])
    mask = torch.tensor([[float(i < len(t)) for i in range(14)] for t in texts])
    orm = reward_checkpoint(tmp_path / "orm.pt", "orm")
    raw = arithmetic_task(module, tmp_path, reward_model=str(orm), steps=2, horizon=14)
    sig = arithmetic_task(module, tmp_path, reward_model=str(orm), steps=2, horizon=14, rm_sigmoid=True)
    scores = raw.score(prompts, completion, mask, None)
    on_last, reward_mask = raw.rewards(prompts, completion, mask, None)  # the score on the last real token
    assert torch.equal(on_last.sum(1), scores) and reward_mask.sum(1).tolist() == [1.0, 1.0]
    with torch.no_grad():
        last = [raw.rm(torch.tensor([p + tok.encode(t)]))[0, -1] for p, t in zip(prompts, texts)]
    torch.testing.assert_close(scores, torch.stack(last), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sig.score(prompts, completion, mask, None), torch.sigmoid(scores))
    prm_path = reward_checkpoint(tmp_path / "prm.pt", "prm")
    prm = arithmetic_task(module, tmp_path, reward_model=str(prm_path), steps=2, horizon=14)
    found = prm.score(prompts, completion, mask, None)
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, texts)):
            written = t if t.endswith("\n") else t + "\n"
            probs = torch.sigmoid(prm.rm(torch.tensor([p + tok.encode(written)]))[0, len(p) :])
            ends = [j for j, c in enumerate(written) if c == "\n"]
            assert found[i].item() == pytest.approx(math.prod(probs[ends].tolist()), abs=1e-5)
