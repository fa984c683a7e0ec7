"""Every code block of README.md and docs/ runs, so the documentation cannot drift from the code.

A ```python block runs in a fresh interpreter, a ```bash / ```sh / ```console block in bash (a
console block's commands are its lines that begin with `$ `), each in an empty directory, with
the on-disk graph cache in a directory of the test session. An HTML comment on the line right
before a block says how it runs:

    <!-- not run: WHY -->          not run (a GPU, 8 ranks, a 200-step training, the CI itself)
    <!-- run: slow -->             run among the slow tests only
    <!-- run: slow, 2 ranks -->    a python block run as a script on 2 gloo ranks under torchrun

Any other fenced block must be plain text (no language, or `text`), so that no code hides from
the test behind a spelling it does not run.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python", "bash", "sh", "console"}
PLAIN = {"", "text"}
MARK = re.compile(r"<!--\s*(not run|run):\s*(.*?)\s*-->")
SECONDS = {"fast": 240, "slow": 600}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # the opening fence's line, counted from 1
    language: str
    code: str
    mark: str | None   # "not run" or "run", from the comment right before the fence
    how: str           # the comment's text after the colon

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:L{self.line}"

    @property
    def ranks(self) -> int:
        found = re.search(r"(\d+) ranks", self.how) if self.mark == "run" else None
        return int(found.group(1)) if found else 1

    @property
    def slow(self) -> bool:
        return self.mark == "run" and re.search(r"\bslow\b", self.how) is not None


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, indent = i, len(fence.group(1))
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        mark = MARK.fullmatch(before.strip())
        code = "\n".join(line[indent:] for line in lines[start + 1:i]) + "\n"
        found.append(Block(page, start + 1, fence.group(2), code, mark and mark.group(1),
                           mark.group(2) if mark else ""))
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
CODE = [b for b in ALL if b.language in RUN]
RUNS = [b for b in CODE if b.mark != "not run"]


def test_every_block_is_plain_text_or_a_language_the_test_runs():
    odd = [f"{b.id} ```{b.language}" for b in ALL if b.language not in RUN | PLAIN]
    assert not odd, f"blocks in a language tests/test_docs.py does not run: {odd}; use python, bash or text"


def test_every_block_not_run_says_why_and_marks_are_spelled_as_the_test_reads_them():
    for b in ALL:
        if b.mark == "not run":
            assert len(b.how) >= 10, f"{b.id}: say why the block is not run: <!-- not run: WHY -->"
        if b.mark == "run":
            assert re.fullmatch(r"slow(, \d+ ranks)?", b.how), f"{b.id}: <!-- run: slow --> or <!-- run: slow, N ranks -->"
        if b.ranks > 1:
            assert b.language == "python", f"{b.id}: only a python block runs on ranks"


def test_the_readme_gives_the_command_the_ci_runs():
    """The README's test command is what .ci/run runs: the same commands in the same order, and the
    same pytest command line."""
    ci = (ROOT / ".ci/run").read_text()
    readme = [b.code.strip() for b in blocks(ROOT / "README.md") if b.language == "bash" and "pytest" in b.code]
    assert len(readme) == 1, "the README has one test command"
    commands = readme[0].split(" && ")
    position = 0
    for command in commands:  # each in .ci/run, after the one before it
        found = ci.find(command, position)
        assert found >= 0, f"the README's test command runs {command!r}, which .ci/run does not (after {ci[:position][-80:]!r})"
        position = found + len(command)
    pytest_line = re.search(r"^[^#\n]*?(python -m pytest[^|;&\n]*)", ci, re.M)
    assert pytest_line and pytest_line.group(1).strip() == commands[-1], \
        f".ci/run runs {pytest_line and pytest_line.group(1).strip()!r}, the README {commands[-1]!r}"


def test_docs_pages_are_linked_from_the_readme_or_another_page():
    text = "\n".join(page.read_text() for page in PAGES)
    for page in PAGES[1:]:
        assert page.name in text.replace(page.read_text(), ""), f"{page.relative_to(ROOT)} is linked from nowhere"


def shell_script(block: Block) -> str:
    if block.language == "console":
        commands = [line[2:] for line in block.code.splitlines() if line.startswith("$ ")]
        return "\n".join(commands) + "\n"
    return block.code


def command(block: Block, directory: Path) -> list[str]:
    if block.language != "python":
        return ["bash", "-euo", "pipefail", "-c", shell_script(block)]
    script = directory / "block.py"
    script.write_text(block.code)
    if block.ranks > 1:
        return [str(Path(sys.executable).parent / "torchrun"), f"--nproc-per-node={block.ranks}", str(script)]
    return [sys.executable, str(script)]


@pytest.fixture(scope="session")
def cache_directory(tmp_path_factory) -> Path:
    """One graph cache for the session's blocks: fuse's traced patterns are traced once."""
    return tmp_path_factory.mktemp("picofx-cache")


def run_block(block: Block, directory: Path, cache: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PICOFX_CACHE"}  # the cache as a user has it
    # PET_STANDALONE: every torchrun of a block picks a free port for its rendezvous
    env.update(PICOFX_CACHE_DIR=str(cache), PET_STANDALONE="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    seconds = SECONDS["slow" if block.slow else "fast"]
    process = subprocess.Popen(command(block, directory), cwd=directory, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the block's process group: torchrun and its ranks
        stdout, stderr = process.communicate()
        pytest.fail(f"{block.id} ran past {seconds} s:\n{block.code}\n--- stderr ---\n{stderr[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"{block.id} failed (exit status {process.returncode}):\n{block.code}\n"
                    f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-6000:]}")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
                                   for b in RUNS])
def test_block_runs(block: Block, tmp_path: Path, cache_directory: Path):
    run_block(block, tmp_path, cache_directory)


def test_a_block_that_fails_fails_its_test(tmp_path, cache_directory):
    """The runner reports a failing block (so a passing test means the block ran clean)."""
    for language, code in (("python", "import picofx\nraise SystemExit(3)\n"), ("bash", "true\nfalse\ntrue\n"),
                           ("console", "$ true\nsome output\n$ exit 4\n")):
        broken = Block(ROOT / "README.md", 1, language, code, None, "")
        with pytest.raises(pytest.fail.Exception, match="failed"):
            run_block(broken, tmp_path, cache_directory)


def test_the_parser_finds_marks_and_indented_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not run: needs 4 ranks under torchrun -->\n```bash\ntorchrun x\n```\n"
                    "- item\n  ```python\n  print(1)\n  ```\n<!-- run: slow, 2 ranks -->\n```python\npass\n```\n")
    found = blocks(page)
    assert [(b.line, b.language, b.mark, b.ranks, b.slow) for b in found] == [
        (4, "bash", "not run", 1, False), (8, "python", None, 1, False), (12, "python", "run", 2, True)]
    assert found[1].code == "print(1)\n" and shlex.split(found[0].code) == ["torchrun", "x"]
