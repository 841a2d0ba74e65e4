"""Move course_lib's modules into their layers (issue 38) and rewrite every reference to them.

    python tools/relayout.py             # move the files, rewrite the references, regenerate notebooks/
    python tools/relayout.py --dry-run   # only list the moves and the files that would change

The moves are :data:`course_lib._moved.MOVED` (old module -> new module), read from the file
without importing the package. For each old module still at its old place the tool runs
``git mv`` (a package moves whole) and, in the moved file, keeps ``Path(__file__)`` pointing where
it pointed (one more ``.parent`` per level deeper). Then, in every file git tracks or would track
(library, tests, tools, the solutions' cells, README/CONTRIBUTING, Makefile, pyproject.toml, CI) it
rewrites the old names:

- dotted names: ``course_lib.runtime`` -> ``course_lib.platform.runtime`` (imports, ``python -m``,
  docstrings, ``monkeypatch`` strings);
- file paths: ``course_lib/hardware.py`` -> ``course_lib/platform/hardware.py``, and
  ``"course_lib" / "exercises"`` -> ``"course_lib" / "teaching" / "exercises"``;
- ``from course_lib import costmodel, hardware`` -> one import per new package
  (``from course_lib.attention import costmodel`` and ``from course_lib.platform import hardware``),
  public names (``from course_lib import flash_attention``) left as they are.

Then it runs the notebook generator, so ``notebooks/`` follows ``solutions/``. It never commits.

Re-runnable: a module already at its new place is not moved again and a new name is never
rewritten, so running it on a tree where part of the layout (or others' edits) already landed only
finishes the job. To redo the layout on a newer main: take ``course_lib/_moved.py``,
``course_lib/__init__.py``'s ``_moved.install()`` lines, this file and the layers'
``__init__.py`` files from the branch, run this, then re-apply the code commits that follow the
moves (they touch a few functions each).

Not rewritten: ``course_lib/_moved.py`` (it holds the old names on purpose), this file,
``tools/ptx_compare.py`` (it compiles trees from before and after the layout with one code),
``tests/test_moved.py``, ``tests/test_relayout.py`` and ``ARCHITECTURE.md`` (they name old paths on purpose),
``notebooks/`` (generated) and ``course_lib/data/`` (records of what was run, whose commands still
work through the old names).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "course_lib"
MOVED_FILE = "course_lib/_moved.py"
# files that name the old paths on purpose (ptx_compare compiles trees from before and after with one code)
NOT_REWRITTEN = (MOVED_FILE, "tools/relayout.py", "tools/ptx_compare.py", "tests/test_moved.py", "tests/test_relayout.py",
                 "ARCHITECTURE.md")
NOT_REWRITTEN_DIRS = ("notebooks/", "course_lib/data/")
TEXT_SUFFIXES = (".py", ".md", ".ipynb", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".json", ".Dockerfile")
TEXT_NAMES = ("Makefile", "run")
# A layer package made by the move gets this docstring when it has no __init__.py yet.
LAYER_DOCS = {
    "course_lib.platform": "The platform: the machine and the environment the course runs in (runtime, hardware,\n"
                           "versions, Colab, the JupyterLab launcher, the environment report, the stand-in driver).",
    "course_lib.attention": "The algorithm in NumPy and PyTorch: reference attention, online softmax, the tiled\n"
                            "forward and backward, masks, decoding, GQA, FP8 emulation and the cost models.",
    "course_lib.measure": "Measurement: benchmarks, the cross-compiled survey of other GPUs and the recorded results.",
    "course_lib.teaching": "The teaching machinery: checks and their diagnosis, the chapters' exercises, concept\n"
                           "questions, widgets, grading and the notebook generator.",
}
MAX_LINE = 120  # the library's line length: a longer rewritten import is wrapped


def load_moved(root: Path = ROOT) -> dict[str, str]:
    """``MOVED`` from ``course_lib/_moved.py``, read as a literal (the package is not imported)."""
    tree = ast.parse((root / MOVED_FILE).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MOVED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{MOVED_FILE} has no MOVED table")


def module_path(root: Path, name: str) -> Path:
    """The file (``x.py``) or package folder (``x/``) of module ``name``, whichever exists; else ``x.py``."""
    base = root.joinpath(*name.split("."))
    return base if base.is_dir() else base.with_suffix(".py")


# ---------------------------------------------------------------------------------------------
# Moving

FILE_PARENTS = re.compile(r"Path\(__file__\)(\.resolve\(\))?((?:\.parent\b)+)")


def deeper(text: str, levels: int) -> str:
    """``Path(__file__)[.resolve()].parent…`` pointing at the same folder from ``levels`` deeper."""
    return FILE_PARENTS.sub(lambda m: f"Path(__file__){m.group(1) or ''}{m.group(2)}" + ".parent" * levels, text)


def move(root: Path, old: str, new: str, dry_run: bool) -> str | None:
    """``git mv`` module ``old`` to ``new`` (a package whole) unless it is already there; return
    a line saying what was done, or None."""
    src = module_path(root, old)
    if not src.exists():
        return None
    dst = root.joinpath(*new.split("."))
    dst = dst if src.is_dir() else dst.with_suffix(".py")
    if dst.exists():
        raise SystemExit(f"both {src.relative_to(root)} and {dst.relative_to(root)} exist: merge them by hand first")
    if dry_run:
        return f"move {src.relative_to(root)} -> {dst.relative_to(root)}"
    for package in [p for p in reversed(dst.relative_to(root).parents) if p != Path(".")]:
        (root / package).mkdir(exist_ok=True)
        init = root / package / "__init__.py"
        if not init.exists():
            doc = LAYER_DOCS.get(".".join(package.parts), f"The {package.name} layer of course_lib.")
            init.write_text(f'"""{doc}\n"""\n', encoding="utf-8")
            git(root, "add", str(init.relative_to(root)))
    git(root, "mv", str(src.relative_to(root)), str(dst.relative_to(root)))
    levels = len(new.split(".")) - len(old.split("."))
    for path in ([dst] if dst.is_file() else sorted(dst.rglob("*.py"))):
        text = path.read_text(encoding="utf-8")
        if levels and FILE_PARENTS.search(text):
            path.write_text(deeper(text, levels), encoding="utf-8")
    return f"moved {src.relative_to(root)} -> {dst.relative_to(root)}"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------------------------
# Rewriting


class Rewriter:
    """Rewrites the old names of ``moved`` in text (see the module docstring)."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved
        olds = sorted(moved, key=len, reverse=True)
        # course_lib.x (not inside a longer dotted name, not followed by more of a name)
        self.dotted = re.compile(r"(?<![\w.])(" + "|".join(re.escape(o) for o in olds) + r")(?!\w)")
        paths = sorted((o.replace(".", "/") for o in olds), key=len, reverse=True)
        self.slashed = re.compile(r"(?<![\w./])(" + "|".join(re.escape(p) for p in paths) + r")(?=\.py\b|/)")
        self.joined = re.compile(r'"course_lib"(\s*/\s*)"(\w+)(\.py)?"')
        # `from course_lib import a, b as c  # comment` and `from course_lib.kernels import ...`, one line;
        # also inside a string of code ("...\\nfrom course_lib import runtime\\n...")
        parents = sorted({o.rsplit(".", 1)[0] for o in olds}, key=len, reverse=True)
        statement = (r"from (?P<pkg>" + "|".join(re.escape(p) for p in parents)
                     + r") import (?P<names>[\w]+(?: as \w+)?(?:, *[\w]+(?: as \w+)?)*)")
        self.from_import = re.compile(r"^(?P<indent>[ \t]*)" + statement + r"(?P<rest>[ \t]*(?:[#;].*)?)$",
                                      re.MULTILINE)
        self.embedded = re.compile(r"(?:(?<=[\"'])|(?<=\\n))(?P<indent>)" + statement + r"(?P<rest>)(?=\\n|[\"'])")

    def _from_import(self, m: re.Match, newline: str = "\n") -> str:
        groups: dict[str, list[str]] = {}
        for item in (s.strip() for s in m.group("names").split(",")):
            name = item.split(" as ")[0]
            new = self.moved.get(f"{m.group('pkg')}.{name}")
            parent = new.rsplit(".", 1)[0] if new else m.group("pkg")
            groups.setdefault(parent, []).append(item)
        if list(groups) == [m.group("pkg")]:
            return m.group(0)
        indent, rest = m.group("indent"), m.group("rest")
        lines = []
        for parent, items in groups.items():
            line = f"{indent}from {parent} import {', '.join(items)}"
            if len(line) > MAX_LINE and newline == "\n":  # a string of code keeps one line
                width = len(f"{indent}from {parent} import (")
                line = f"{indent}from {parent} import (" + f",\n{' ' * width}".join(items) + ")"
            lines.append(line)
        lines[0] += rest  # a trailing comment stays on the first statement
        return newline.join(lines)

    def _joined(self, m: re.Match) -> str:
        new = self.moved.get(f"{PACKAGE}.{m.group(2)}")
        if new is None:
            return m.group(0)
        sep = m.group(1)
        parts = new.split(".")[1:]
        return '"course_lib"' + "".join(f'{sep}"{p}"' for p in parts[:-1]) + f'{sep}"{parts[-1]}{m.group(3) or ""}"'

    def code(self, text: str) -> str:
        """Rewrite Python code (or text that shows it: Markdown, a Makefile)."""
        text = self.from_import.sub(self._from_import, text)
        text = self.embedded.sub(lambda m: self._from_import(m, newline="\\n"), text)
        lines = text.split("\n")
        out = [self._names(line) for line in lines]
        return "\n".join(aligned(lines, out))

    def _names(self, line: str) -> str:
        line = self.dotted.sub(lambda m: self.moved[m.group(1)], line)
        line = self.slashed.sub(lambda m: self.moved[m.group(1).replace("/", ".")].replace(".", "/"), line)
        return self.joined.sub(self._joined, line)

    def notebook(self, text: str) -> str:
        """Rewrite every cell of a notebook's JSON, written back as Jupyter (and nbgen) write it."""
        nb = json.loads(text)
        for cell in nb["cells"]:
            src = cell.get("source", "")
            joined = "".join(src) if isinstance(src, list) else src
            new = self.code(joined)
            if new != joined:
                cell["source"] = new.splitlines(keepends=True) if isinstance(src, list) else new
        out = json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
        return out if out != text and json.loads(out) != json.loads(text) else text


