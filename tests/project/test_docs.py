"""Every code block in README.md and docs/ is exercised, so the docs cannot rot.

- ``python`` blocks run as ``python -c`` would (in a scratch directory);
- ``yaml`` blocks are validated by the CLI's ``--print_config`` (types and class paths checked);
- ``bash`` lines: ``make`` targets must exist, ``zero-offload``/``torchrun``/``srun`` training commands
  are validated with ``--print_config``, scripts and the converter must answer ``--help``,
  ``zero-offload-plan`` lines run.
Blocks without a language (diagrams, directory trees) are prose.

Each block or command runs in a process of its own, forked from one interpreter that has imported torch
and Lightning and nothing else (importing Lightning costs more than most blocks): the fork sees a fresh
``__main__``, its own directory, ``sys.argv`` and ``sys.path[0]`` as the command would set them, and
has to import this package itself, as a reader's script does.
"""

import json
import re
import shlex
import subprocess
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lightning_zero_offload.testing.ranks import clean_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CLI = ["-m", "lightning_zero_offload"]

# The forking interpreter: one job per line on stdin ({"argv", "cwd", "log", "timeout"}, argv as after
# ``python``), one exit status per line on stdout (null: killed at the timeout).
SERVER = r"""
import json, os, runpy, signal, sys, time, traceback, types
from importlib import import_module

import lightning, torch  # noqa: F401  (inherited by every fork)


def run(argv, cwd, log):
    os.setsid()  # a timeout kills what the command started too
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(cwd)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.path[0] = cwd
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif ":" in argv[0]:  # a console script: module:function
            module, function = argv[0].split(":")
            sys.argv = [function, *argv[1:]]
            sys.exit(getattr(import_module(module), function)())
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        run(job["argv"], job["cwd"], job["log"])
    deadline = time.monotonic() + job["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0]:
        status = os.waitstatus_to_exitcode(done[1])
    else:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = None
    print(json.dumps(status), flush=True)
"""


class Python:
    """``python ARGV`` in ``cwd``, forked from the preloaded interpreter."""

    def __init__(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=ROOT, env=clean_env(),
        )  # fmt: skip

    def __call__(self, argv: list[str], cwd: Path, timeout: int = 300) -> None:
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            job = {"argv": argv, "cwd": str(cwd), "log": log.name, "timeout": timeout}
            self.server.stdin.write(json.dumps(job) + "\n")
            self.server.stdin.flush()
            answer = self.server.stdout.readline()
            output = log.read()
        assert answer, f"the forking interpreter died (exit code {self.server.poll()}) running {argv}"
        status = json.loads(answer)
        why = f"killed after {timeout} s" if status is None else f"exit code {status}"
        assert status == 0, f"python {shlex.join(argv)} in {cwd}: {why}\n{output[-4000:]}"

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def python():
    forks = Python()
    yield forks
    forks.close()


def blocks(lang: str) -> list:
    found = []
    for doc in DOCS:
        for i, match in enumerate(BLOCK.finditer(doc.read_text())):
            if match.group(1) == lang:
                found.append(pytest.param(match.group(2), id=f"{doc.name}#{i}"))
    return found


def test_docs_have_code_blocks():
    assert len(blocks("python")) >= 5 and len(blocks("bash")) >= 4 and len(blocks("yaml")) >= 2


@pytest.mark.slow  # one process per block
@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs(code, tmp_path, python):
    python(["-c", code], cwd=tmp_path)


@pytest.mark.slow  # one process per block
@pytest.mark.parametrize("code", blocks("yaml"))
def test_yaml_block_is_a_valid_config(code, tmp_path, python):
    config = tmp_path / "config.yaml"
    config.write_text(code)
    python([*CLI, "fit", "--config", str(config), "--print_config"], cwd=tmp_path)


def console_script(name: str) -> str:
    (entry,) = entry_points(group="console_scripts", name=name)
    return entry.value


def bash_command(tokens: list[str], cwd: Path, python: Python) -> None:
    command = tokens[0]
    if command == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert tokens[1] in targets, f"no make target {tokens[1]}"
    elif command == "zero-offload":
        steps = tokens[tokens.index("--trainer.max_steps") + 1] if "--trainer.max_steps" in tokens else None
        if steps is not None and int(steps) <= 10:
            python([*CLI, *tokens[1:]], cwd=cwd)  # short enough to train for real: the command must work, not parse
        else:
            python([*CLI, *tokens[1:], "--print_config"], cwd=ROOT)
    elif command == "zero-offload-plan":  # runs for real (presets, or the short probes)
        python(["-m", "lightning_zero_offload.planner", *tokens[1:]], cwd=ROOT)
    elif command == "pip":  # an install of this checkout (running it would reinstall the package under test)
        assert tokens[1] == "install" and (ROOT / tokens[-1] / "pyproject.toml").is_file(), tokens
    elif command == "zero-offload-convert":
        python([console_script(command), "--help"], cwd=cwd)
    elif command == "python":
        assert (ROOT / tokens[1]).is_file(), tokens[1]
        python([tokens[1], "--help"], cwd=ROOT)
    elif command == "torchrun":
        module = tokens.index("-m")
        python([*tokens[module:], "--print_config"], cwd=ROOT)
    elif command == "srun":
        bash_command(tokens[tokens.index("zero-offload") :], cwd, python)
    else:
        raise AssertionError(f"the docs use a command this test does not know how to check: {tokens}")


@pytest.mark.slow  # one process per command
@pytest.mark.parametrize("code", blocks("bash"))
def test_bash_block_commands_are_valid(code, tmp_path, python):
    for line in code.splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            bash_command(tokens, tmp_path, python)


def test_configuration_reference_lists_every_strategy_option():
    import inspect

    from lightning_zero_offload import ZeroOffloadStrategy

    reference = (ROOT / "docs" / "configuration.md").read_text()
    for name in inspect.signature(ZeroOffloadStrategy.__init__).parameters:
        if name != "self":
            assert f"`{name}`" in reference, f"docs/configuration.md does not document {name}"
