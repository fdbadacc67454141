"""The shape rules the project keeps (docs/design.md, "Layers"): no source file in the core
modules grows past 600 lines (a file small enough to read whole, named for its one job), and
every type a header declares at namespace scope says what it is in a `///` line."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ["common", "graph", "scheduler", "partitioner", "trace", "transport", "runtime", "bindings"]
MOST_LINES = 600
TYPE = re.compile(r"^(struct|class|enum class|enum)\s+\w+(::\w+)*\s*(final\s*)?(:[^{;]*)?\{")


def sources():
    for module in MODULES:
        for path in sorted((ROOT / module).rglob("*")):
            if path.suffix in (".h", ".cc", ".py") and "__pycache__" not in path.parts:
                yield path


def test_no_source_file_is_longer_than_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources()
            if (n := len(p.read_text().splitlines())) > MOST_LINES]
    assert not long, "split these by job:\n" + "\n".join(long)


def test_every_type_a_header_declares_has_a_one_line_summary():
    missing = []
    for path in sources():
        if path.suffix != ".h":
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not TYPE.match(line):
                continue
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("template"):
                j -= 1
            if j < 0 or not lines[j].lstrip().startswith("///"):
                missing.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()[:60]}")
    assert not missing, "give each a /// summary line:\n" + "\n".join(missing)


def _private_names_of_module() -> set[str]:
    """The private attributes and methods conveyor.Module defines (bindings/conveyor/module.py)."""
    tree = ast.parse((ROOT / "bindings/conveyor/module.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Module")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")
             and not f.name.startswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            names.add(node.attr)
    return names


def test_no_module_outside_module_py_reads_the_privates_of_conveyor_Module():
    """The front door hands each helper what it needs as arguments: a private attribute of
    conveyor.Module read anywhere but module.py (the package, tests, examples, bench) means
    a helper reaches into the Module again."""
    private = _private_names_of_module()
    assert private, "module.py defines no private attribute: the rule checks nothing"
    found = []
    for folder in ("bindings/conveyor", "tests/python", "examples", "bench", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "bindings/conveyor/module.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in private and not (
                        isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, "pass what these need as arguments, or make it public:\n" + "\n".join(found)


def test_module_py_stays_small():
    lines = len((ROOT / "bindings/conveyor/module.py").read_text().splitlines())
    assert lines <= 320, f"bindings/conveyor/module.py has {lines} lines: move a job out to a module of its own"


def test_every_module_of_the_package_is_installed():
    """`pip install .` (meson-python) installs what bindings/conveyor/meson.build lists."""
    listed = set(re.findall(r"'([\w/]+\.py)'", (ROOT / "bindings/conveyor/meson.build").read_text()))
    package = ROOT / "bindings/conveyor"
    missing = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if "__pycache__" not in p.parts and str(p.relative_to(package)) not in listed)
    assert not missing, "add these to bindings/conveyor/meson.build's install_sources:\n" + "\n".join(missing)
