"""The guides cannot go stale: what they link, the commands and flags and config keys
they name, exist.

The rules a guide follows (``docs/`` and ``README.md``):

- A relative link names a file of the repository; an ``#anchor`` names a
  heading of the page it points at, as GitHub and the docs site (Python
  Markdown's ``toc``) both spell it: lower case, punctuation dropped, spaces
  as hyphens. A heading whose two spellings differ cannot be linked to.
- A command line ``watchdogd SUB …`` or ``watchdogctl SUB …`` (in a code
  block or an inline code span) names a subcommand that exists, and its
  flags are that subcommand's (for ``watchdogd run``, those before the
  program: what follows the program is the program's).
- A flag alone in an inline code span (```--prewarm```) is one of ours;
  another program's flag is written with its program (```sbatch --requeue```).
- A config key written ```key = value``` exists in the daemon's config
  (``core/config.py``, at any depth); ``key=value`` without spaces is a
  Python argument or an event's field.
- A Python block of ``docs/trainer.md`` or ``docs/launch-api.md`` whose last
  line before it (blank lines aside) is ``<!-- runnable -->`` runs, as a
  script in a directory of its own, against a daemon this module starts
  (``WATCHDOGD_SOCKET`` names it), and exits 0; ``<!-- runnable: killed by
  SIGKILL -->`` says it ends killed by SIGKILL instead (a hang the daemon
  kills). When the next block of the page, with no heading between, is a
  ````` ```text ````` block, the script's stdout is that block, exactly.
  Runnable blocks are quick: the whole check takes seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import typing
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest

from watchdogd.cli import ctl
from watchdogd.cli import main as cli_main
from watchdogd.core.config import Config

from ..conftest import REPO

GUIDES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _code_lines(text: str) -> Iterator[str]:
    """Each line of each code block, continuation lines (``\\``) joined."""
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        yield from joined.splitlines()[1:-1]


# -- links and anchors -----------------------------------------------------------------


def _heading_text(line: str) -> str:
    text = line.lstrip("#").strip()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    return text.replace("`", "").replace("*", "")


def github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def toc_slug(heading: str) -> str:
    """Python Markdown's ``toc.slugify`` (mkdocs' default)."""
    ascii_text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())


def anchors(page: Path) -> set[str]:
    """The anchors both spellings agree on, of the headings outside code blocks."""
    lines = _prose(page.read_text()).splitlines()
    headings = [_heading_text(line) for line in lines if line.startswith("#")]
    return {github_slug(h) for h in headings if github_slug(h) == toc_slug(h)}


def links(page: Path) -> Iterator[str]:
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            yield target


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in GUIDES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_link_check_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "guide.md"
    page.write_text("# A guide\n\n## Its `--prewarm` part\n\nSee [x](#its---prewarm-part).\n")
    assert anchors(page) == {"a-guide"}  # GitHub keeps both hyphens, toc one: unlinkable
    assert list(links(page)) == ["#its---prewarm-part"]
    page.write_text("# A guide\n\n## Its prewarm part\n\n[x](#its-prewarm-part) [y](nope.md)\n")
    assert anchors(page) == {"a-guide", "its-prewarm-part"}


# -- commands and flags ----------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


COMMANDS = {"watchdogd": cli_main._parser(), "watchdogctl": ctl._parser()}
OURS = {
    flag
    for parser in COMMANDS.values()
    for sub in [parser, *_subcommands(parser).values()]
    for flag in _options(sub)
}


def _tokens(line: str) -> list[str]:
    line = re.split(r"\s(?:#|\||&&|;|>)\s?", line + " ")[0]
    try:
        return shlex.split(line)
    except ValueError:  # an unclosed quote in prose
        return line.split()


def check_command(words: list[str]) -> list[str]:
    """What is wrong with ``words`` (``watchdogd``/``watchdogctl`` first): an unknown
    subcommand, or flags its parser lacks."""
    parser = COMMANDS[words[0]]
    if len(words) > 1 and not re.fullmatch(r"-.*|[a-z][a-z-]*", words[1]):
        return []  # its output (a banner, a summary), not a command line
    if len(words) < 2 or words[1].startswith("-"):
        return [f for f in words[1:] if f.startswith("--") and f.split("=")[0] not in OURS]
    subcommand = _subcommands(parser).get(words[1])
    if subcommand is None:
        return [f"{words[0]} {words[1]}"]
    options = _options(parser) | _options(subcommand)
    wrong = []
    rest = iter(words[2:])
    for word in rest:
        word = word.strip("[]")
        if word == "--" and words[1] == "run":
            break
        if not word.startswith("-") or word in ("-", "…"):
            if words[1] == "run" and not re.fullmatch(r"[A-Z_…]+", word):
                break  # the program: what follows is its own
            continue
        flag = word.split("=")[0]
        action = options.get(flag)
        if action is None:
            wrong.append(f"{words[0]} {words[1]} {flag}")
        elif action.nargs is None and "=" not in word:
            next(rest, None)  # its value
    return wrong


def named_commands(text: str) -> Iterator[list[str]]:
    for line in [*_code_lines(text), *_code_spans(text)]:
        words = _tokens(line)
        for i, word in enumerate(words):
            if word in COMMANDS and (i == 0 or words[i - 1] in ("sudo", "exec", "$", "ExecStart=")):
                yield words[i:]


def _braces(flag: str) -> list[str]:
    """``--duplicate-std{out,err}-filters``: each flag it stands for."""
    match = re.search(r"\{([^}]*)\}", flag)
    if match is None:
        return [flag]
    return [flag[: match.start()] + part + flag[match.end() :] for part in match[1].split(",")]


def test_every_command_and_flag_a_guide_names_exists() -> None:
    wrong = []
    for page in GUIDES:
        text = page.read_text()
        for words in named_commands(text):
            wrong += [f"{page.relative_to(REPO)}: {w}" for w in check_command(words)]
        for span in _code_spans(text):
            if span.startswith("--"):
                for flag in _braces(span.split()[0].split("=")[0].rstrip(":,.")):
                    if flag not in OURS:
                        wrong.append(f"{page.relative_to(REPO)}: {flag}")
    assert wrong == []


def test_the_flag_check_catches_a_renamed_flag_and_subcommand() -> None:
    assert check_command(["watchdogd", "run", "--nproc-per-node", "2", "t.py", "--lr", "1"]) == []
    assert check_command(["watchdogd", "run", "--nprocs-per-node", "2", "t.py"]) == [
        "watchdogd run --nprocs-per-node"
    ]
    assert check_command(["watchdogctl", "timer"]) == ["watchdogctl timer"]
    assert check_command(["watchdogctl", "groups", "[--json]"]) == []
    assert list(named_commands("run `watchdogctl status --jsn` then\n")) == [
        ["watchdogctl", "status", "--jsn"]
    ]
    assert check_command(["watchdogctl", "status", "--jsn"]) == ["watchdogctl status --jsn"]


# -- config keys -----------------------------------------------------------------------


def _structs_in(annotation: object) -> Iterator[type[msgspec.Struct]]:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        yield annotation
        return
    for argument in typing.get_args(annotation):
        yield from _structs_in(argument)


def config_keys(struct: type[msgspec.Struct] = Config) -> set[str]:
    """Every key of the daemon's config, at any depth."""
    keys: set[str] = set()
    todo, seen = [struct], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for field in msgspec.structs.fields(current):
            keys.add(field.encode_name)
            todo += _structs_in(field.type)
    return keys


