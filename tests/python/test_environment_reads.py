"""Each fact once: the environment variables conveyor's C++ reads are read in common/env.cc
alone (docs/environment.md lists every one), and the names of the schedules and of the
recomputations are spelled in C++ alone, which Python reads through `_C`."""
import pathlib
import re

from conveyor import _C, arguments

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ["common", "graph", "scheduler", "partitioner", "trace", "transport", "runtime", "bindings", "tools"]


def test_the_environment_is_read_in_common_env_alone():
    readers = []
    for module in MODULES:
        for path in sorted((ROOT / module).rglob("*")):
            if path.suffix not in (".h", ".cc") or path == ROOT / "common" / "env.cc":
                continue
            for i, line in enumerate(path.read_text().splitlines()):
                if re.search(r"\b(secure_)?getenv\s*\(", line):
                    readers.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not readers, "read these through common/env.h:\n" + "\n".join(readers)


def test_the_python_package_reads_the_environment_in_environment_py_alone():
    readers = []
    for path in sorted((ROOT / "bindings" / "conveyor").rglob("*.py")):
        if path.name == "environment.py":
            continue
        for i, line in enumerate(path.read_text().splitlines()):
            code = line.split("#")[0]
            if re.search(r"\bos\.(environ|getenv)\b", code) and "`" not in code:
                readers.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not readers, "read these through conveyor/environment.py:\n" + "\n".join(readers)


def test_every_variable_conveyor_reads_is_documented():
    read = set(re.findall(r'"(CONVEYOR_[A-Z_]+)"', (ROOT / "common" / "env.cc").read_text()))
    assert read, "common/env.cc reads no CONVEYOR_ variable: the rule checks nothing"
    for path in (ROOT / "bindings" / "conveyor").rglob("*.py"):
        read |= set(re.findall(r"""environment\.(?:variable|is_set)\(\s*["'](CONVEYOR_[A-Z_]+)""", path.read_text()))
    table = (ROOT / "docs" / "environment.md").read_text()
    assert not [v for v in read if f"`{v}`" not in table], "add these to docs/environment.md"


def test_python_takes_the_schedules_and_recomputations_from_cpp():
    assert arguments.SCHEDULES == ("auto", *_C.schedule_names())
    assert set(arguments.SCHEDULES) == {"auto", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    assert set(arguments.TWO_STAGES_PER_RANK) == {"interleaved", "zb-v", "dualpipev"}
    assert [_C.chunks_of(n) for n in ("gpipe", "1f1b", "zb-h1")] == [1, 1, 1]
    assert arguments.RECOMPUTATIONS == ("none", "selective", "full") == tuple(_C.recomputation_names())
