"""Imports run one way, from the loop down to the maths: the config (schema, validation,
layout, memory plan) and the SGLang contracts below it import nothing from the packages that
use them. Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "vlmrl"
# what each package may import from vlmrl
ALLOWED = {"contracts": {"contracts"}, "config": {"config", "contracts"}}


def _vlmrl_imports(path: Path, package: str) -> set[str]:
    """The vlmrl subpackages a module imports (absolute `vlmrl.x` or relative)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("vlmrl."):
                out.add(node.module.split(".")[1])
            elif node.level == 1:
                out.add(package)
            elif node.level == 2:
                # from ..x import y  /  from .. import x
                out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("vlmrl."))
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_packages_import_nothing_above_them(package):
    files = sorted((PKG / package).glob("*.py"))
    assert files
    upward = {f"{f.relative_to(PKG.parent)} imports vlmrl.{m}"
              for f in files for m in _vlmrl_imports(f, package) - ALLOWED[package]}
    assert not upward, sorted(upward)
