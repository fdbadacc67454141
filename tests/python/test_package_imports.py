"""conveyor's own modules import one way only (docs/design.md, "Layers"): no two of them
import each other, directly or through others, whether the import sits at the top of a file,
at its bottom or inside a function. A cycle works only while its imports run in one order,
and is dodged by moving an import out of the way; this test names any, so it is broken by
moving what both sides need into a module below them instead.

Only the imports the sources write count: a package's __init__ runs before its modules, but
is not an import they make."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "conveyor"
COMPILED = {"conveyor._C"}  # the extension: a module of the package, with no source to read


def modules() -> dict[str, pathlib.Path]:
    """conveyor's modules by name ("conveyor.distributed.groups"; a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["conveyor", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, known) -> list[tuple[str, int]]:
    """The conveyor modules `name` (its source at `path`) imports, each with its line: `from
    P import n` imports P.n where that is a module, else P (a name P's __init__ defines)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts:
                    out.append((".".join(parts), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")
            if base[0] != "conveyor":
                continue
            base = ".".join(base)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.append((target if target in known or target in COMPILED else base, node.lineno))
    return [(target, line) for target, line in out if target in known and target != name]


def cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Each group of modules that import one another, in order (Tarjan's strongly connected
    components), with a cycle through it: a shortest way back to its first module."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            step = [w for w in sorted(graph[path[-1]]) if w in group]
            if start in step:
                out.append((path + [start], sorted(group)))
                break
            for w in step:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return out


def test_conveyors_modules_import_each_other_without_a_cycle():
    known = modules()
    assert "conveyor.distributed" in known and "conveyor.graph" in known, sorted(known)
    graph = {name: {} for name in known}
    for name, path in known.items():
        for target, line in imports_of(name, path, known):
            graph[name].setdefault(target, line)
    found = cycles(graph)

    def named(cycle, group):
        text = " -> ".join(f"{a} ({known[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
        text += f" -> {cycle[-1]}"
        if len(group) > len(cycle) - 1:
            text += f"\n  ({len(group)} modules import one another: {', '.join(group)})"
        return text

    assert not found, "conveyor's modules import in a cycle; move what both sides need below them:\n" + \
        "\n".join(named(*c) for c in found)


def test_the_check_counts_imports_inside_functions_and_names_a_cycle(tmp_path):
    """The check itself: an import inside a function counts; a chain passes, a cycle fails."""
    source = tmp_path / "module.py"
    source.write_text("from . import _C, graph\n\n\ndef f():\n    from .distributed import groups, world\n")
    known = {"conveyor.module": source, "conveyor.graph": source, "conveyor.distributed": source,
             "conveyor.distributed.groups": source}
    assert sorted(imports_of("conveyor.module", source, known)) == [
        ("conveyor.distributed", 5), ("conveyor.distributed.groups", 5), ("conveyor.graph", 1)]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [(["a", "b", "c", "a"],
                                                                                    ["a", "b", "c"])]
