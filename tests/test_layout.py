"""The layering the README's Layout section promises: the graph decoder knows no model family."""

import ast
from pathlib import Path

import moegraph
from moegraph.models import FAMILIES

PACKAGE = Path(moegraph.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_cuda_graph_imports_neither_patches_nor_models():
    for path in (PACKAGE / "cuda_graph").glob("*.py"):
        for name in _imports(path):
            assert "patches" not in name and "models" not in name, f"{path.name} imports {name}"


def test_every_family_has_a_decode_step():
    for model_type, family in FAMILIES.items():
        steps = family.steps()
        assert callable(steps.decode_step) and family.model_type == model_type
        assert family.decode_module.startswith("moegraph.models.")
