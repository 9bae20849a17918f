"""The layout the code keeps: no import cycle among clover_lab's modules nor clover_kernels'
(imports inside functions included), folders that show the architecture (few loose modules, one
base name per concept, no re-export shims, no file split by length), and hook point names spelled in
one module only."""
import ast
import re
from pathlib import Path

import pytest

from clover_lab.hooks import points as P

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clover_lab"
KERNELS = ROOT / "clover_kernels"
MAX_LOOSE_MODULES = 8  # config, errors, writes, cpu ...: what every part shares
LONG_MODULE_LINES = 600


def point_name_pattern() -> re.Pattern:
    """A string spelling a declared point: ``layers.3.moe.route``, ``layers.*.moe.route``, a bare
    dotted layer kind (``moe.route``; one-word kinds such as ``output`` are ordinary words), or an
    engine / final point (``denoise.step``)."""
    alternatives = []
    for point in P.DECLARED.values():
        kind = re.escape(point.kind)
        if not point.per_layer:
            alternatives.append(kind)
        elif "." in point.kind:
            alternatives.append(rf"(layers\.(\d+|\*)\.)?{kind}")
        else:
            alternatives.append(rf"layers\.(\d+|\*)\.{kind}")
    return re.compile("|".join(f"^{a}$" for a in alternatives))


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = (package.name, *path.relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], package_dir: Path = PACKAGE) -> set[str]:
    """The modules of ``package_dir``'s package ``path`` imports, anywhere in it (TYPE_CHECKING blocks too)."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # "from . import loading" names a module; "from .x import y" its module
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != name}


@pytest.mark.parametrize("package", [PACKAGE, KERNELS], ids=["clover_lab", "clover_kernels"])
def test_no_import_cycles(package):
    files = [p for p in package.rglob("*.py")]
    modules = {module_name(p, package) for p in files}
    # a package's __init__ re-exports its submodules: it is not a cycle for a submodule to import a sibling
    graph = {module_name(p, package): {m for m in imports_of(p, modules, package)
                                       if not (p.name != "__init__.py" and module_name(p, package).startswith(m + "."))}
             for p in files if p.name != "__init__.py"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    seen, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_hook_point_names_are_spelled_in_one_module():
    point_name = point_name_pattern()
    spelled = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "hooks/points.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and point_name.match(node.value):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not spelled, "hook point names outside clover_lab/hooks/points.py:\n" + "\n".join(spelled)


def test_only_what_every_part_shares_lies_loose_in_the_package():
    """The folders show the architecture: at most 8 modules sit at the top of clover_lab/."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules in clover_lab/: {loose}"


def test_no_two_modules_share_a_base_name():
    """A base name says one thing: two modules called the same are two things named alike."""
    seen = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.stem, []).append(p.relative_to(ROOT).as_posix())
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def test_no_module_re_exports_names_to_keep_an_old_import_path():
    """Callers import a name from where it is defined: no ``import x  # noqa: F401`` re-export
    (an import done only to see whether a package is installed is not one), no alias of a table row."""
    shims = []
    for package in (PACKAGE, KERNELS):
        for p in sorted(package.rglob("*.py")):
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if "noqa: F401" in line and line.lstrip().startswith("from "):
                    shims.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not shims, "re-exports:\n" + "\n".join(shims)


def _alias(node: ast.stmt) -> str | None:
    """The name a module-level ``name = X["name"]`` / ``name = x.name`` binds to another's object."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
        return None
    name, value = node.targets[0].id, node.value
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == name:
        return name
    if isinstance(value, ast.Attribute) and value.attr == name:
        return name
    return None


def test_the_kernel_package_keeps_no_second_name_for_anything():
    """An op is used from where it is defined (``clover_kernels.ops.rms_norm``): no ``__init__`` of
    clover_kernels binds a name (no re-export), no module of it aliases another's object under
    the same name (``rms_norm = OPS["rms_norm"]``, ``linear = dense.linear``)."""
    found = []
    for p in sorted(KERNELS.rglob("*.py")):
        body = ast.parse(p.read_text()).body
        for node in body:
            if p.name == "__init__.py":
                docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                if not docstring:
                    found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
            elif _alias(node):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "second names in clover_kernels (import from the defining module):\n" + "\n".join(found)


def test_a_long_module_says_why_it_is_one_concept():
    """Files are split by concept, never by length; one past ~600 lines says in its docstring why
    it is one concept (the words "one concept")."""
    long = []
    for package in (PACKAGE, KERNELS):
        for p in sorted(package.rglob("*.py")):
            text = p.read_text()
            doc = ast.get_docstring(ast.parse(text)) or ""
            if len(text.splitlines()) > LONG_MODULE_LINES and "one concept" not in doc.lower():
                long.append(f"{p.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert not long, "long modules that do not say why they are one concept:\n" + "\n".join(long)


def test_no_test_imports_a_conftest():
    """Which ``conftest`` module ``import conftest`` finds depends on which folders were collected
    first (tests/ and tests/kernels/ both have one): shared helpers are fixtures, or live in a
    module of their own (tests/injected_faults.py)."""
    tests = ROOT / "tests"
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(tests.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.match(r"\s*(from conftest import|import conftest)", line)]
    assert not found, "imports of conftest: " + ", ".join(found)
