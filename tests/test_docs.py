"""The reference pages agree with the code, and the documentation's examples run.

- docs/cli.md and `elastic_emb.cli.build_parser()`: every subcommand has a
  section (a heading naming "`elastic-emb PATH`"), and its table has one row
  per argument (hidden ones aside) with argparse's default and choices; every
  row, flag and subcommand that cli.md names exists, and every command line
  in its code blocks parses.
- docs/api.md and `elastic_emb`: every public name is mentioned (as
  `ee.NAME`, or inside the section of its module), and every `ee.NAME...`,
  `elastic_emb.MODULE...` and `--flag` written there exists.
- Links from and to api.md and cli.md reach a heading.
- Examples: every ```python block of README.md and docs/*.md runs as written,
  unless the line just before its fence is a fragment marker:

      <!-- fragment: REASON -->

  (REASON is required, e.g. "needs a running cluster"). A fragment must still
  be valid Python. The runnable blocks of a page run in order in one fresh
  Python process, each with a fresh namespace, in a temporary directory,
  with KERAS_BACKEND=tensorflow and no ELASTIC_EMB_* variables.

Each checker returns a list of problems; the `test_the_checkers_*` tests feed
them a known mistake, so a checker that finds nothing cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import elastic_emb as ee
from elastic_emb.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

FRAGMENT = re.compile(r"^<!-- fragment: (?P<reason>.*\S.*?) -->$")
_HEADING = re.compile(r"^(#{1,6}) (.*)$")
_SPAN = re.compile(r"`([^`]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# `elastic-emb WORD [WORD]` where WORD is a command word (not `elastic-emb[disk]` nor a
# printed `elastic-emb serve: ...` prefix).
_MENTION = re.compile(r"(?<![\w/.-])elastic-emb((?: [a-z][a-z-]*(?![\w:-]))+)")


# The parser.


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand path ("serve", "cluster status", ...) -> its parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found[f"{path} {name}".strip()] = child
                    walk(child, f"{path} {name}".strip())

    walk(parser, "")
    return found


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The documented arguments of one parser: not help, subcommands or hidden flags."""
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        and a.help != argparse.SUPPRESS
    ]


def _names(action: argparse.Action) -> list[str]:
    """How cli.md names an argument: its flags, or a positional's metavar (else its
    dest in capitals)."""
    if action.option_strings:
        return list(action.option_strings)
    return [str(action.metavar) if action.metavar else action.dest.upper()]


def _defaults(value: Any) -> set[str]:
    """The ways a default may be written."""
    if isinstance(value, float):
        return {repr(value), f"{value:g}", f"{value:,g}"}
    if isinstance(value, int):
        return {str(value), f"{value:,}"}
    return {str(value)}


# Markdown.


def _sections(text: str) -> list[tuple[int, str, str]]:
    """(level, heading, body up to the next heading of any level) of a page."""
    found: list[tuple[int, str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        match = None if fenced else _HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2), []))
        elif found:
            found[-1][2].append(line)
    return [(level, heading, "\n".join(body)) for level, heading, body in found]


def _subtree(text: str, index: int) -> str:
    """Section `index` with its subsections."""
    sections = _sections(text)
    level, _, body = sections[index]
    parts = [body]
    for lower, sub, sub_body in sections[index + 1 :]:
        if lower <= level:
            break
        parts += [sub, sub_body]
    return "\n".join(parts)


def _rows(body: str) -> list[list[str]]:
    """The cells of every table row of a section, header and rule lines left out."""
    rows = []
    for line in body.splitlines():
        if not line.startswith("|") or re.fullmatch(r"[|\s:-]+", line):
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return [r for r in rows if r[0] not in ("Argument", "Flag")]


