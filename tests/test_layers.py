"""House rules of the package's structure that import-linter does not check.

The layer order and the absence of cycles are import-linter contracts in pyproject.toml
(``lint-imports`` runs in CI before the tests). Here: no module imports another module's
private (``_name``) names -- a helper two modules need lives, public, in the lower one.
"""

from __future__ import annotations

import ast
import pathlib

import megarefit

SRC = pathlib.Path(megarefit.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports() -> list[str]:
    """``"importer: from module import _name"`` for every cross-module private import in src/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megarefit"):
                if node.module == importer:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{importer}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split(".")[1:]):
                        found.append(f"{importer}: import {alias.name}")
    return found


def test_no_module_imports_a_private_name_of_another():
    assert private_imports() == []


def test_the_check_finds_a_private_import(tmp_path, monkeypatch):
    pkg = tmp_path / "megarefit"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "low.py").write_text("def _helper():\n    return 1\n")
    (pkg / "a" / "high.py").write_text("from megarefit.a.low import _helper\n")
    monkeypatch.setitem(globals(), "SRC", pkg)
    assert private_imports() == ["megarefit.a.high: from megarefit.a.low import _helper"]
