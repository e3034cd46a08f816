"""The front door: README.md is short, every page it promises exists, links resolve, and what a user reads speaks of
the scripts, not of how the project is made."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["gpt", "char_grpo", "grpo", "ppo", "dpo", "reward_model", "rookworld_grpo"]
PAGES = [f"docs/{name}.md" for name in SCRIPTS] + [
    "docs/rlhf_loop.md",
    "docs/performance.md",
    "docs/faults.md",
    "docs/metrics.md",
    "docs/r1_zero.md",
]
# words of the project's own process: issue numbers, its contract's sections, its size budgets, paths outside it
PROCESS_WORDS = re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d+\b|\bSPEC\b|token budget|\.\./shared")


def user_texts():
    """(name, text) of everything a user reads: README, the docs pages, the changelog, the scripts' docstrings."""
    texts = [("README.md", (ROOT / "README.md").read_text())]
    texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "CHANGELOG.md").exists():
        texts.append(("CHANGELOG.md", (ROOT / "CHANGELOG.md").read_text()))
    for name in [*SCRIPTS, "bench"]:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        texts.append((f"{name}.py docstring", ast.get_docstring(tree) or ""))
    return texts


def test_readme_is_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES)
def test_each_page_exists_and_the_readme_links_it(page):
    assert (ROOT / page).is_file(), page
    assert f"({page})" in (ROOT / "README.md").read_text(), f"README.md does not link {page}"


def test_relative_links_and_images_resolve():
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@pytest.mark.parametrize("name,text", user_texts(), ids=lambda x: x if isinstance(x, str) and len(x) < 40 else "")
def test_user_text_speaks_of_the_scripts_not_of_how_they_are_made(name, text):
    found = sorted({m.group(0) for m in PROCESS_WORDS.finditer(text)})
    assert not found, f"{name}: {found}"


def test_module_docstrings_are_at_most_80_lines():
    long = {}
    for name in SCRIPTS:
        doc = ast.get_docstring(ast.parse((ROOT / f"{name}.py").read_text())) or ""
        if len(doc.splitlines()) > 80:
            long[name] = len(doc.splitlines())
    assert not long, long