def _code_blocks(text: str, language: str | None = None) -> list[tuple[int, str, str]]:
    """(line of the fence, info string, source) of every fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info, start = lines[i][3:].strip(), i
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            if language is None or info == language:
                blocks.append((start + 1, info, "\n".join(lines[start + 1 : i])))
        i += 1
    return blocks


# docs/cli.md


def _cli_problems(parser: argparse.ArgumentParser, text: str) -> list[str]:
    commands = _commands(parser)
    problems: list[str] = []
    headed: dict[str, str] = {}
    for _, heading, body in _sections(text):
        match = re.fullmatch(r"`elastic-emb ([a-z -]+?)`", heading)
        if match:
            headed[match.group(1)] = body
    for path, sub in commands.items():
        if path not in headed:
            problems.append(f"`elastic-emb {path}` has no section (## `elastic-emb {path}`)")
            continue
        rows = _rows(headed[path])
        names_here = set()
        for action in _arguments(sub):
            for name in _names(action):
                names_here.add(name)
                row = next((r for r in rows if _names_in(r[0], name)), None)
                if row is None:
                    problems.append(f"{path}: {name} has no row in its table")
                    continue
                if len(row) < 3:
                    problems.append(f"{path}: the row of {name} lacks a default or a meaning")
                    continue
                if action.option_strings and action.required:
                    if "required" not in row[1]:
                        problems.append(f"{path}: {name} is required; its row says {row[1]!r}")
                elif action.default not in (None, False, []) and not action.required:
                    if not any(d in row[1] for d in _defaults(action.default)):
                        problems.append(
                            f"{path}: {name} defaults to {action.default!r}; its row says "
                            f"{row[1]!r}"
                        )
                for choice in action.choices or ():
                    if f"`{choice}`" not in " ".join(row):
                        problems.append(f"{path}: {name}'s choice {choice!r} is not in its row")
        for row in rows:
            for span in _SPAN.findall(row[0]):
                if not any(_names_in(f"`{span}`", n) for n in names_here):
                    problems.append(f"{path}: the row {span!r} is no argument of it")
    every_flag = {
        flag for p in [parser, *commands.values()] for a in p._actions for flag in a.option_strings
    }
    for flag in sorted(set(_FLAG.findall(text)) - every_flag):
        problems.append(f"{flag} is no flag of any subcommand")
    for words in _MENTION.findall(text):
        path = _longest_command(words.split(), commands)
        if path is None:
            problems.append(f"`elastic-emb{words}` names no subcommand")
    for line, args in _command_lines(text):
        try:
            _quietly(parser.parse_args, args)
        except SystemExit:
            problems.append(f"line {line}: `elastic-emb {' '.join(args)}` does not parse")
    return problems


def _names_in(cell: str, name: str) -> bool:
    """Whether a first cell documents `name` (as `NAME`, `NAME VALUE` or `NAME ...`)."""
    return any(span == name or span.startswith(name + " ") for span in _SPAN.findall(cell))


def _longest_command(words: list[str], commands: dict[str, Any]) -> str | None:
    """The subcommand `words` start with, if they start with one: a command with
    subcommands must be followed by one of them or by nothing."""
    if words[0] not in commands:
        return None
    path = words[0]
    children = [c.split()[-1] for c in commands if c.startswith(path + " ")]
    if children and len(words) > 1 and words[1] not in children:
        return None
    return f"{path} {words[1]}" if children and len(words) > 1 else path


def _command_lines(text: str) -> list[tuple[int, list[str]]]:
    """Each `elastic-emb ...` command of cli.md's shell blocks, as argv."""
    found = []
    for start, info, source in _code_blocks(text):
        if info not in ("", "bash", "sh"):
            continue
        joined = source.replace("\\\n", " ")
        for number, line in enumerate(joined.splitlines()):
            line = line.split(" #", 1)[0].strip()
            if line.startswith("elastic-emb "):
                words = shlex.split(line)[1:]
                while words and words[-1] in ("&", "&&"):
                    words.pop()
                found.append((start + number + 1, words))
    return found


def _quietly(function: Any, *args: Any) -> Any:
    """`function(*args)` without argparse's usage message on stderr."""
    with contextlib.redirect_stderr(io.StringIO()):
        return function(*args)


def test_cli_md_documents_every_subcommand_and_flag_exactly():
    text = (DOCS / "cli.md").read_text()
    assert _cli_problems(build_parser(), text) == []
    assert len(_commands(build_parser())) >= 12  # the walk found the nested subcommands


