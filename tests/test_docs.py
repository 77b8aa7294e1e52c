"""Every code block in README.md and docs/ is exercised, so the docs cannot rot.

- ``python`` blocks run in a fresh interpreter (in a scratch directory);
- ``yaml`` blocks are validated by the CLI's ``--print_config`` (types and class paths checked);
- ``bash`` lines: ``make`` targets must exist, ``zero-offload``/``torchrun``/``srun`` training commands
  are validated with ``--print_config``, scripts and the converter must answer ``--help``,
  ``zero-offload-plan`` lines run.
Blocks without a language (diagrams, directory trees) are prose.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CLI = [sys.executable, "-m", "lightning_zero_offload"]


def blocks(lang: str) -> list:
    found = []
    for doc in DOCS:
        for i, match in enumerate(BLOCK.finditer(doc.read_text())):
            if match.group(1) == lang:
                found.append(pytest.param(match.group(2), id=f"{doc.name}#{i}"))
    return found


def run(args: list[str], cwd: Path, timeout: int = 300) -> None:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_docs_have_code_blocks():
    assert len(blocks("python")) >= 5 and len(blocks("bash")) >= 4 and len(blocks("yaml")) >= 2


@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs(code, tmp_path):
    run([sys.executable, "-c", code], cwd=tmp_path)


@pytest.mark.parametrize("code", blocks("yaml"))
def test_yaml_block_is_a_valid_config(code, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(code)
    run([*CLI, "fit", "--config", str(config), "--print_config"], cwd=tmp_path)


def bash_command(tokens: list[str], cwd: Path) -> None:
    command = tokens[0]
    if command == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert tokens[1] in targets, f"no make target {tokens[1]}"
    elif command == "zero-offload":
        steps = tokens[tokens.index("--trainer.max_steps") + 1] if "--trainer.max_steps" in tokens else None
        if steps is not None and int(steps) <= 10:
            run([*CLI, *tokens[1:]], cwd=cwd)  # short enough to train for real: the command must work, not parse
        else:
            run([*CLI, *tokens[1:], "--print_config"], cwd=ROOT)
    elif command == "zero-offload-plan":  # runs for real (presets, or about a second of probes)
        run([sys.executable, "-m", "lightning_zero_offload.planner", *tokens[1:]], cwd=ROOT)
    elif command == "pip":  # an install of this checkout (running it would reinstall the package under test)
        assert tokens[1] == "install" and (ROOT / tokens[-1] / "pyproject.toml").is_file(), tokens
    elif command == "zero-offload-convert":
        run([str(Path(sys.executable).with_name(command)), "--help"], cwd=cwd)
    elif command == "python":
        assert (ROOT / tokens[1]).is_file(), tokens[1]
        run([sys.executable, tokens[1], "--help"], cwd=ROOT)
    elif command == "torchrun":
        module = tokens.index("-m")
        run([sys.executable, *tokens[module:], "--print_config"], cwd=ROOT)
    elif command == "srun":
        bash_command(tokens[tokens.index("zero-offload") :], cwd)
    else:
        raise AssertionError(f"the docs use a command this test does not know how to check: {tokens}")


@pytest.mark.parametrize("code", blocks("bash"))
def test_bash_block_commands_are_valid(code, tmp_path):
    for line in code.splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            bash_command(tokens, tmp_path)


def test_configuration_reference_lists_every_strategy_option():
    import inspect

    from lightning_zero_offload import ZeroOffloadStrategy

    reference = (ROOT / "docs" / "configuration.md").read_text()
    for name in inspect.signature(ZeroOffloadStrategy.__init__).parameters:
        if name != "self":
            assert f"`{name}`" in reference, f"docs/configuration.md does not document {name}"