OPEN_IMPORT = re.compile(r"^\s*from \S+ import \(")


def aligned(before: list[str], after: list[str]) -> list[str]:
    """``after`` (``before`` with names rewritten, line for line) with the continuation lines of a
    parenthesised ``from x import (a,`` moved along with its parenthesis, when they were aligned to it."""
    out, shift = list(after), None  # shift: (old column, new column) of the open parenthesis
    for i, (old, new) in enumerate(zip(before, after)):
        code = old.split("#")[0]
        if shift is not None:
            indent = len(new) - len(new.lstrip(" "))
            if indent == shift[0] + 1 and new.strip():
                out[i] = " " * (shift[1] + 1) + new.lstrip(" ")
            if ")" in code:
                shift = None
        elif OPEN_IMPORT.match(old) and ")" not in code and old.index("(") != new.index("("):
            shift = (old.index("("), new.index("("))
    return out


def candidate_files(root: Path) -> list[Path]:
    """Files git tracks, and the ones it would (untracked, not ignored), that may hold an old name."""
    listed = git(root, "ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    out = []
    for rel in sorted(set(listed)):
        path = root / rel
        if rel in NOT_REWRITTEN or rel.startswith(NOT_REWRITTEN_DIRS) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES or path.name.endswith(TEXT_SUFFIXES):
            out.append(path)
    return out


def rewrite(root: Path, rewriter: Rewriter, dry_run: bool) -> list[str]:
    """Rewrite the old names in every candidate file; return the changed files' paths."""
    changed = []
    for path in candidate_files(root):
        text = path.read_text(encoding="utf-8")
        new = rewriter.notebook(text) if path.suffix == ".ipynb" else rewriter.code(text)
        if new != text:
            changed.append(str(path.relative_to(root)))
            if not dry_run:
                path.write_text(new, encoding="utf-8")
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the moves and changed files, change nothing")
    parser.add_argument("--no-notebooks", action="store_true", help="do not regenerate notebooks/ afterwards")
    args = parser.parse_args(argv)
    init = (ROOT / PACKAGE / "__init__.py").read_text(encoding="utf-8")
    if "_moved.install()" not in init:
        raise SystemExit("course_lib/__init__.py does not call _moved.install(): take it from the layout branch "
                         "first, or the old paths stop importing")
    moved = load_moved()
    for old, new in moved.items():
        line = move(ROOT, old, new, args.dry_run)
        if line:
            print(line)
    changed = rewrite(ROOT, Rewriter(moved), args.dry_run)
    listed = "".join(f"\n  {c}" for c in changed)
    print(f"{'would rewrite' if args.dry_run else 'rewrote'} {len(changed)} files{listed}")
    if not args.dry_run and not args.no_notebooks:
        nbgen = moved[f"{PACKAGE}.nbgen"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", nbgen], cwd=ROOT, env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
