"""The shape rules the project keeps (docs/design.md, "Layers"): no source file in the core
modules grows past 600 lines (a file small enough to read whole, named for its one job), and
every type a header declares at namespace scope says what it is in a `///` line."""
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
