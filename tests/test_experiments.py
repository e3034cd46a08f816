"""Every experiments/ script still runs: its --quick form (a few steps, one seed) exits 0 and prints its table."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BPE_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "experiments").glob("*.py") if p.name != "common.py")


# the experiments whose models read GPT-2 BPE (HH-RLHF dialogues, RookWorld's FENs): offline without the BPE files
# they skip, as the suite's other BPE tests do
NEEDS_BPE = {"dpo_hh.py", "reward_model_hh.py", "rookworld.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_experiment_quick_run_prints_its_table(script, tmp_path):
    if script in NEEDS_BPE and not BPE_AVAILABLE:
        pytest.skip("GPT-2 BPE files unavailable (offline, no TIKTOKEN_CACHE_DIR)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table_rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table_rows) >= 3, proc.stdout[-2000:]  # header, ruler, at least one row


def test_every_experiment_script_is_named_by_a_docs_page():
    """Each table in docs/ names the script that reruns it, so every script is named somewhere in docs/."""
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = [s for s in SCRIPTS if f"experiments/{s}" not in docs]
    assert not missing, f"experiments not named in docs/: {missing}"
