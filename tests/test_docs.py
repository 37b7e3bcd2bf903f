"""The docs run as written: every Python block of README.md and docs/*.md, in order, one
process per file (blocks of a file share their names, as a reader follows them); a block
that cannot run on a CPU says why in an HTML comment right above it. And every file the docs
cite exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!-- not run by tests/test_docs\.py: (.+\S) -->")


def python_blocks(path: Path) -> tuple[list[str], list[str]]:
    """(blocks to run, reasons of the blocks not run) of one markdown file."""
    run, skipped = [], []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            reason = SKIP.search(before)
            (skipped.append(reason.group(1)) if reason else run.append("\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return run, skipped


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)[0]], ids=lambda p: p.name)
def test_python_blocks_run_as_written(path, tmp_path):
    pytest.importorskip("nixl")
    pytest.importorskip("transformers")
    blocks, _ = python_blocks(path)
    script = tmp_path / f"{path.stem}_blocks.py"
    script.write_text("\n\n".join(blocks) + "\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"{path.name}: {proc.stderr[-3000:]}"


def test_blocks_not_run_say_why_and_are_few():
    skipped = {p.name: python_blocks(p)[1] for p in DOCS}
    ran = sum(len(python_blocks(p)[0]) for p in DOCS)
    assert ran >= 4, ran
    assert sum(len(v) for v in skipped.values()) <= 2, skipped


CITED = re.compile(r"(?<![\w/.-])((?:benchmarks|docs|tests|src|examples|requirements|\.ci)/[\w./-]+\.(?:py|md|jsonl|json|sh|txt|png|toml))")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_cited_files_exist(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted({m for m in CITED.findall(text)
                      if not (ROOT / m).exists() and not (path.parent / m).exists() and "OUT_DIR" not in m})
    assert not missing, f"{path.name} cites files that do not exist: {missing}"
