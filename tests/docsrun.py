"""Running the fenced blocks of README.md and docs/*.md (the convention: docs/docs-tests.md).

:func:`collect` reads every fenced block with its file, line, language and marker (an HTML comment
``<!-- docs-test: ... -->`` on the line before the fence). :func:`run_block` runs a ``python``
block in this process (a fresh namespace, compiled under the page's name and line numbers, so a
traceback points into the page), a ``bash``/``sh`` block with ``bash -euo pipefail`` and a
``console`` block's ``$`` commands, in a scratch directory with the environment of a
:class:`DocsEnv`; a failure raises :class:`DocBlockError` naming ``file:line``. A block marked
``output`` holds what the runnable block before it prints (``...`` matches anything).
Blocks that are not run are still checked: :func:`check_commands` parses the ``sparkv`` commands
of a skipped shell block or a ``usage`` synopsis with the CLI's own argparse definitions, and
:func:`check_imports` compiles a skipped python block and runs its imports.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

SHELL = ("bash", "sh", "console")
RUNNABLE = SHELL + ("python",)
SETUPS = ("server",)
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
SKIP = re.compile(r"skip\s*\((.+)\)")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")


class DocBlockError(AssertionError):
    """A block that failed, printed something else than its page shows, or breaks the rules."""


@dataclass(frozen=True)
class Marker:
    """What ``<!-- docs-test: ... -->`` says about the block below it."""

    skip: str | None = None          # the reason it is not run
    usage: bool = False              # a synopsis: its sparkv flags must exist
    output: bool = False             # what the runnable block above prints
    setup: tuple[str, ...] = ()      # fixtures it needs ("server")
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Block:
    path: str                        # relative to the repository root
    line: int                        # 1-based line of the opening fence
    lang: str
    text: str
    marker: Marker = field(default_factory=Marker)
    problems: tuple[str, ...] = ()   # broken rules (an untagged fence, a bad marker)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and self.marker.skip is None


def parse_marker(text: str) -> tuple[Marker, list[str]]:
    """The marker of ``docs-test: TEXT``, and what is wrong with it."""
    problems: list[str] = []
    kw: dict[str, Any] = {}
    skip = SKIP.search(text)
    if skip:
        kw["skip"] = skip.group(1).strip()
        text = text[:skip.start()] + text[skip.end():]
    for word in text.replace(";", " ").split():
        key, _, value = word.partition("=")
        if key in ("usage", "output") and not value:
            kw[key] = True
        elif key == "setup" and all(s in SETUPS for s in value.split(",")):
            kw["setup"] = tuple(value.split(","))
        elif key == "timeout" and value.isdigit():
            kw["timeout_s"] = float(value)
        else:
            problems.append(f"unknown marker word {word!r} (skip (REASON) needs a reason)"
                            if key == "skip" else f"unknown marker word {word!r}")
    return Marker(**kw), problems


def parse_page(path: str, text: str) -> list[Block]:
    """Every fenced block of one markdown page."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end]]
        blocks.append(_block(path, i, lang, "\n".join(body) + "\n", lines[i - 1] if i else ""))
        i = end + 1
    return blocks


def _block(path: str, i: int, lang: str, text: str, before: str) -> Block:
    problems: list[str] = []
    marker = Marker()
    mm = MARKER.match(before)
    if mm:
        marker, problems = parse_marker(mm.group(1))
    if not lang:
        problems.append("a fence must name its language (```text for anything that is not run)")
    elif marker.skip and lang not in RUNNABLE:
        problems.append(f"'skip' on a {lang} block, which is never run")
    return Block(path, i + 1, lang, text, marker, tuple(problems))


def collect(root: Path, pages: list[str] | None = None) -> list[Block]:
    """The blocks of README.md and docs/*.md (or of ``pages``), with the rules they break."""
    names = pages if pages is not None else ["README.md"] + sorted(
        str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))
    blocks: list[Block] = []
    for name in names:
        page = parse_page(name, (root / name).read_text(encoding="utf-8"))
        blocks += _check_outputs(page)
    return blocks


def _check_outputs(page: list[Block]) -> list[Block]:
    """An ``output`` block must follow a runnable one."""
    out = []
    for prev, b in zip([None, *page], page):
        if b.marker.output and (prev is None or not prev.runnable):
            b = Block(b.path, b.line, b.lang, b.text, b.marker,
                      b.problems + ("an 'output' block must follow a block that runs",))
        out.append(b)
    return out


def expected_output(blocks: list[Block], block: Block) -> str | None:
    """The text of the ``output`` block right after ``block``, if there is one."""
    i = blocks.index(block)
    if i + 1 < len(blocks) and blocks[i + 1].path == block.path and blocks[i + 1].marker.output:
        return blocks[i + 1].text
    return None


# ---- running -----------------------------------------------------------------------------------
@dataclass
class DocsEnv:
    """Where and how blocks run: a scratch directory, environment variables (added to this
    process's), and text substitutions (placeholder -> value) made before running."""

    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    substitutions: dict[str, str] = field(default_factory=dict)

    def substitute(self, text: str) -> str:
        for old, new in self.substitutions.items():
            text = text.replace(old, new)
        return text


def run_block(block: Block, env: DocsEnv, expected: str | None = None) -> str:
    """Runs ``block`` and returns what it printed; raises :class:`DocBlockError` on a failure or
    when the output differs from ``expected`` (and from a console block's own output lines)."""
    if block.problems:
        raise DocBlockError(f"{block.where}: " + "; ".join(block.problems))
    if block.lang == "python":
        out = run_python(block, env)
    elif block.lang == "console":
        commands, shown = split_console(block.text)
        out = run_shell(block, env, commands)
        expected = expected if expected is not None else (shown if shown.strip() else None)
    else:
        out = run_shell(block, env, block.text)
    if expected is not None and not output_matches(expected, out):
        raise DocBlockError(f"{block.where}: the output differs from the page's.\n"
                            f"--- page\n{expected}--- got\n{out}")
    return out


