"""The reference pages agree with the code, and the documentation's examples run.

- docs/cli.md and `elastic_emb.cli.build_parser()`: every subcommand has a
  section (a heading naming "`elastic-emb PATH`"), and its table has one row
  per argument (hidden ones aside) with argparse's default and choices; every
  row, flag and subcommand that cli.md names exists, and every command line
  in its code blocks parses.
- docs/api.md and `elastic_emb`: every public name is mentioned (as
  `ee.NAME`, or inside the section of its module), and every `ee.NAME...`,
  `elastic_emb.MODULE...` and `--flag` written there exists.
- docs/api.md's signatures and `inspect.signature`: every public function and
  class has one, and each states the code's parameters, in order, with the
  `*` before keyword-only ones and the same defaults (a default is compared
  as a value: `300` is not `300.0`). A signature is a call of the name with
  its parameters written as a `def` lists them, either in a ```python block
  after the line `<!-- fragment: signature -->` (one call a statement; no
  bare `*` there, the block being Python), or in a code span followed by a
  colon or forming a heading ("`ee.save(directory, tables=None) -> Path`:
  writes ..."); inside the section of `ee.MODULE`, `NAME(...)` is
  `ee.MODULE.NAME`. A call with `...` among its arguments (`ee.Table(...,
  device="gpu")`) abbreviates and is not one. An `| Argument |` table in the
  section of `ee.NAME` lists NAME's parameters in the code's order.
- docs/fault-tolerance.md's table of coordinator URL forms and
  `parse_endpoint` (which `ee.init`, `ELASTIC_EMB_COORDINATOR` and every
  `--coordinator` go through): each accepted form's example parses, each
  refused one fails with the error its row quotes, and every scheme the code
  accepts has a row.
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
import ast
import contextlib
import importlib
import inspect
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
from elastic_emb.ps.coord.etcd import URL_OPTIONS, parse_endpoint

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

SIGNATURE_BLOCK = "<!-- fragment: signature -->"
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


# Signatures in docs/api.md (the convention is in the module docstring).


# Public classes api.md gives no signature, and why (exceptions and warnings need none).
NO_SIGNATURE = {
    "gpu.GpuTable": "made by ee.Table(device='gpu'), not constructed",
    "optimizers.Optimizer": "the base class of the optimizers, not constructed",
}
# Names api.md says take another name's parameters, and that name (checked in the code).
SAME_PARAMETERS = {"placement.InitOptions": "init"}


def _value(dotted: str) -> Any:
    value: Any = ee
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _called(value: Any) -> Any:
    """What a call of `value` runs: `ee.Table(...)`'s metaclass hands it to the placement."""
    return type(ee.Table).create if value is ee.Table else value


def _signed_names() -> list[str]:
    """The public functions and classes whose parameters api.md must state."""
    found = []
    for name in _public_names():
        value = _value(name)
        if inspect.ismodule(value) or not callable(value):
            continue
        if isinstance(value, type) and issubclass(value, BaseException):
            continue
        if name not in NO_SIGNATURE and name not in SAME_PARAMETERS:
            found.append(name)
    return found


def _split_call(call: str) -> tuple[str, str] | None:
    """(callee, parameter text) of `callee(...)` or `callee(...) -> TYPE`, else None."""
    match = re.match(r"(?:ee\.)?([A-Za-z_][\w.]*)\(", call)
    if not match:
        return None
    depth = 0
    for i in range(match.end() - 1, len(call)):
        depth += {"(": 1, ")": -1}.get(call[i], 0)
        if depth == 0:
            rest = call[i + 1 :].strip()
            return (match.group(1), call[match.end() : i]) if rest[:2] in ("", "->") else None
    return None


