"""The progress bar (the shared Logger) times training steps only: an evaluation between steps changes neither its
rate nor its elapsed time, so the time left it shows stays that of the steps."""

from types import SimpleNamespace

import pytest

import gpt

STEP_S = 0.02
EVAL_S = 0.5


def test_a_slow_evaluation_leaves_the_bar_rate_and_elapsed_time_to_the_steps(tmp_path):
    """Steps of 20 ms with a 0.5 s evaluation in the middle, logged as the scripts log them (bar.update and a log
    line per step, the evaluation's eval/ line before the next step), on a clock the test moves: the bar's elapsed
    time is the steps' time and its rate right after the evaluation 50 steps/s, not the few steps/s with the
    evaluation counted."""
    cfg = SimpleNamespace(wandb=False)
    rt = SimpleNamespace(master=True)
    logger = gpt.Logger(cfg, str(tmp_path), rt, total_steps=100)
    now = [1000.0]

    def clock():  # tqdm's clock, moved by the test instead of by sleeping
        return now[0]

    logger.bar._time = clock
    logger.bar.start_t = logger.bar.last_print_t = now[0]
    logger.bar.mininterval = 0  # every update displays and moves the rate (tqdm's moving average of intervals)
    n_steps = 10
    for step in range(2 * n_steps):
        if step == n_steps:
            now[0] += EVAL_S  # the evaluation
            logger.log(step, {"eval/val_loss": 1.0})
        now[0] += STEP_S  # the step
        logger.bar.update(1)
        logger.log(step, {"train/loss": 1.0}, echo=False)
        if step == n_steps:
            rate_after_eval = logger.bar.format_dict["rate"]
    elapsed = logger.bar.format_dict["elapsed"]
    logger.close()
    assert elapsed == pytest.approx(2 * n_steps * STEP_S)  # 0.4 s of steps; 0.9 s with the evaluation counted
    assert rate_after_eval == pytest.approx(1 / STEP_S, rel=1e-3)  # with the evaluation counted: under 6 steps/s
