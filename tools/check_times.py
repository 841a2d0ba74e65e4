"""Time every exercise check as a learner meets it: run each solutions notebook top to bottom in a
fresh kernel (nbclient) and report how long each check cell took (the answer is right, so every
case runs). Usage: python tools/check_times.py [NN ...] (default: every chapter)."""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
CHECK = re.compile(r"\b(ch\d\d)\.(check_\w+)\(")


def seconds(cell) -> float | None:
    meta = cell.get("metadata", {}).get("execution", {})
    start, end = meta.get("iopub.execute_input"), meta.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def main(chapters: list[str]) -> int:
    rows = []
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        if chapters and path.name[:2] not in chapters:
            continue
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        total = time.perf_counter() - t0
        for cell in nb.cells:
            found = CHECK.search(cell.source) if cell.cell_type == "code" else None
            if found:
                text = "".join(o.get("text", "") for o in cell.get("outputs", []))
                ex = re.search(r"Exercise [\d.]+", text)
                rows.append((path.name[:2], ex.group(0) if ex else found.group(2),
                             f"{found.group(1)}.{found.group(2)}", seconds(cell)))
        print(f"{path.name}: {total:.1f} s in all", flush=True)
    print("\n| chapter | exercise | check | seconds |\n|---|---|---|---|")
    for chapter, ex, check, secs in rows:
        print(f"| {chapter} | {ex} | `{check}` | {secs:.2f} |" if secs is not None
              else f"| {chapter} | {ex} | `{check}` | ? |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
