"""docs/architecture.md lists every module of the package, once, under its own folder's heading, and nothing else.

The list is read from the document's `### \\`eagle3_hf/FOLDER/\\`` headings and the `` - `name.py`: what `` lines under
them, and compared with the `.py` files under `eagle3_hf/`. An `__init__.py` is expected in the list when it holds
code of its own; one holding only a docstring, imports and `__all__` is described by its folder's heading instead.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "eagle3_hf"

# A folder's heading: its path from the repository root, in backticks, first thing after `### `.
HEADING = re.compile(r"^###\s+`((?:[A-Za-z_]\w*/)+)`")
ENTRY = re.compile(r"^- `([A-Za-z_]\w*\.py)`: \S")


def only_reexports(path: Path) -> bool:
    """True when a module holds nothing but a docstring, imports and an `__all__` assignment."""
    body = ast.parse(path.read_text(encoding="utf-8"), str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        if targets and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        return False
    return True


def expected_modules(package: Path) -> set[str]:
    """The modules the document must list, as paths from the repository root (`eagle3_hf/generation/tree.py`)."""
    root = package.parent
    return {
        path.relative_to(root).as_posix()
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts and not (path.name == "__init__.py" and only_reexports(path))
    }


def listed_modules(text: str) -> tuple[list[str], list[str]]:
    """(the modules the document lists, in order, as `folder/name.py`; lines under a folder heading that are not in the
    list's form). A `###` heading that names no folder ends the folder before it; so does any `#`/`##` heading."""
    listed, malformed, folder = [], [], None
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith("#"):
            heading = HEADING.match(line)
            folder = heading.group(1) if heading else None
        elif folder is not None and line.startswith("-"):
            entry = ENTRY.match(line)
            if entry:
                listed.append(folder + entry.group(1))
            else:
                malformed.append(f"line {number} under `{folder}` is not of the form '- `name.py`: what': {line!r}")
    return listed, malformed


def problems(text: str, package: Path) -> list[str]:
    """What is wrong with the document's list of modules, one message per module (empty when nothing is)."""
    listed, found = listed_modules(text)
    expected = expected_modules(package)
    root = package.parent
    for module in sorted({m for m in listed if listed.count(m) > 1}):
        found.append(f"{module} is listed {listed.count(module)} times in docs/architecture.md; keep one line")
    missing = expected - set(listed)
    for module in sorted(set(listed) - expected):
        folder, _, name = module.rpartition("/")
        elsewhere = sorted(m for m in missing if m.rpartition("/")[2] == name)
        if (root / module).is_file():  # there, but left out by the rule for `__init__.py`
            found.append(f"{module} is listed but holds only re-exports; its folder's heading describes it")
        elif elsewhere:
            home = elsewhere[0].rpartition("/")[0]
            found.append(
                f"{name} is listed under `{folder}/` but the module is {elsewhere[0]}: move its line under `{home}/`"
            )
            missing.discard(elsewhere[0])
        else:
            found.append(f"{module} is listed in docs/architecture.md but no such module exists: remove its line")
    for module in sorted(missing):
        folder, _, name = module.rpartition("/")
        found.append(
            f"{module} is missing from docs/architecture.md: add '- `{name}`: what it holds' under `{folder}/`"
        )
    return found


def test_every_module_is_listed_once_under_its_folder():
    found = problems(DOC.read_text(encoding="utf-8"), PACKAGE)
    assert not found, "docs/architecture.md's module list:\n  " + "\n  ".join(found)


def test_every_folder_of_the_package_has_a_heading():
    modules = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    folders = {f"{path.parent.relative_to(ROOT).as_posix()}/" for path in modules}
    headings = {m.group(1) for line in DOC.read_text(encoding="utf-8").split("\n") if (m := HEADING.match(line))}
    assert headings == folders


# ------------------------------------------------------------------------------------------------------------------
# the check catches each mistake, on a doctored copy of the document


def _line(text: str, folder: str, name: str) -> str:
    """The document's line for `name` under `folder`'s heading."""
    section = text.split(f"### `{folder}`", 1)[1].split("\n### ", 1)[0]
    return next(line for line in section.split("\n") if line.startswith(f"- `{name}`:"))


def _move(text: str, line: str, folder: str) -> str:
    """`text` with `line` moved to the end of `folder`'s list (the line before the next heading's blank line)."""
    text = text.replace(line + "\n", "", 1)
    head, rest = text.split(f"### `{folder}`", 1)
    section, sep, tail = rest.partition("\n\n### ")
    return f"{head}### `{folder}`{section}\n{line}{sep}{tail}"


def _drop(folder: str, name: str) -> Callable[[str], str]:
    return lambda text: text.replace(_line(text, folder, name) + "\n", "", 1)


def _double(folder: str, name: str) -> Callable[[str], str]:
    return lambda text: _add_after(folder, name, _line(text, folder, name))(text)


def _add_after(folder: str, name: str, added: str) -> Callable[[str], str]:
    return lambda text: text.replace(_line(text, folder, name), f"{_line(text, folder, name)}\n{added}", 1)


def _mangle(folder: str, name: str) -> Callable[[str], str]:
    return lambda text: text.replace(_line(text, folder, name), _line(text, folder, name).replace("`:", " --", 1), 1)


DOCTORED = {
    "missing": (
        _drop("eagle3_hf/generation/", "engine.py"),
        [
            "eagle3_hf/generation/engine.py is missing from docs/architecture.md: add '- `engine.py`: what it holds' "
            "under `eagle3_hf/generation/`"
        ],
    ),
    # `vocab.py` lives in `commands/` and in `training/`: each folder's line counts for its own file only
    "missing, a name that two folders hold": (
        _drop("eagle3_hf/commands/", "vocab.py"),
        [
            "eagle3_hf/commands/vocab.py is missing from docs/architecture.md: add '- `vocab.py`: what it holds' "
            "under `eagle3_hf/commands/`"
        ],
    ),
    "listed twice": (
        _double("eagle3_hf/training/", "ttt.py"),
        ["eagle3_hf/training/ttt.py is listed 2 times in docs/architecture.md; keep one line"],
    ),
    "under the wrong layer": (
        lambda text: _move(text, _line(text, "eagle3_hf/modeling/", "depth.py"), "eagle3_hf/generation/"),
        [
            "depth.py is listed under `eagle3_hf/generation/` but the module is eagle3_hf/modeling/depth.py: move its "
            "line under `eagle3_hf/modeling/`"
        ],
    ),
    "listed but gone": (
        _add_after("eagle3_hf/commands/", "convert.py", "- `steps.py`: the decoding loop before the engine"),
        ["eagle3_hf/commands/steps.py is listed in docs/architecture.md but no such module exists: remove its line"],
    ),
    "not in the list's form": (
        _mangle("eagle3_hf/", "cli.py"),
        [
            "line {line} under `eagle3_hf/` is not of the form '- `name.py`: what': {text!r}",
            "eagle3_hf/cli.py is missing from docs/architecture.md: add '- `cli.py`: what it holds' under `eagle3_hf/`",
        ],
    ),
}


@pytest.mark.parametrize("mistake", sorted(DOCTORED))
def test_each_mistake_on_a_doctored_copy_is_named(mistake):
    doctor, expected = DOCTORED[mistake]
    text = DOC.read_text(encoding="utf-8")
    doctored = doctor(text)
    assert doctored != text
    changed = next(i for i, (a, b) in enumerate(zip(doctored.split("\n"), text.split("\n"))) if a != b)
    line = doctored.split("\n")[changed]
    assert problems(doctored, PACKAGE) == [m.format(line=changed + 1, text=line) for m in expected]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_an_init_is_listed_exactly_when_it_holds_code_of_its_own(tmp_path):
    package = tmp_path / "eagle3_hf"
    _write(package / "__init__.py", '"""Lazy names."""\n\ndef __getattr__(name):\n    raise AttributeError(name)\n')
    _write(package / "modeling" / "__init__.py", '"""Docstring only."""\n')
    _write(package / "modeling" / "tree.py", "X = 1\n")
    _write(package / "generation" / "__init__.py", "from .a import b\n\n__all__ = ['b']\n")
    _write(package / "generation" / "a.py", "b = 1\n")
    _write(package / "commands" / "__init__.py", "import os\nVERBOSE: bool = False\n")
    assert expected_modules(package) == {
        "eagle3_hf/__init__.py",
        "eagle3_hf/modeling/tree.py",
        "eagle3_hf/generation/a.py",
        "eagle3_hf/commands/__init__.py",
    }
    doc = """\
### `eagle3_hf/modeling/`: bottom

- `tree.py`: trees
- `__init__.py`: nothing

### `eagle3_hf/generation/`

- `a.py`: b

### `eagle3_hf/`: top

- `__init__.py`: lazy names

### Notes

- `commands.py`: a bullet under a heading that names no folder is not an entry
"""
    assert problems(doc, package) == [
        "eagle3_hf/modeling/__init__.py is listed but holds only re-exports; its folder's heading describes it",
        "eagle3_hf/commands/__init__.py is missing from docs/architecture.md: add '- `__init__.py`: what it holds' "
        "under `eagle3_hf/commands/`",
    ]