def test_the_checkers_find_a_missing_or_invented_flag():
    text = (DOCS / "cli.md").read_text()
    parser = build_parser()
    _commands(parser)["serve"].add_argument("--no-such-flag", default=3)
    assert _cli_problems(parser, text) == ["serve: --no-such-flag has no row in its table"]
    parser = build_parser()
    serve = _commands(parser)["serve"]
    serve._remove_action(serve._option_string_actions.pop("--tls-peer-ca"))
    assert _cli_problems(parser, text) == [
        "serve: the row '--tls-peer-ca FILE' is no argument of it",
        "--tls-peer-ca is no flag of any subcommand",
    ]
    wrong = text.replace("| `--grace-seconds SECONDS` | 30 |", "| `--grace-seconds SECONDS` | 31 |")
    assert wrong != text and len(_cli_problems(build_parser(), wrong)) == 1
    invented = text + "\n`elastic-emb serve --no-such-flag`, `elastic-emb cluster nothing`\n"
    assert len(_cli_problems(build_parser(), invented)) == 2


# docs/api.md


# Submodules whose `__all__` is for users. The `__all__` of `ee.checkpoint`,
# `ee.table` and `ee.keras_patches` also lists helpers the package's own modules
# share: there, only the names api.md documents are API (and must resolve).
USER_MODULES = (
    "admission", "callbacks", "data", "eviction", "gpu", "initializers", "layers",
    "optimizers", "placement", "shard_queue", "sharding", "storage",
)  # fmt: skip
EXTRA_NAMES = ("models.build_dlrm",)  # `ee.models` has no `__all__`


def _public_names() -> list[str]:
    names = {*ee.__all__, *ee._NAMES, *ee._SUBMODULES, "build_info"}
    for module in USER_MODULES:
        names |= {f"{module}.{n}" for n in getattr(ee, module).__all__}
    return sorted(names | set(EXTRA_NAMES))


