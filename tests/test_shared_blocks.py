"""Every top-level script carries verbatim copies of gpt.py's shared blocks (SPEC section 2), ppo.py one of
grpo.py's tasks block, and no script imports a file of this project. `python tests/test_shared_blocks.py --fix`
copies the blocks from their sources into every script."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"# -+ BEGIN SHARED BLOCK: (\w+) .*?\n(.*?)# -+ END SHARED BLOCK: \1 -+\n", re.S)
SCRIPTS = sorted(p for p in ROOT.glob("*.py") if p.name != "gpt.py")


def blocks(path):
    return {m.group(1): m.group(2) for m in BLOCK.finditer(path.read_text())}


REFERENCE = blocks(ROOT / "gpt.py")
REFERENCE["tasks"] = blocks(ROOT / "grpo.py")["tasks"]  # the RL tasks: grpo.py is the source, ppo.py the copy


def test_gpt_py_defines_the_model_and_train_blocks_and_grpo_py_the_tasks():
    assert set(blocks(ROOT / "gpt.py")) == {"model", "train"}
    assert "class GPT(nn.Module)" in REFERENCE["model"]
    assert "def parse_config(" in REFERENCE["train"]
    assert "class ArithmeticTask" in REFERENCE["tasks"] and "tasks" in blocks(ROOT / "ppo.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shared_blocks_are_verbatim_copies_of_gpt_py(script):
    found = blocks(script)
    for name, text in found.items():
        assert name in REFERENCE, f"{script.name}: unknown shared block {name!r}"
        source = "grpo.py" if name == "tasks" else "gpt.py"
        assert text == REFERENCE[name], f"{script.name}: block {name!r} differs from {source} (run with --fix)"
    begins = len(re.findall(r"# -+ BEGIN SHARED BLOCK", script.read_text()))
    assert begins == len(found), f"{script.name}: a BEGIN marker has no matching END marker"


@pytest.mark.parametrize("script", [ROOT / "gpt.py", *SCRIPTS], ids=lambda p: p.name)
def test_scripts_import_no_project_file(script):
    local = {p.stem for p in ROOT.glob("*.py")}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            continue
        assert not set(names) & local, f"{script.name} imports {set(names) & local}: scripts must stand alone"


# Each script's own entry points may share a name; everything else defined in several scripts is a copy.
OWN = {"Config", "main", "validate", "train", "completion_logprobs", "make_tokenizer", "evaluate", "train_step"}
OWN |= {"save", "setup", "rollout", "update"}


def top_level_sources(path):
    """Each top-level function's and class's source, by name: its lines from `def`/`class` to its end (as
    ast.get_source_segment, which re-splits the whole file for every node and took 25 s here)."""
    text = path.read_text()
    lines = text.splitlines()
    sources = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            sources[node.name] = "\n".join(lines[node.lineno - 1 : node.end_lineno])
    return sources


def test_functions_and_classes_copied_between_scripts_are_identical():
    """Algorithm code that several scripts carry (advantages, losses, HH parsing, the reward model class, ...) is
    copied, not rewritten: every copy's source equals the others' (bench.py has a parser of its own)."""
    sources = {p.name: top_level_sources(p) for p in [ROOT / "gpt.py", *SCRIPTS] if p.name != "bench.py"}
    names = {name for defs in sources.values() for name in defs} - OWN
    for name in sorted(names):
        copies = {script: defs[name] for script, defs in sources.items() if name in defs}
        first = next(iter(copies))
        for script, source in copies.items():
            assert source == copies[first], f"{name}: the copy in {script} differs from the one in {first}"


def fix():
    for script in SCRIPTS:
        text = script.read_text()
        new = BLOCK.sub(lambda m: m.group(0).replace(m.group(2), REFERENCE[m.group(1)], 1), text)
        if new != text:
            script.write_text(new)
            print(f"updated {script.name}")


if __name__ == "__main__" and "--fix" in sys.argv:
    fix()
