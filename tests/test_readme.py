"""The README and the usage page say only what exists: every `tidal ...` command in their shell blocks
parses with the CLI's own parser, every script and make target they run is there, and every link to a
file of the repository (and its #anchor) resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tidal.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/usage.md")


def shell_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for title in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_command_exists(page):
    lines = shell_lines((REPO / page).read_text())
    assert len(lines) >= 10
    makefile = (REPO / "Makefile").read_text()
    parser = build_parser()
    checked = 0
    for line in lines:
        argv = shlex.split(line)
        if argv[0].endswith("bin/tidal") or argv[0] == "tidal":
            try:
                parser.parse_args(argv[1:])
            except SystemExit as e:
                pytest.fail(f"{page}: `{line}` does not parse (exit {e.code})")
            checked += 1
        elif argv[0] in ("python", ".venv/bin/python"):
            assert (REPO / argv[1]).is_file(), f"{page}: {argv[1]} is not in the repository"
        elif argv[0] == "make":
            assert re.search(rf"^{argv[1]}:", makefile, flags=re.M), f"{page}: no make target {argv[1]}"
    assert checked >= 10


@pytest.mark.parametrize("page", (*PAGES, "docs/ARCHITECTURE.md", "docs/performance.md"))
def test_every_link_resolves(page):
    path = REPO / page
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(dest.read_text()), f"{page}: link to {target}: no such heading"


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = shell_lines(text)[:2]
    assert first == ["make serve", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_files_the_readme_names_exist():
    text = (REPO / "README.md").read_text()
    paths = set(re.findall(r"`([A-Za-z_][\w./-]*/[\w.-]+\.(?:py|json|yml|md|cpp|h))`", text))
    assert "deploy/grafana/tidal.json" in paths
    for p in paths:
        assert (REPO / p).exists(), f"README.md names {p}, which is not in the repository"
