"""char_grpo.py: the reward, the bigram reference, and end-to-end runs (run folder, resume, torchrun, learning)."""

import json
import math
import signal
import sys

import pytest
import torch
from conftest import ROOT, metrics, run_main, run_script, torchrun

import char_grpo as cg

TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--context_len", "8"]
SMALL_RUN = [*TINY, "--horizon", "4", "--batch_size", "4", "--group_size", "4", "--eval_size", "16"]


def run_in_process(argv, monkeypatch):
    """char_grpo's main() in this process, so that a test can spy inside a step; returns the exit code."""
    monkeypatch.setattr(sys, "argv", ["char_grpo.py", *map(str, argv)])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # GracefulExit's handlers stay out of pytest
    monkeypatch.setattr(cg, "plot_curves", lambda *a: None)
    try:
        cg.main()
    except SystemExit as e:
        return e.code
    return 0


def test_rewards_hand_values_for_both_modes_and_partial_credit():
    """Rollout 'abxd' vs truth 'abcd': plus1 -> 1 1 0 1; pm1 -> 1 1 -1 1; partial credit adds w * log p."""
    rollout = torch.tensor([[0, 1, 9, 3]])
    truth = torch.tensor([[0, 1, 2, 3]])
    assert cg.token_rewards(rollout, truth, "plus1").tolist() == [[1, 1, 0, 1]]
    assert cg.token_rewards(rollout, truth, "pm1").tolist() == [[1, 1, -1, 1]]
    logp_true = torch.log(torch.tensor([[0.5, 0.25, 0.125, 1.0]]))
    got = cg.token_rewards(rollout, truth, "plus1", logp_true, 0.5)
    assert torch.allclose(got, torch.tensor([[1 - 0.5 * math.log(2), 1 - math.log(2), -1.5 * math.log(2), 1.0]]))


def test_bigram_reference_is_the_normalised_add_one_counts():
    """ids 0 1 0 1 2 over a 3-token vocabulary: p(next | prev) = (count + 1) / (count(prev) + 3), rows sum to 1."""
    prev, nxt = torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij")
    table = cg.BigramReference(torch.tensor([0, 1, 0, 1, 2]), 3)(prev, nxt)[0].exp()
    counts = torch.tensor([[0.0, 2, 0], [1, 0, 1], [0, 0, 0]]) + 1
    assert torch.allclose(table, counts / counts.sum(1, keepdim=True))
    assert torch.allclose(table.sum(1), torch.ones(3))


@pytest.mark.slow
def test_logprobs_entropy_and_reference_are_those_of_the_sampling_temperature(tmp_path, text_file, monkeypatch):
    """At --temperature 0.5 the log-probs in the loss, rl/entropy and the bigram reference's log-probs are those of
    softmax(logits / 0.5) (the bigram's: of its log-probs / 0.5), against float64 oracles from the same weights and
    rollouts; the first of two --num_iterations updates has ratio exactly 1 (old and new log-probs agree)."""
    T, C = 0.5, 8
    passes, losses, kls = [], [], []
    completion_logprobs = cg.completion_logprobs  # the originals, which the spies call
    policy_loss = cg.policy_loss
    kl_penalty = cg.kl_penalty

    def completion_spy(model, seq, *args, **kwargs):
        if torch.is_grad_enabled():  # the training pass: the rollouts and the weights that score them
            passes.append((seq.clone(), {k: v.clone() for k, v in model.state_dict().items()}))
        return completion_logprobs(model, seq, *args, **kwargs)

    def loss_spy(logp, old_logp, *args, **kwargs):
        losses.append((logp.detach().clone(), old_logp.clone()))
        return policy_loss(logp, old_logp, *args, **kwargs)

    def kl_spy(logp, ref_logp, kind):
        kls.append(ref_logp.clone())
        return kl_penalty(logp, ref_logp, kind)

    monkeypatch.setattr(cg, "completion_logprobs", completion_spy)
    monkeypatch.setattr(cg, "policy_loss", loss_spy)
    monkeypatch.setattr(cg, "kl_penalty", kl_spy)
    out = tmp_path / "run"
    args = ["--data", text_file, *SMALL_RUN, "--temperature", T, "--num_iterations", 2, "--max_steps", 1]
    assert run_in_process([*args, "--out_dir", out], monkeypatch) == 0
    assert len(passes) == len(losses) == 2

    model = cg.GPT(cg.GPTConfig(**torch.load(out / "ckpt.pt", weights_only=True)["model_config"])).double()

    def oracle_logq(seq, state):  # (N, H, V) float64 log-probs of softmax(logits / T) at the completion positions
        model.load_state_dict(state)
        with torch.no_grad():
            return torch.log_softmax(model(seq[:, :-1])[0][:, C - 1 :] / T, -1)

    seq = passes[0][0]
    completion = seq[:, C:, None]
    logp, old_logp = losses[0]
    assert torch.allclose(logp.double(), oracle_logq(*passes[0]).gather(-1, completion)[..., 0], atol=1e-5)
    assert torch.equal(logp, old_logp)  # first update: ratio exactly 1
    logq = oracle_logq(*passes[-1])  # rl/entropy is the last update's
    entropy = -(logq.exp() * logq).sum(-1).mean().item()
    assert next(r for r in metrics(out) if "rl/entropy" in r)["rl/entropy"] == pytest.approx(entropy, abs=1e-5)
    text = text_file.read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    train = ids[: int(0.9 * len(ids))]
    counts = torch.ones(len(chars), len(chars), dtype=torch.double)  # add-one counts of (previous, next)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.double), accumulate=True)
    table = (counts / counts.sum(1, keepdim=True)).log()  # (V, V) log p(next | previous)
    ref_logp = torch.log_softmax(table[seq[:, C - 1 : -1]] / T, -1).gather(-1, completion)[..., 0]
    assert torch.allclose(kls[0].double(), ref_logp, atol=1e-5)