def named_config_keys(text: str) -> list[str]:
    return [
        match[1]
        for span in _code_spans(text)
        if (match := re.match(r"^([a-z][a-z0-9_]*) = \S", span)) is not None
    ]


def test_every_config_key_a_guide_names_exists() -> None:
    known = config_keys()
    unknown = [
        f"{page.relative_to(REPO)}: {key}"
        for page in GUIDES
        for key in named_config_keys(page.read_text())
        if key not in known
    ]
    assert unknown == []


def test_the_key_check_catches_a_removed_key() -> None:
    named = named_config_keys("Set `fault_injection = true`, or `stack_dump_timout = 2`.")
    assert [key for key in named if key not in config_keys()] == ["stack_dump_timout"]


def test_no_guide_links_outside_its_tree() -> None:
    # A clone of the project has no ../shared; the site has only docs/ (a page embeds
    # a file from elsewhere with a snippet, `--8<-- "examples/trainer.py"`).
    outside = [
        f"{page.relative_to(REPO)}: {target}"
        for page in GUIDES
        for target in links(page)
        if not (page.parent / target.partition("#")[0])
        .resolve()
        .is_relative_to(REPO / "docs" if page.is_relative_to(REPO / "docs") else REPO)
    ]
    assert outside == []


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("material", reason="the docs extra is not installed: pip install '.[docs]'")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    page = (tmp_path / "index.html").read_text()
    assert "def main" in page or "expires" in page  # the embedded example is in the page


