"""The README and docs/ a newcomer reads: short, every link resolves, every command it shows exists."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    text = page.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def _cli_commands() -> list[list[str]]:
    """Every `reinforce ...` / `train ...` invocation in the README's bash blocks (subcommand path only)."""
    commands = []
    for block in FENCE.findall((ROOT / "README.md").read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if not line:
                continue
            words = shlex.split(line)
            if words and words[0] in ("reinforce", "train"):
                sub = [w for w in words[1:3] if not w.startswith("-")][:2 if words[1:2] == ["experiment"] else 1]
                commands.append([words[0], *sub[:1]])
    return commands


def test_every_readme_command_exists():
    from typer.testing import CliRunner

    from cxrdr.cli import reinforce_app, train_app

    apps = {"reinforce": reinforce_app, "train": train_app}
    commands = _cli_commands()
    assert ["reinforce", "build"] in commands and ["train", "run"] in commands
    for tool, *sub in {tuple(c): c for c in commands}.values():
        result = CliRunner().invoke(apps[tool], [*sub, "--help"])
        assert result.exit_code == 0, f"`{tool} {' '.join(sub)} --help`: {result.output}"



def test_the_reinforce_command_is_stage_1s_own():
    """`reinforce` starts in stage 1's CLI: through the composition root (cxrdr/cli.py) it imported the training
    side and the experiments first (~4 s of a 2-core box). What that module imports: tests/test_architecture.py."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"reinforce": "cxrdr.reinforce.cli:main", "train": "cxrdr.cli:train_main"}
