"""tools/gpu_session.sh, the one script a lent GPU runs: every step's command is one its tool
accepts, and the steps' time limits add up to a run that fits the card's 8 minutes."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "tools" / "gpu_session.sh"
sys.path.insert(0, str(ROOT / "tools"))


def steps() -> list[tuple[str, int, list[str]]]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.startswith("step "):
            name, limit, python, *argv = shlex.split(line)[1:]
            assert python == "$PY", line
            found.append((name, int(limit), [a.replace("$OUT", "/tmp/out") for a in argv]))
    return found


def test_the_script_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_every_step_fits_the_card_time_and_names_options_its_tool_has():
    found = steps()
    assert {name for name, _, _ in found} == {"gpu_1b", "gpu_8b", "float8", "breakdown"}
    assert sum(limit for _, limit, _ in found) <= 8 * 60
    pytest.importorskip("transformers")
    import bench_float8
    import bench_gpu
    from picofx.cli.train_parser import build_parser

    parsers = {"tools/bench_gpu.py": bench_gpu.parse_args, "tools/bench_float8.py": bench_float8.parse_args,
               "-m": lambda argv: build_parser("").parse_args(argv[3:])}  # -m picofx train ...
    for name, _, argv in found:
        parse = parsers[argv[0]]
        parsed = parse(argv if argv[0] == "-m" else argv[1:])
        if argv[0] == "tools/bench_gpu.py":
            assert parsed.device == "cuda" and re.fullmatch(r"/tmp/out/\w+\.json", parsed.json), name