def _resolve(dotted: str) -> bool:
    """Whether `elastic_emb.<dotted>` names something: modules imported, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), -1, -1):
        module = ".".join(["elastic_emb", *parts[:split]])
        try:
            value: Any = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                value = getattr(value, part)
        except AttributeError:
            return False
        return True
    return False


def _api_problems(text: str) -> list[str]:
    problems = []
    sections = _sections(text)
    for name in _public_names():
        module, _, member = name.rpartition(".")
        if re.search(rf"\bee\.{re.escape(name)}\b", text):
            continue
        # Or `member` in backticks inside the section of `ee.<module>` (or a heading).
        homes = [
            _subtree(text, i)
            for i, (_, heading, _) in enumerate(sections)
            if module and re.search(rf"`ee\.{re.escape(module)}[`.]", heading)
        ]
        headings = [h for _, h, _ in sections]
        if any(re.search(rf"`{re.escape(member)}[`(]", home) for home in homes):
            continue
        if not module and any(f"`ee.{member}" in h for h in headings):
            continue
        problems.append(f"ee.{name} is not documented")
    for dotted in sorted(set(re.findall(r"(?<![\w.])ee\.(\w+(?:\.[A-Za-z_]\w*)*)", text))):
        if not _resolve(dotted):
            problems.append(f"ee.{dotted} does not exist")
    for dotted in sorted(set(re.findall(r"(?<![\w.])elastic_emb\.(\w+(?:\.[A-Za-z_]\w*)*)", text))):
        if not _resolve(dotted):
            problems.append(f"elastic_emb.{dotted} does not exist")
    return problems


def test_api_md_documents_every_public_name_and_only_real_ones():
    text = (DOCS / "api.md").read_text()
    assert _api_problems(text) == []
    parsers = [build_parser(), *_commands(build_parser()).values()]
    flags = {flag for p in parsers for a in p._actions for flag in a.option_strings}
    assert set(_FLAG.findall(text)) - flags == set()  # the flags api.md refers to
    assert "optimizers.RMSprop" in _public_names() and "lookahead" in _public_names()


def test_the_checkers_find_an_undocumented_or_invented_name():
    text = (DOCS / "api.md").read_text()
    invented = text + "\n`ee.no_such_name`, `ee.optimizers.Nothing`, `elastic_emb.tables.gone`\n"
    assert _api_problems(invented) == [
        "ee.no_such_name does not exist",
        "ee.optimizers.Nothing does not exist",
        "elastic_emb.tables.gone does not exist",
    ]
    missing = re.sub(r"\bRMSprop\b", "RMSProp", text)
    assert "ee.optimizers.RMSprop is not documented" in _api_problems(missing)


# Links.


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, heading, _ in _sections(text):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _link_problems(pages: dict[str, str], checked: tuple[str, ...]) -> list[str]:
    """Broken `file.md#anchor` links from or to the pages named in `checked`."""
    anchors = {name: _anchors(text) for name, text in pages.items()}
    problems = []
    for name, text in pages.items():
        for target, anchor in re.findall(r"\]\(([\w./-]*?\.md)?#([^)\s]+)\)", text):
            target = Path(target).name if target else name
            if name in checked or target in checked:
                if target in anchors and anchor not in anchors[target]:
                    problems.append(f"{name}: no #{anchor} in {target}")
    return problems


def test_links_from_and_to_the_reference_pages_resolve():
    pages = {p.name: p.read_text() for p in PAGES}
    assert _link_problems(pages, ("api.md", "cli.md")) == []
    pages["cli.md"] += "\n[x](api.md#no-such-section) [y](#no-such-section)\n"
    assert len(_link_problems(pages, ("api.md", "cli.md"))) == 2


# Examples.


def _examples(path: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """(runnable (line, source) blocks, problems) of one page."""
    lines = path.read_text().splitlines()
    runnable, problems = [], []
    for start, info, source in _code_blocks(path.read_text()):
        before = lines[start - 2] if start >= 2 else ""
        marked = FRAGMENT.match(before)
        if before.startswith("<!-- fragment") and not marked:
            problems.append(f"{path.name}:{start}: a fragment marker needs a reason")
        if info != "python":
            if marked:
                problems.append(f"{path.name}:{start}: a fragment marker on a {info!r} block")
            continue
        try:
            compile(source, f"{path.name}:{start}", "exec")
        except SyntaxError as e:
            problems.append(f"{path.name}:{start}: not valid Python: {e}")
            continue
        if not marked:
            runnable.append((start, source))
    return runnable, problems


# Runs the blocks of a JSON file, each in a fresh namespace; stops at the first failure,
# naming its line.
_RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[2]))
for line, source in blocks:
    print(f"--- {sys.argv[1]}:{line}", flush=True)
    try:
        exec(compile(source, f"{sys.argv[1]}:{line}", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"{sys.argv[1]}:{line}: the example failed")
"""


def _run_examples(name: str, blocks: list[tuple[int, str]], cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_EMB_")}
    env |= {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
    (cwd / "examples.json").write_text(json.dumps(blocks))
    return subprocess.Popen(
        [sys.executable, "-c", _RUNNER, name, "examples.json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        text=True,
    )


def test_every_python_example_runs_or_is_marked_as_a_fragment(tmp_path):
    problems, processes = [], {}
    for path in PAGES:
        runnable, found = _examples(path)
        problems += found
        if runnable:
            (tmp_path / path.name).mkdir()
            processes[path.name] = _run_examples(path.name, runnable, tmp_path / path.name)
    try:  # the pages run side by side, one process each
        for process in processes.values():
            output, _ = process.communicate(timeout=300)
            if process.returncode != 0:
                problems.append(output[-3000:])
    finally:
        for process in processes.values():
            process.kill()
    assert not problems, "\n".join(problems)
    assert {"README.md", "api.md", "data.md"} <= set(processes)


def test_the_example_runner_reports_a_broken_example(tmp_path):
    blocks = [(3, "x = 1"), (7, "import elastic_emb\nundefined")]
    process = _run_examples("page.md", blocks, tmp_path)
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "page.md:7: the example failed" in output and "NameError" in output
    page = tmp_path / "page.md"
    page.write_text("<!-- fragment -->\n```python\nx = (\n```\n")
    assert len(_examples(page)[1]) == 2  # no reason; not valid Python