# -- runnable blocks -------------------------------------------------------------------

RUNNABLE_PAGES = [REPO / "docs/trainer.md", REPO / "docs/launch-api.md"]
BLOCK = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!-- runnable(?:: (?P<ending>[^>]*?))? -->")
ENDINGS = {None: 0, "killed by SIGKILL": -signal.SIGKILL}


class Runnable(NamedTuple):
    where: str  # page:line
    code: str
    ending: str | None
    output: str | None  # the text block after it: its stdout


def runnable_blocks(page: Path) -> list[Runnable]:
    text = page.read_text()
    blocks = list(BLOCK.finditer(text))
    found = []
    for block, after in zip(blocks, [*blocks[1:], None], strict=True):
        before = text[: block.start()].rstrip().rpartition("\n")[2]
        marker = MARKER.fullmatch(before)
        if marker is None:
            continue
        between = text[block.end() : after.start()] if after is not None else "#"
        shows = after is not None and after["info"].strip() == "text" and "\n#" not in between
        found.append(
            Runnable(
                where=f"{page.name}:{text.count(chr(10), 0, block.start()) + 1}",
                code=block["body"] if block["info"].strip() == "python" else "",
                ending=marker["ending"],
                output=after["body"] if shows and after is not None else None,
            )
        )
    return found


def check_runnable(block: Runnable, socket: Path, workdir: Path) -> list[str]:
    """What is wrong with ``block`` run against the daemon at ``socket``."""
    if not block.code or block.ending not in ENDINGS:
        return [
            f"{block.where}: a runnable block is Python and ends as {sorted(map(str, ENDINGS))}"
        ]
    script = workdir / "snippet.py"
    script.write_text(block.code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env={**os.environ, "WATCHDOGD_SOCKET": str(socket), "TMPDIR": str(workdir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    wrong = []
    if done.returncode != ENDINGS[block.ending]:
        wrong.append(
            f"{block.where}: exit {done.returncode}, not {ENDINGS[block.ending]}: {done.stderr}"
        )
    if block.output is not None and done.stdout != block.output:
        wrong.append(f"{block.where}: printed {done.stdout!r}, not {block.output!r}")
    return wrong


@pytest.fixture(scope="module")
def docs_daemon() -> Iterator[Path]:
    """A ``watchdogd serve`` for the runnable blocks: its socket."""
    runtime_dir = Path(tempfile.mkdtemp(prefix="wd-", dir="/tmp"))  # a short socket path
    daemon = subprocess.Popen(
        ["watchdogd", "serve", "--runtime-dir", str(runtime_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert daemon.stdout is not None
        assert "serving" in daemon.stdout.readline()
        yield runtime_dir / "watchdogd.sock"
    finally:
        daemon.terminate()
        daemon.wait(10)
        daemon.stdout and daemon.stdout.close()
        daemon.stderr and daemon.stderr.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda page: page.name)
def test_every_runnable_block_does_what_its_page_says(
    page: Path, docs_daemon: Path, tmp_path: Path
) -> None:
    blocks = runnable_blocks(page)
    assert blocks, f"{page.name} has no runnable block"
    wrong = []
    for number, block in enumerate(blocks):
        workdir = tmp_path / str(number)
        workdir.mkdir()
        wrong += check_runnable(block, docs_daemon, workdir)
    assert wrong == []


def test_the_runnable_check_catches_a_wrong_output_and_a_hang_not_killed(
    docs_daemon: Path, tmp_path: Path
) -> None:
    page = tmp_path / "guide.md"
    page.write_text(
        "<!-- runnable -->\n\n```python\nprint(6 * 7)\n```\n\nIt prints:\n\n```text\n43\n```\n\n"
        "<!-- runnable: killed by SIGKILL -->\n\n```python\n"
        "import watchdogd_client as wd\n\nwith wd.expires(after=60):\n    pass\n```\n\n"
        "## No output shown\n\n```text\nx\n```\n"
    )
    wrong, hang = runnable_blocks(page)
    assert (wrong.output, hang.output, hang.ending) == ("43\n", None, "killed by SIGKILL")
    assert check_runnable(wrong, docs_daemon, tmp_path) == [
        "guide.md:3: printed '42\\n', not '43\\n'"
    ]
    complaint = check_runnable(hang, docs_daemon, tmp_path)
    assert len(complaint) == 1 and complaint[0].startswith("guide.md:15: exit 0, not -9")