def _statements(text: str) -> tuple[list[tuple[int, str, str]], list[str]]:
    """((line, name after `ee.`, parameter text) of every signature stated, problems)."""
    found, problems = [], []
    lines = text.splitlines()
    for start, _, source in _code_blocks(text, "python"):
        if start < 2 or lines[start - 2] != SIGNATURE_BLOCK:
            continue
        for statement in ast.parse(source).body:
            segment = ast.get_source_segment(source, statement) or ""
            split = _split_call(segment) if segment.startswith("ee.") else None
            if split is None:
                problems.append(f"api.md:{start + statement.lineno}: not an `ee.` signature")
            else:
                found.append((start + statement.lineno, *split))
    fenced = False  # the fenced lines blanked, so that spans are only those of the prose
    for i, line in enumerate(lines):
        fence = line.startswith("```")
        lines[i] = "" if fenced or fence else line
        fenced ^= fence
    plain = "\n".join(lines)
    modules: list[list[str]] = []  # per line: the modules whose sections hold it, innermost first
    stack: list[tuple[int, str]] = []
    for line in lines:
        heading = _HEADING.match(line)
        if heading:
            stack = [(lv, m) for lv, m in stack if lv < len(heading.group(1))]
            for module in re.findall(r"`ee\.(\w+)[`.]", heading.group(2)):
                if inspect.ismodule(getattr(ee, module, None)):
                    stack.append((len(heading.group(1)), module))
        modules.append([m for _, m in reversed(stack)])
    for span in re.finditer(r"`([^`]+)`", plain):
        number = plain.count("\n", 0, span.start())
        if not plain.startswith(":", span.end()) and not _HEADING.match(lines[number]):
            continue
        split = _split_call(span.group(1).replace("\n", " "))
        if split is None or "..." in split[1]:
            continue
        callee, parameters = split
        if span.group(1).startswith("ee."):
            candidates = [callee]
        else:
            candidates = [f"{module}.{callee}" for module in modules[number]]
        name = next((n for n in candidates if _resolve(n)), None)
        if name is not None and callable(_value(name)):
            found.append((number + 1, name, parameters))
    return found, problems


def _default_matches(text: str, value: Any) -> bool:
    """Whether a documented default (literals, and operators such as `4 << 20`) is `value`."""
    tree = ast.parse(text, mode="eval")
    literal = (ast.Expression, ast.Constant, ast.UnaryOp, ast.BinOp, ast.Tuple, ast.List)
    if not all(
        isinstance(n, (*literal, ast.operator, ast.unaryop, ast.Load)) for n in ast.walk(tree)
    ):
        return text.replace("'", '"') == repr(value).replace("'", '"')
    documented = eval(compile(tree, "<default>", "eval"), {"__builtins__": {}})
    return type(documented) is type(value) and documented == value


