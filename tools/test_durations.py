"""Write tests/durations.json, the seconds each test file (and notebook) took, from the output of
a pytest run with ``--durations=0`` (tests/conftest.py hands files to the workers longest first).

    python -m pytest --durations=0 -q > run.txt; python tools/test_durations.py run.txt
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::")
OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def per_file(lines) -> dict[str, int]:
    """{file: whole seconds} of every file that took 2 s or more."""
    total = collections.Counter()
    for line in lines:
        found = LINE.match(line)
        if found:
            total[found.group(2)] += float(found.group(1))
    return {f: round(t) for f, t in sorted(total.items(), key=lambda kv: -kv[1]) if t >= 2}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python tools/test_durations.py PYTEST_OUTPUT")
    found = per_file(Path(argv[0]).read_text(errors="replace").splitlines())
    if not found:
        sys.exit(f"{argv[0]}: no durations (run pytest with --durations=0)")
    OUT.write_text(json.dumps(found, indent=0) + "\n")
    print(f"{OUT}: {len(found)} files, {sum(found.values())} s in all")


if __name__ == "__main__":
    main()
