"""Arrows point down: no module imports from a layer above its own, at the top of the file or inside a function.
The layers are the block under "## Layers" in docs/architecture.md, top first; every module of the package
must be in one of them."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qfuse"


def layers() -> list[list[str]]:
    """Each layer's paths (files, or folders ending in '/'), from the code block under "## Layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layers\n.*?```\n(.*?)```", text, re.DOTALL).group(1)
    return [[path.strip() for path in line.split(",")] for line in block.splitlines() if line.startswith("qfuse/")]


def layer_of(path: str, table: list[list[str]]) -> int:
    """The index of the layer that holds `path` (a file under the repository root)."""
    for index, paths in enumerate(table):
        if any(path == entry or (entry.endswith("/") and path.startswith(entry)) for entry in paths):
            return index
    raise AssertionError(f"{path} is in no layer of docs/architecture.md's block")


def module_path(module: str) -> str:
    """The file of a qfuse module name: a package's __init__.py, else the .py file."""
    relative = Path(*module.split("."))
    return str(relative / "__init__.py") if (ROOT / relative).is_dir() else str(relative.with_suffix(".py"))


def imports(path: Path) -> list[str]:
    """The qfuse modules `path` imports, anywhere in it (an import of names from a package counts as the
    package, except where a name is itself a module of it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "qfuse"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qfuse":
            submodules = [f"{node.module}.{alias.name}" for alias in node.names
                          if (ROOT / Path(*node.module.split(".")) / alias.name).is_dir()
                          or (ROOT / Path(*node.module.split(".")) / f"{alias.name}.py").is_file()]
            found += submodules or [node.module]
    return found


def test_every_import_points_down():
    table = layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = str(path.relative_to(ROOT))
        own = layer_of(source, table)
        for module in imports(path):
            target = module_path(module)
            if layer_of(target, table) < own:
                upward.append(f"{source} imports {module} (layer {layer_of(target, table)} above its {own})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def late():\n    from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs\n")
    assert imports(probe) == ["qfuse.ops.int4_weight_only"]
    table = layers()
    assert layer_of("qfuse/ops/int4_weight_only.py", table) < layer_of("qfuse/kernels/triton/int4_mm.py", table)


def test_no_pattern_family_imports_another():
    """A family is a form's runnable pass; what two families share lives in a form module of passes/
    (`dequantized_linear`, `fake_dequantize`, `quant_forms`, ...), so one family changes without another."""
    from qfuse.passes.families import PATTERN_FAMILIES, family_module

    family_modules = {family_module(family) for family in PATTERN_FAMILIES}
    crossing = [f"{module} imports {imported}" for module in sorted(family_modules)
                for imported in imports(ROOT / module_path(module)) if imported in family_modules - {module}]
    assert not crossing, "\n".join(crossing)