def test_k1_as_the_kl_loss_term_is_refused_with_exit_2(capsys):
    """k1 = logp - ref_logp differentiated as a loss has zero expected gradient on-policy (E_pi[grad log pi] = 0):
    validate stops with one line naming the reason and exit code 2."""
    with pytest.raises(SystemExit) as e:
        cg.validate(cg.resolve_clip(cg.Config(kl_estimator="k1")))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "k1" in err and "gradient" in err


def test_adv_takes_grpo_py_names_and_refuses_outcome_with_exit_2(capsys):
    """--adv group is grpo.py's name for outcome advantages; the value outcome is refused like any unknown value:
    one line naming the flag and the values it takes, exit code 2."""
    cg.validate(cg.resolve_clip(cg.Config(adv="group")))
    with pytest.raises(SystemExit) as e:
        cg.validate(cg.resolve_clip(cg.Config(adv="outcome")))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--adv" in err and "group" in err


def test_float16_loss_scale_is_saved_and_restored_on_resume(tmp_path, text_file, monkeypatch):
    """--dtype float16: ckpt.pt holds the GradScaler state under "scaler", and --resume restores it (a resumed run
    that takes no step saves back the state it loaded, not a fresh one); a checkpoint without it still resumes."""
    out = tmp_path / "run"
    args = ["--data", text_file, *SMALL_RUN, "--dtype", "float16", "--max_steps", 2, "--eval_every", 2]
    assert run_in_process([*args, "--out_dir", out], monkeypatch) == 0
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["scaler"]["scale"] > 0
    ckpt["scaler"].update(scale=1024.0, _growth_tracker=7)  # not what a fresh scaler or two steps give
    torch.save(ckpt, out / "ckpt.pt")
    assert run_in_process(["--resume", "--out_dir", out], monkeypatch) == 0
    saved = torch.load(out / "ckpt.pt", weights_only=True)["scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (1024.0, 7)
    del ckpt["scaler"]  # a checkpoint written before the scaler was saved
    torch.save(ckpt, out / "ckpt.pt")
    assert run_in_process(["--resume", "--out_dir", out], monkeypatch) == 0


@pytest.mark.slow
@pytest.mark.plots
def test_run_writes_the_run_folder_and_resume_reproduces_metrics(tmp_path, text_file, monkeypatch):
    """A few GRPO steps write SPEC section 4's folder; stopping at 4 of 6 steps and resuming gives the same metrics."""
    common = ["--data", text_file, *SMALL_RUN, "--eval_every", "2", "--save_every", "2", "--log_every", "1"]
    full = tmp_path / "full"
    part = tmp_path / "part"
    args = ["--reference", "init", "--partial_logprob", "0.1", "--num_iterations", "2", "--grad_accum", "2"]
    run_main(cg, monkeypatch, *common, *args, "--out_dir", full, "--max_steps", "6")
    for name in ("config.json", "metrics.jsonl", "final_results.json", "training_curves.png", "ckpt.pt", "samples.txt"):
        assert (full / name).is_file(), name
    run_main(cg, monkeypatch, *common, *args, "--out_dir", part, "--max_steps", "4")
    # resuming keeps the run's settings; only --max_steps is given again (the lr schedule follows max_steps)
    cfg = json.loads((part / "config.json").read_text())
    assert cfg["reference"] == "init"
    proc = run_script("char_grpo.py", "--resume", "--out_dir", part, "--max_steps", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = metrics(full)
    b = metrics(part)
    # the lr schedule depends on max_steps, so compare the steps both runs took with the same settings
    assert [r for r in a if r["step"] < 4] == [r for r in b if r["step"] < 4]
    keys = {"rl/reward_mean", "rl/kl", "rl/tokens"}
    assert all(k in r for r in a if "train/loss" in r for k in keys)
    results = json.loads((full / "final_results.json").read_text())
    assert results["tokens"] == 6 * 4 * 4 * 4 and 0 <= results["next_token_acc"] <= 1


@pytest.mark.slow
def test_supervised_baseline_sees_as_many_characters_as_grpo(tmp_path, text_file, monkeypatch):
    """--supervised trains on as many characters as GRPO generates with the same settings; its checkpoint says so."""
    common = ["--data", text_file, *SMALL_RUN, "--max_steps", "3", "--eval_every", "3"]
    results = {}
    for name, extra in (("grpo", []), ("supervised", ["--supervised"])):
        assert run_in_process([*common, *extra, "--out_dir", tmp_path / name], monkeypatch) == 0
        results[name] = json.loads((tmp_path / name / "final_results.json").read_text())
    assert results["grpo"]["tokens"] == results["supervised"]["tokens"] == 3 * 4 * 4 * 4
    assert results["grpo"]["mode"] == "grpo" and results["supervised"]["mode"] == "supervised"
    assert torch.load(tmp_path / "supervised" / "ckpt.pt", weights_only=True)["supervised"] is True


# char_grpo.py under torchrun with spies on the rewards and on the advantages that reach the loss, saved per rank
SPY = """
import os
import sys

import torch
sys.path.insert(0, {root!r})
import char_grpo as cg

seen = {{"rewards": [], "match": [], "adv": []}}
token_rewards = cg.token_rewards
policy_loss = cg.policy_loss


def rewards_spy(rollouts, truth, *args):
    seen["match"].append((rollouts == truth).float())
    seen["rewards"].append(token_rewards(rollouts, truth, *args))
    return seen["rewards"][-1]


def loss_spy(logp, old_logp, adv, *args, **kwargs):
    seen["adv"].append(adv.clone())
    return policy_loss(logp, old_logp, adv, *args, **kwargs)


cg.token_rewards = rewards_spy
cg.policy_loss = loss_spy
cg.main()
torch.save(seen, os.path.join(os.environ["SPY_DIR"], "seen" + os.environ["RANK"] + ".pt"))
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_gloo_run(tmp_path, text_file):
    """torchrun with 2 CPU ranks trains, counts both ranks' tokens and saves one checkpoint. With --scale_rewards
    batch each rank's advantages are those of one process on both ranks' rollouts (the std of the global batch), and
    the rl/ reward metrics are those of both ranks' rollouts."""
    out = tmp_path / "run"
    spy = tmp_path / "spy.py"
    spy.write_text(SPY.format(root=str(ROOT)))
    args = [*SMALL_RUN, "--adv", "group", "--scale_rewards", "batch", "--partial_logprob", "0.1"]
    proc = torchrun(
        spy,
        2,
        "--device",
        "cpu",
        "--data",
        text_file,
        *args,
        "--max_steps",
        "2",
        "--eval_every",
        "2",
        "--out_dir",
        out,
        env={"SPY_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["tokens"] == 2 * 2 * 4 * 4 * 4 and len(ckpt["rng_ranks"]) == 2
    seen = [torch.load(tmp_path / f"seen{rank}.pt") for rank in (0, 1)]
    logged = [r for r in metrics(out) if "rl/reward_mean" in r]
    for step in range(2):
        rewards = torch.cat([s["rewards"][step] for s in seen])  # (2N, H): both ranks' rollouts, rank order
        assert not torch.equal(*rewards.chunk(2))  # the ranks sampled different rollouts
        adv = torch.cat([s["adv"][step] for s in seen])  # (2N, H): one advantage a rollout, on each character
        expected = cg.group_advantages(rewards.mean(1), 4, "batch")[:, None].expand_as(adv)
        assert torch.allclose(adv, expected, atol=1e-6)
        match = torch.cat([s["match"][step] for s in seen])
        assert logged[step]["rl/reward_mean"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert logged[step]["rl/reward_std"] == pytest.approx(rewards.std().item(), abs=1e-6)
        assert logged[step]["rl/accuracy"] == pytest.approx(match.mean().item(), abs=1e-6)


@pytest.mark.slow
@pytest.mark.learning
def test_mean_reward_rises_on_repetitive_text(tmp_path, monkeypatch):
    """On a text that repeats one short phrase, GRPO alone lifts the per-character reward far above chance."""
    path = tmp_path / "rep.txt"
    path.write_text("the cat sat on the mat. " * 400)  # chance per character: about 1/11
    out = tmp_path / "run"
    args = ["--data", path, *TINY, "--horizon", "8", "--batch_size", "8", "--group_size", "8", "--max_steps", "80"]
    args += ["--lr", "3e-3", "--warmup_steps", "5", "--eval_every", "80", "--out_dir", out]
    assert run_in_process(args, monkeypatch) == 0
    rewards = [r["rl/reward_mean"] for r in metrics(out) if "rl/reward_mean" in r]
    start = sum(rewards[:5]) / 5
    end = sum(rewards[-5:]) / 5
    assert start < 0.15 and end > 2 * start and end > start + 0.1, (start, end)