@contextlib.contextmanager
def _environment(env: DocsEnv) -> Iterator[None]:
    saved, cwd = dict(os.environ), os.getcwd()
    os.environ.update(env.env)
    os.chdir(env.cwd)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def run_python(block: Block, env: DocsEnv) -> str:
    """Executes the block as a script in a fresh namespace; the code keeps the page's line
    numbers, so a traceback names ``file:line`` of the page."""
    code = compile("\n" * block.line + env.substitute(block.text), block.path, "exec")
    buf = io.StringIO()
    with _environment(env), contextlib.redirect_stdout(buf):
        try:
            exec(code, {"__name__": "__main__"})
        except Exception as exc:
            raise DocBlockError(f"{block.where}: the python block raised "
                                f"{type(exc).__name__}: {exc}\n{buf.getvalue()}") from exc
    return buf.getvalue()


def run_shell(block: Block, env: DocsEnv, script: str) -> str:
    """Runs the script with ``bash -euo pipefail`` (stderr is shown only on a failure)."""
    p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", env.substitute(script)],
                         cwd=env.cwd, env={**os.environ, **env.env}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=block.marker.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)        # the block's own process group: its children too
        p.communicate()
        raise DocBlockError(f"{block.where}: still running after {block.marker.timeout_s:.0f} s"
                            " (a command that does not return belongs in a skipped block)") from None
    if p.returncode != 0:
        raise DocBlockError(f"{block.where}: the {block.lang} block exited with {p.returncode}\n"
                            f"--- stdout\n{out[-4000:]}--- stderr\n{err[-4000:]}")
    return out


def split_console(text: str) -> tuple[str, str]:
    """A console block's commands (``$ `` lines and their ``\\`` continuations) and the output
    lines it shows."""
    commands, shown, cont = [], [], False
    for line in text.splitlines():
        if cont or line.startswith("$ "):
            commands.append(line if cont else line[2:])
            cont = line.endswith("\\")
        else:
            shown.append(line)
    return "\n".join(commands) + "\n", "".join(s + "\n" for s in shown)


def output_matches(expected: str, got: str) -> bool:
    """Line-trailing whitespace and surrounding blank lines aside, ``got`` is ``expected`` where
    each ``...`` stands for any text (newlines included)."""
    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip("\n").splitlines())

    pattern = ".*?".join(re.escape(part) for part in norm(expected).split("..."))
    return re.fullmatch(pattern, norm(got), re.DOTALL) is not None


# ---- commands that are not run: checked against the CLI's parser ---------------------------------
def sparkv_commands(block: Block) -> list[str]:
    """The ``sparkv ...`` commands of a block: lines joined over ``\\`` continuations. A shell
    block's lines are split at ``&&``, ``;`` and ``|``; a usage block's indented lines continue
    the command above, its ``|`` are alternatives, and its ``#`` comments are dropped."""
    usage = block.marker.usage
    joined: list[str] = []
    for line in block.text.splitlines():
        if usage:
            line = re.split(r"(?:^|\s)#", line)[0]
        if joined and (joined[-1].endswith("\\") or (usage and line[:1].isspace())):
            joined[-1] = joined[-1].rstrip("\\") + " " + line.strip()
        else:
            joined.append(line.strip())
    parts = joined if usage else [p for ln in joined for p in re.split(r"&&|\|\||;|\|", ln)]
    return [p.strip() for p in parts if p.strip().startswith("sparkv ")]


def check_imports(block: Block) -> int:
    """Compiles a python block that is not run and runs only its top-level imports (the names it
    imports must exist); returns how many import statements ran."""
    try:
        tree = ast.parse(block.text, block.path)
    except SyntaxError as exc:
        raise DocBlockError(f"{block.path}:{block.line + (exc.lineno or 0)}: {exc.msg}") from None
    ast.increment_lineno(tree, block.line)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    try:
        exec(compile(ast.Module(body=imports, type_ignores=[]), block.path, "exec"), {})
    except ImportError as exc:
        raise DocBlockError(f"{block.where}: {type(exc).__name__}: {exc}") from exc
    return len(imports)


def check_commands(block: Block, parser: Any) -> int:
    """Parses each ``sparkv`` command of ``block`` with the CLI's parser (``usage`` blocks: only
    that the subcommand exists and knows every ``--flag``); returns how many were checked."""
    commands = sparkv_commands(block)
    for cmd in commands:
        problem = usage_problem(cmd, parser) if block.marker.usage else parse_problem(cmd, parser)
        if problem:
            raise DocBlockError(f"{block.where}: `{cmd}`: {problem}")
    return len(commands)


def parse_problem(cmd: str, parser: Any) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(shlex.split(cmd, comments=True)[1:])
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {exc.code}"
    return None


def usage_problem(cmd: str, parser: Any) -> str | None:
    words = cmd.split()[1:]
    sub, path = parser, ["sparkv"]
    while (choices := _subparsers(sub)) is not None:
        if not words or words[0] not in choices:
            return f"{' '.join(path)} has no subcommand {words[0] if words else '(none given)'!r}"
        path.append(words[0])
        sub = choices[words.pop(0)]
    known = {s for a in sub._actions for s in a.option_strings}
    unknown = [f for f in FLAG.findall(" ".join(words)) if f not in known]
    return f"{' '.join(path)} has no {', '.join(unknown)}" if unknown else None


def _subparsers(parser: Any) -> dict[str, Any] | None:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return None