def _parameter_problems(where: str, parameters: str, signature: inspect.Signature) -> list[str]:
    """How the parameters `parameters` (as in a `def`) differ from `signature`."""
    source = f"def f({parameters}): pass"
    try:
        function = ast.parse(source).body[0]
    except SyntaxError:
        return [f"{where}: ({parameters}) is not a parameter list"]
    assert isinstance(function, ast.FunctionDef)
    args, kind = function.args, inspect.Parameter
    positional = [(a, kind.POSITIONAL_ONLY) for a in args.posonlyargs]
    positional += [(a, kind.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    documented = [
        (a.arg, k, d) for (a, k), d in zip(positional, defaults + args.defaults, strict=True)
    ]
    if args.vararg:
        documented.append((args.vararg.arg, kind.VAR_POSITIONAL, None))
    documented += [
        (a.arg, kind.KEYWORD_ONLY, d)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        documented.append((args.kwarg.arg, kind.VAR_KEYWORD, None))
    code = list(signature.parameters.values())
    names = [name for name, _, _ in documented]
    if names != [p.name for p in code]:
        missing = [p.name for p in code if p.name not in names]
        invented = [name for name in names if name not in signature.parameters]
        said = "; ".join(
            [f"misses {', '.join(missing)}"] * bool(missing)
            + [f"has no parameter {', '.join(invented)}"] * bool(invented)
        )
        listed = ", ".join(p.name for p in code)
        return [f"{where}: {said or 'the parameters are in another order'}; the code: ({listed})"]
    problems: list[str] = []
    kinds: dict[tuple[str, str], list[str]] = {}
    for (name, documented_kind, default), p in zip(documented, code, strict=True):
        if documented_kind != p.kind:
            kinds.setdefault((p.kind.description, documented_kind.description), []).append(name)
        text = None if default is None else ast.get_source_segment(source, default)
        if p.default is p.empty and text is not None:
            problems.append(f"{where}: {name} has no default in the code; here {text}")
        elif p.default is not p.empty and text is None:
            problems.append(f"{where}: {name} defaults to {p.default!r}; here no default")
        elif text is not None and not _default_matches(text, p.default):
            problems.append(f"{where}: {name} defaults to {p.default!r}; here {text}")
    for (in_code, here), names in kinds.items():
        problems.append(f"{where}: {', '.join(names)}: {in_code} in the code, {here} here")
    return problems


def _signature_problems(text: str) -> list[str]:
    statements, problems = _statements(text)
    stated = set()
    for line, name, parameters in statements:
        target = _called(_value(name))
        stated.add(id(target))
        where = f"api.md:{line}: ee.{name}"
        problems += _parameter_problems(where, parameters, inspect.signature(target))
    for name in _signed_names():
        if id(_called(_value(name))) not in stated:
            problems.append(f"ee.{name} has no signature in api.md")
    for _, heading, body in _sections(text):  # an Argument table lists them in order too
        match = re.fullmatch(r"`ee\.([\w.]+)`", heading)
        table = re.search(r"^\| Argument \|.*\n(?:\|.*\n?)*", body, re.MULTILINE)
        if match and table and _resolve(match.group(1)):
            rows = _rows(table.group(0))
            listed = [span.lstrip("*") for row in rows for span in _SPAN.findall(row[0])]
            code = list(inspect.signature(_called(_value(match.group(1)))).parameters)
            if listed != code:
                problems.append(
                    f"api.md: the Argument table of ee.{match.group(1)} lists "
                    f"({', '.join(listed)}); the code: ({', '.join(code)})"
                )
    return problems


def test_api_md_states_every_signature_as_the_code_has_it():
    text = (DOCS / "api.md").read_text()
    assert _signature_problems(text) == []
    assert type(ee.Table).create is ee.placement.create_table  # as `_called` takes it
    for name, same in SAME_PARAMETERS.items():  # api.md says they take the same parameters
        assert _parameters(name) == _parameters(same)
    assert {"Embedding", "Table", "init", "sharding.slot_of"} <= set(_signed_names())


def test_the_checkers_find_a_wrong_signature():
    text = (DOCS / "api.md").read_text()
    mistakes = {
        "mask_zero=False, seed=None": "seed=None, mask_zero=False",  # swapped
        "timeout=300.0,": "timeout=300,",  # an int, not the float of the code
        "sketch_bytes=4 << 20": "sketch_bytes=4 << 21",
        "ee.save(directory, tables=None, incremental=False,": "ee.save(directory, tables=None,",
        "ee.DistributedEmbedding(feature_configs, *, ": "ee.DistributedEmbedding(feature_configs, ",
        "`slot_of(keys, num_slots=4096)`": "`slot_of(key, num_slots=4096)`",  # in ee.sharding
        "`ee.gpu.available()`:": "`ee.gpu.available()` is",  # no longer a signature
        "| `combiner` |": "| `combiners` |",
        "protect_steps=1)\nee.eviction.LRU": "protect_steps=1)\nx = 1\nee.eviction.LRU",
    }
    for right, wrong in mistakes.items():
        assert text.count(right) == 1, right
        text = text.replace(right, wrong)
    problems = [re.sub(r"^api\.md:\d+: ", "", p) for p in _signature_problems(text)]
    embedding = ", ".join(inspect.signature(ee.Embedding).parameters)
    assert problems == [
        "not an `ee.` signature",
        f"ee.Embedding: the parameters are in another order; the code: ({embedding})",
        "ee.admission.Frequency: sketch_bytes defaults to 4194304; here 4 << 21",
        "ee.init: timeout defaults to 300.0; here 300",
        "ee.DistributedEmbedding: table_stacking, update_stats: keyword-only in the code, "
        "positional or keyword here",
        "ee.save: misses incremental; the code: (directory, tables, incremental, max_deltas)",
        "ee.sharding.slot_of: misses keys; has no parameter key; the code: (keys, num_slots)",
        "ee.gpu.available has no signature in api.md",
        "api.md: the Argument table of ee.Embedding lists (output_dim, optimizer, "
        f"embeddings_initializer, combiners, {embedding.split('combiner, ')[1]}); the code: "
        f"({embedding})",
    ]


def _parameters(name: str) -> list[tuple[str, Any, Any]]:
    return [
        (p.name, p.kind, p.default) for p in inspect.signature(_value(name)).parameters.values()
    ]


# docs/fault-tolerance.md: the coordinator URL.

# Schemes tried on `parse_endpoint` besides the string literals of its source.
CANDIDATE_SCHEMES = (
    "etcd", "etcds", "http", "https", "grpc", "grpcs", "unix", "unixs", "dns", "tcp", "tls",
    "ws", "wss", "h2", "h2c", "ftp", "file", "consul", "zk",
)  # fmt: skip


def _coordinator_tables(text: str) -> tuple[list[list[str]], list[list[str]]]:
    """The rows (cells) of the accepted and of the refused forms."""
    body = next(b for _, h, b in _sections(text) if h == "The coordinator URL")
    tables: dict[str, list[list[str]]] = {"Form": [], "Refused": []}
    current = None
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            current = None
        elif current is None:
            current = tables.get(cells[0])
        elif current is not None and not re.fullmatch(r"[|\s:-]+", line):
            current.append(cells)
    return tables["Form"], tables["Refused"]


def _coordinator_problems(text: str, parse: Any) -> list[str]:
    """How the forms documented in `text` differ from those `parse` (raising ValueError)
    accepts."""
    accepted, refused = _coordinator_tables(text)
    problems = []
    for row in accepted:
        example = _SPAN.findall(row[1])[0]
        try:
            parse(example)
        except ValueError as e:
            problems.append(f"{example!r} ({row[0]}) does not parse: {e}")
    for row in refused:
        example, says = _SPAN.findall(row[1])[0], _SPAN.findall(row[2])[0]
        try:
            parse(example)
        except ValueError as e:
            if says not in str(e):
                problems.append(f"{example!r} is refused, but not with {says!r}: {e}")
        else:
            problems.append(f"{example!r} ({row[0]}) is documented as refused, but parses")
    forms = " ".join(row[0] for row in accepted)
    source = inspect.getsource(parse_endpoint)
    literals = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)}
    words = {w for w in literals if isinstance(w, str) and re.fullmatch(r"[a-z][a-z0-9+.-]*", w)}
    for scheme in sorted(words | set(CANDIDATE_SCHEMES)):
        with contextlib.suppress(ValueError):
            parse(f"{scheme}://h:1")
            if f"`{scheme}://" not in forms:
                problems.append(f"{scheme}://HOST:PORT parses, but has no row of its own")
    with contextlib.suppress(ValueError):
        parse("h:1")
        if "`HOST:PORT`" not in forms:
            problems.append("HOST:PORT (no scheme) parses, but has no row of its own")
    for option in URL_OPTIONS:
        if f"`{option}=" not in " ".join(" ".join(row) for row in accepted):
            problems.append(f"the option {option}= is not documented")
    return problems


def _cli_coordinator(path: str) -> Any:
    """The check of one subcommand's --coordinator, raising ValueError as parse_endpoint."""
    action = _commands(build_parser())[path]._option_string_actions["--coordinator"]

    def parse(url: str) -> Any:
        try:
            return action.type(url)  # type: ignore[misc]
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None

    return parse


def test_fault_tolerance_md_lists_every_coordinator_url_form():
    text = (DOCS / "fault-tolerance.md").read_text()
    assert _coordinator_problems(text, parse_endpoint) == []
    accepted, refused = _coordinator_tables(text)
    assert len(accepted) >= 8 and len(refused) >= 6
    with_flag = [
        path for path, p in _commands(build_parser()).items()
        if "--coordinator" in p._option_string_actions
    ]  # fmt: skip
    assert len(with_flag) >= 5
    for path in with_flag:  # every --coordinator flag takes the same forms
        assert _coordinator_problems(text, _cli_coordinator(path)) == [], path
    for page in ("api.md", "cli.md"):  # they link to the table rather than repeat it
        assert "(fault-tolerance.md#the-coordinator-url)" in (DOCS / page).read_text()


def test_the_checkers_find_an_undocumented_coordinator_url_form():
    text = (DOCS / "fault-tolerance.md").read_text()
    mistakes = {
        "| `http://HOST:PORT` | `http://127.0.0.1:2379` | the same as "
        "`etcd://HOST:PORT` |\n": "",  # a form left out
        "password-file=pw`": "password-file=`",  # an option without a value
        "| `etcd://e1:2379/v3` |": "| `etcd://e1:2379/` |",  # parses
        "| `etcd://e1` | `is not HOST:PORT` |": "| `etcd://e1` | `no port` |",
        "`password-file=FILE`, ": "",
    }
    for right, wrong in mistakes.items():
        assert text.count(right) == 1, right
        text = text.replace(right, wrong)
    problems = _coordinator_problems(text, parse_endpoint)
    expected = [
        "'etcds://e1:2379?ca=ca.pem&cert=ps.pem&key=ps.key&user=ps&password-file=' "
        "(`etcds://HOST:PORT[,...]?OPTION=VALUE&...`) does not parse",
        "'etcd://e1' is refused, but not with 'no port'",
        "'etcd://e1:2379/' (a path) is documented as refused, but parses",
        "http://HOST:PORT parses, but has no row of its own",
        "the option password-file= is not documented",
    ]
    assert [p[: len(e)] for p, e in zip(problems, expected, strict=True)] == expected
    text = (DOCS / "fault-tolerance.md").read_text()
    ftp = _coordinator_problems(text, lambda url: parse_endpoint(url.replace("ftp:", "etcd:")))
    assert ftp == ["ftp://HOST:PORT parses, but has no row of its own"]


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
