"""What a run shows a person: the panels of training_curves.png, and --help's description of each script."""

import ast

import pytest
from conftest import ROOT, run_script

import gpt

SCRIPTS = ("gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo")


def test_curve_panels_draw_what_changed_of_loss_reward_kl_and_one_held_out_metric():
    """Training and held-out losses share a panel; the reward, the KL and the first held-out metric that changed get
    one each; constants (a clip fraction always 0, a ratio always 1, the number of problems) and perf/ get none."""
    rows = [
        {"step": 0, "eval/n_problems": 40, "eval/accuracy": 0.1, "eval/val_loss": 2.0, "eval/format_rate": 0.2},
        {"step": 0, "train/loss": 3.0, "rl/reward_mean": 0.1, "rl/kl": 0.0, "rl/clip_frac": 0.0, "rl/ratio_mean": 1.0},
        {"step": 1, "train/loss": 2.5, "rl/reward_mean": 0.3, "rl/kl": 0.2, "rl/clip_frac": 0.0, "rl/ratio_mean": 1.0},
        {"step": 2, "eval/n_problems": 40, "eval/accuracy": 0.4, "eval/val_loss": 1.5, "eval/format_rate": 0.9},
        {"step": 2, "train/loss": 2.0, "rl/reward_mean": 0.2, "rl/kl": 0.3, "perf/step_ms": 5.0},
    ]
    panels = gpt.curve_panels(rows)
    assert panels == [["train/loss", "eval/val_loss"], ["rl/reward_mean"], ["rl/kl"], ["eval/accuracy"]]


def test_curve_panels_leave_out_what_a_run_does_not_log():
    """A supervised run has no reward and no KL: its panels are the losses and its held-out metric."""
    rows = [{"step": s, "train/loss": 3.0 - s, "eval/val_loss": 3.1 - s, "eval/accuracy": s / 4} for s in range(3)]
    assert gpt.curve_panels(rows) == [["train/loss", "eval/val_loss"], ["eval/accuracy"]]
    assert gpt.curve_panels([{"step": 0, "train/loss": 1.0}]) == []  # one value: nothing changed


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_the_script_with_whole_sentences(script):
    """--help opens with the module docstring's first paragraph, whole: it ends a sentence, not mid-way."""
    doc = ast.get_docstring(ast.parse((ROOT / f"{script}.py").read_text()))
    first = " ".join(doc.strip().split("\n\n")[0].split())
    assert first[-1] in ".?!", first
    out = run_script(f"{script}.py", "--help", timeout=120)
    assert out.returncode == 0
    described = " ".join(out.stdout.split("\n\n")[1].split())  # after the usage lines
    assert described == first
