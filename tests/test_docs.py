"""README, docs/ and the recipe scripts: every `eagle3-hf` command line names a real subcommand and real options
(parsed by the CLI's own parsers), and every relative link points at a file, and heading, that exists."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import re
import shlex

import pytest

from eagle3_hf.cli import SUBCOMMANDS, build_parser, build_subparser

ROOT = pathlib.Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPTS = sorted([*(ROOT / "examples").glob("*.sh"), *(ROOT / "scripts").rglob("*.sh")])
LINKED = [*DOCS, ROOT / "model_cards" / "README.md"]

# A value written in capitals (DIR, FILE, ORG/NAME, HOST0:29500) or a shell variable stands for any valid value.
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:[/:.][A-Z0-9_]+)*|\$\{?[A-Za-z_@][A-Za-z0-9_:-]*\}?.*)$")
ELISION = {"...", "$@"}  # "the other options": what is left out is not checked
SHELL_OPERATORS = {"&&", "||", ";", "|", "(", ")", "&", ">", "<", ">>"}
HELP_FLAGS = {"-h", "--help", "--help-all"}  # --help-all: `train` lists every TrainingArguments option


# ------------------------------------------------------------------------------------------------------------------
# finding the command lines


def _fenced_blocks(text: str) -> tuple[list[str], str]:
    """(the code blocks' lines, the text with the fenced blocks blanked out)."""
    code, prose, fenced = [], [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return code, "\n".join(prose)


def _indented_blocks(prose: str) -> list[str]:
    """Lines of Markdown's indented code blocks: four spaces in, after a blank line (or another such line)."""
    lines, out, previous_blank, in_block = prose.split("\n"), [], True, False
    for line in lines:
        if line.startswith("    ") and line.strip() and (previous_blank or in_block):
            out.append(line)
            in_block = True
        elif line.strip():
            in_block = False
        previous_blank = not line.strip()
    return out


def _logical_lines(lines: list[str]) -> list[str]:
    """Join the lines a backslash continues."""
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            joined.append(current + line)
            current = ""
    if current:
        joined.append(current)
    return joined


def _commands(line: str) -> list[list[str]]:
    """The `eagle3-hf` (or `-m eagle3_hf.cli`) commands in one shell line, as argument lists."""
    if "eagle3-hf" not in line and "eagle3_hf.cli" not in line:
        return []
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens, found = list(lexer), []
    for i, token in enumerate(tokens):
        if token == "eagle3-hf" or (token == "eagle3_hf.cli" and i > 0 and tokens[i - 1] == "-m"):
            args = []
            for t in tokens[i + 1 :]:
                if t in SHELL_OPERATORS:
                    break
                args.append(t)
            found.append(args)
    return found


def command_lines() -> list[tuple[str, bool, list[str]]]:
    """(where, strict, arguments) of every command line: in code blocks and scripts a whole command (strict: the
    required options must be there, unless it is elided with `...`), in inline code a fragment of one."""
    found = []
    for path in [*DOCS, *SCRIPTS]:
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(ROOT))
        if path.suffix == ".sh":
            code, inline = text.split("\n"), []
        else:
            code, prose = _fenced_blocks(text)
            code += _indented_blocks(prose)
            paragraphs = [" ".join(p.split()) for p in prose.split("\n\n")]
            inline = [span for p in paragraphs for span in re.findall(r"`([^`]+)`", p)]
        for strict, lines in ((True, _logical_lines(code)), (False, inline)):
            for line in lines:
                for args in _commands(line):
                    found.append((f"{name}: eagle3-hf {' '.join(args)}", strict, args))
    return found


COMMAND_LINES = command_lines()


# ------------------------------------------------------------------------------------------------------------------
# checking one with the CLI's own parser


def _parser(command: str) -> argparse.ArgumentParser:
    if command == "train":  # an HfArgumentParser over TrainingArguments, as `eagle3-hf train` parses
        from eagle3_hf.commands.train import build_parser as build_train_parser

        return build_train_parser()
    return build_subparser(command)


def _value_count(action: argparse.Action, rest: list[str]) -> int:
    """How many of the tokens after an option are its values."""
    if action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    limit, n = (1 if action.nargs == "?" else len(rest)), 0
    while n < min(limit, len(rest)) and (rest[n] in ELISION or not rest[n].startswith("-")):
        n += 1
    return n


def _stand_in(action: argparse.Action, value: str) -> str:
    """A placeholder replaced by a value the option accepts."""
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is not None:
        try:
            action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            return "1"
    return value


def check_command(args: list[str], strict: bool) -> None:
    """Raise AssertionError (with the parser's message) unless the CLI accepts `eagle3-hf ARGS`."""
    if not args:  # the program's name alone, as in "the CLI, `eagle3-hf`"
        return
    if args[0].startswith("-"):  # the top-level options: --help, --version
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            with pytest.raises(SystemExit) as exit_info:
                build_parser().parse_args(args)
        assert exit_info.value.code == 0, err.getvalue()
        return
    command, rest = args[0], list(args[1:])
    if PLACEHOLDER.match(command.rstrip(":")):  # `eagle3-hf COMMAND --help`: any subcommand
        return
    assert command in SUBCOMMANDS, f"no subcommand {command!r}; there are {', '.join(SUBCOMMANDS)}"
    parser = _parser(command)
    parser.allow_abbrev = False  # a prefix of an option is not the option
    helps = [a for a in rest if a in HELP_FLAGS]
    assert all(h != "--help-all" or command == "train" for h in helps), "--help-all is an option of train only"
    rest = [a for a in rest if a not in HELP_FLAGS]
    if not strict or helps or any(a in ELISION for a in rest) or "--config" in rest:
        for action in parser._actions:  # argparse keeps no public list; what is left out may be required
            action.required = False
            if not action.option_strings:
                action.nargs = "*"
    checked, i = [], 0
    while i < len(rest):
        token = rest[i]
        if token in ELISION:
            i += 1
            continue
        name, eq, inline_value = token.partition("=")
        action = parser._option_string_actions.get(name) if token.startswith("--") else None
        if action is None:  # a positional, or an option the parser does not know (it says so below)
            checked.append(token)
            i += 1
            continue
        if eq:
            value = _stand_in(action, inline_value) if PLACEHOLDER.match(inline_value) else inline_value
            checked.append(f"{name}={value}")
            i += 1
            continue
        n = _value_count(action, rest[i + 1 :])
        values = [v for v in rest[i + 1 : i + 1 + n] if v not in ELISION]
        if not values and action.nargs not in (0, "?", "*") and (not strict or n):
            values = ["VALUE"]  # prose names the option (`--plot`), or its value is elided (`--data ...`)
        checked += [name, *(_stand_in(action, v) if PLACEHOLDER.match(v) else v for v in values)]
        i += 1 + n
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parser.parse_args(checked)
        except SystemExit as exit_info:
            raise AssertionError(f"eagle3-hf {command} refuses it: {err.getvalue().strip()}") from None


@pytest.mark.parametrize(("where", "strict", "args"), COMMAND_LINES, ids=[w for w, _, _ in COMMAND_LINES])
def test_documented_command_parses(where, strict, args):
    check_command(args, strict)


def test_every_subcommand_is_documented():
    documented = {args[0] for where, _, args in COMMAND_LINES if args and not where.endswith(".sh")}
    assert set(SUBCOMMANDS) <= documented, f"not in README or docs: {sorted(set(SUBCOMMANDS) - documented)}"


@pytest.mark.parametrize(
    "line",
    [
        "eagle3-hf nosuchcommand --target smollm2",
        "eagle3-hf generate --no-such-option",
        "eagle3-hf generate --max-new 8",  # an abbreviation of --max-new-tokens
        "eagle3-hf bench --dtype float64",
        "eagle3-hf generate --max-new-tokens many",
        "eagle3-hf vocab --target smollm2 --data regen/",  # --output is required
        "eagle3-hf train --target smollm2 --data regen/ --output draft/ --no-such-training-argument 1",
        "eagle3-hf convert SRC --to speculators",  # DST is missing
    ],
)
def test_the_check_refuses_what_the_cli_refuses(line):
    (args,) = _commands(line)
    with pytest.raises(AssertionError):
        check_command(args, strict=True)


@pytest.mark.parametrize(
    "line",
    [
        "eagle3-hf train --target smollm2 --data regen/ --output draft/ \\\n  --max-steps N --learning-rate 1e-4 --resume",
        'eagle3-hf train ... --fsdp "full_shard auto_wrap"',  # elided: the required options are left out
        "torchrun --nproc_per_node 2 -m eagle3_hf.cli features --target DIR --data a b --output feats/ --device cuda",
        "eagle3-hf convert SRC DST --to speculators --target-id ORG/NAME  # a comment",
        'X=1 eagle3-hf evaluate --draft "$OUT/draft" --data a b --max-length "${LEN:-384}" && echo done',
    ],
)
def test_the_check_accepts_continued_lines_elisions_and_placeholders(line):
    (joined,) = _logical_lines(line.split("\n"))
    (args,) = _commands(joined)
    check_command(args, strict=True)


# ------------------------------------------------------------------------------------------------------------------
# the README's Python: it runs as written, with what the package and its Set up install


def python_blocks(text: str) -> list[str]:
    """The code of each ```python block."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S)]


README_PYTHON = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_python_blocks_name_what_ships():
    # Each block runs as written: no placeholder for a folder the reader would have to find or make.
    assert len(README_PYTHON) >= 1
    for block in README_PYTHON:
        compile(block, "README.md", "exec")
        assert not re.search(r"\b[A-Z]+_DIR\b|path/to", block), block
        assert 'load_target_and_tokenizer("smollm2"' in block and 'from_pretrained("smollm2-135m-instruct"' in block


@pytest.mark.slow
def test_the_readme_python_blocks_run(monkeypatch, capsys):
    import functools

    import torch

    from eagle3_hf import targets

    # SmolLM2 loads once for all the blocks (dequantizing its GGUF takes about 15 s), and answers stay short.
    monkeypatch.setattr(targets, "load_target_and_tokenizer", functools.cache(targets.load_target_and_tokenizer))
    for block in README_PYTHON:
        short = re.sub(r"max_new_tokens=\d+", "max_new_tokens=12", block)
        assert short != block
        namespace: dict = {}
        exec(compile(short, "README.md", "exec"), namespace)
        printed = capsys.readouterr().out
        assert printed.strip(), block
        target, out = namespace["target"], namespace["out"]
        if "ids" in namespace:  # the chat example, greedy in fp32: the target's own answer, token for token
            ids = namespace["ids"]
            plain = type(target).generate(
                target, ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12
            )
            assert torch.equal(out.sequences, plain) and len(out.accept_lengths) > 0
        else:
            assert printed.startswith(namespace["tokenizer"].decode(namespace["out"][0, :4]))


# ------------------------------------------------------------------------------------------------------------------
# the README's quick shell blocks: they run as written on a fresh copy of the repository

QUICK = "<!-- quick:"  # the line before a ```bash block the tests run (it takes under a minute)


def quick_shell_blocks(text: str) -> list[str]:
    """The code of each ```bash block that follows a `QUICK` comment line."""
    return [
        m.group(1)
        for m in re.finditer(r"^" + re.escape(QUICK) + r"[^\n]*\n```bash\n(.*?)^```", text, flags=re.M | re.S)
    ]


README_QUICK = quick_shell_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def fresh_copy(destination: pathlib.Path) -> pathlib.Path:
    """The repository's files as a fresh clone has them: what git tracks, and what it would track (new files not
    ignored), without build outputs, environments or anything a user made in the checkout."""
    import shutil
    import subprocess

    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout (an unpacked archive): its files
        junk = shutil.ignore_patterns(".git", ".venv", "work_data", "__pycache__", "*.egg-info", ".*_cache")
        shutil.copytree(ROOT, destination, ignore=junk)
        return destination
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a deleted file is still listed until it is committed
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def test_the_readme_marks_its_quick_blocks():
    # the quick blocks: the shipped draft's export and the corpus's data, the README's claims that need no model run
    assert len(README_QUICK) >= 2, README_QUICK
    assert any("eagle3-hf convert" in block for block in README_QUICK)
    assert any("tar xzf" in block for block in README_QUICK)


@pytest.mark.parametrize("block", README_QUICK, ids=[b.split()[0] + "..." for b in README_QUICK])
def test_the_readme_quick_shell_blocks_run_on_a_fresh_copy(block, tmp_path):
    import os
    import subprocess
    import sys

    clone = fresh_copy(tmp_path / "clone")
    bin_dir = os.path.dirname(sys.executable)  # the environment's `python` and `eagle3-hf`, as after the Set up
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=str(clone))
    env["OMP_NUM_THREADS"] = "1"
    before = set(clone.rglob("*"))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and "error:" not in done.stderr, done.stderr[-3000:]
    made = set(clone.rglob("*")) - before
    assert made, f"the block wrote nothing: {block}"  # each quick block makes something (an export, the data)
    if "eagle3-hf convert" in block:
        import json

        from eagle3_hf import Eagle3DraftModel

        (folder,) = {p for p in made if p.is_dir() and p.parent == clone}
        config = json.loads((folder / "config.json").read_text())
        assert config  # the export is a checkpoint that loads back, whatever its layout
        assert Eagle3DraftModel.from_pretrained(folder).config.hidden_size > 0
    if "tar xzf" in block:
        for name in ("regen_sharegpt", "regen_alpaca"):  # what the corpus command reads next
            assert any((clone / "work_data" / name).glob("*.jsonl")), name


# ------------------------------------------------------------------------------------------------------------------
# the results


def test_the_readme_results_are_the_reports_own_table():
    from eagle3_hf.bench.report import format_markdown

    # the README carries the latest `bench --json` report; the research page analyses the run of its own date
    pages = {
        "README.md": "scripts/research/results/bench_smollm2_bf16.json",
        "docs/research/where-the-time-goes.md": "scripts/research/results/bench_smollm2_bf16_2026-12-06_corpus.json",
    }
    for page, report_path in pages.items():
        table = format_markdown(json.loads((ROOT / report_path).read_text(encoding="utf-8")))
        text = (ROOT / page).read_text(encoding="utf-8")
        assert table in text, f"{page}: its results are not what `bench --markdown` makes of {report_path}"
        assert f"({'' if page == 'README.md' else '../../'}{report_path})" in text  # and it links the report


# ------------------------------------------------------------------------------------------------------------------
# links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    _, prose = _fenced_blocks(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def relative_links() -> list[tuple[str, pathlib.Path, str]]:
    found = []
    for path in LINKED:
        _, prose = _fenced_blocks(path.read_text(encoding="utf-8"))
        prose = re.sub(r"`[^`]*`", "", prose)  # a link inside inline code is text
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                found.append((str(path.relative_to(ROOT)), path, target))
    return found


LINKS = relative_links()


@pytest.mark.parametrize(("where", "path", "target"), LINKS, ids=[f"{w} -> {t}" for w, _, t in LINKS])
def test_relative_link_points_at_something_that_exists(where, path, target):
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    assert linked.exists(), f"{where} links to {target}, which does not exist"
    assert linked.is_relative_to(ROOT), f"{where} links outside the repository: {target}"
    if anchor and linked.suffix == ".md":
        assert anchor in _anchors(linked), f"{where} links to #{anchor}, which is no heading of {file_part or where}"


def test_links_and_commands_were_found():
    # The extraction itself: a change of format that hid every command or link would make the tests above vacuous.
    assert len(COMMAND_LINES) > 50 and sum(strict for _, strict, _ in COMMAND_LINES) > 20
    assert len(LINKS) > 50 and any("#" in t for _, _, t in LINKS)
