"""Sums the JUnit/GoogleTest XML reports of one `meson test` run into a closing line:
`tests: N passed, N failed, N skipped` (individual test cases, C++ and Python together)."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(build: str) -> int:
    root = Path(build)
    reports = [p for p in root.rglob("*.xml") if "meson-logs" not in p.parts]
    passed = failed = skipped = 0
    for report in reports:
        try:
            tree = ET.parse(report).getroot()
        except ET.ParseError:
            continue
        for case in tree.iter("testcase"):
            kinds = {child.tag for child in case}
            if kinds & {"failure", "error"}:
                failed += 1
            elif "skipped" in kinds or case.get("status") == "notrun" or case.get("result") == "skipped":
                skipped += 1
            else:
                passed += 1
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build"))
