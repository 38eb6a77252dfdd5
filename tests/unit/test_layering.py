"""How the package is layered: imports run one way, from the loop down to the maths (the config
(schema, validation, layout, memory plan) and the SGLang contracts below it import nothing from
the packages that use them; every import counts, those inside functions too), and the parallel
sizes reach Megatron through one mapping."""

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


def test_parallel_sizes_reach_megatron_under_its_own_names():
    """One mapping from `parallel` to Megatron's keywords, and both of Megatron's entry points
    that take parallel sizes (the process groups and the layer config) accept every key."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from vlmrl.config import load
    from vlmrl.config.layout import megatron_parallel_sizes

    p = load(["parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.ep=4"], check_rules=False).parallel
    sizes = megatron_parallel_sizes(p)
    assert sizes["tensor_model_parallel_size"] == 2 and sizes["expert_model_parallel_size"] == 4
    init_args = set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    config_fields = set(TransformerConfig.__dataclass_fields__)
    assert set(sizes) <= init_args and set(sizes) <= config_fields, (set(sizes) - init_args, set(sizes) - config_fields)
