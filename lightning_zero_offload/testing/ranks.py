"""The one rank launcher of the tests and benchmarks, and of users testing their own code at several ranks.

Three ways to start ranks, one process manager under them (``run_processes``):

- ``run_ranks(fn, world, tmp)``: ``fn(rank)`` (a top-level function) in ``world`` fresh interpreters
  sharing a gloo (or NCCL) process group; returns each rank's result.
- ``run_script_ranks(command, world)``: one process per rank of a script, started as torchrun or SLURM
  would (``LOCAL_RANK``, ``MASTER_PORT``, ...); returns each rank's exit code, output and exit time.
- ``launch(command)``: one process that starts its own ranks (Lightning's launcher with ``devices=N``).

Every process runs in its own session, so a timeout kills what it started too (Lightning's rank 1, a
benchmark's variants); every exit code is checked; a failure says which rank, why, and the tail of its
output. Imports nothing but the standard library at module level (torch only where ``run_ranks`` needs
it), so a rank imports Lightning only when its own code does.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# What an in-process Trainer or a parent launcher leaves in os.environ: with LOCAL_RANK set, Lightning takes
# a fresh process for an externally launched rank and waits for peers that never come.
LAUNCH_VARIABLES = {"LOCAL_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"}
TAIL = 3000  # characters of a failed process's output in the error
GRACE_S = 2.0  # how long the other ranks of a failed fn-rank run may take to leave before they are killed
PORT_RETRIES = 3  # another process may take a free port between free_port() and the rendezvous binding it


class LaunchError(AssertionError):
    """A launched process failed, hung past its timeout, or sent no result (an AssertionError: tests
    report it as a failed check)."""


@dataclass
class Exit:
    """One process's end: ``returncode`` None when the launcher killed it (``killed`` says why);
    ``exited`` is ``time.time()`` when it was seen gone (comparable with stamps the process printed)."""

    returncode: int | None
    output: str
    exited: float | None
    killed: str = ""


def clean_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("MASTER_")}
    env.update(extra)
    return env


def free_port() -> int:
    """A port that was free just now; closed again before it is handed on, so the rendezvous can bind it
    (callers retry if another process took it in between: see ``PORT_RETRIES``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(exits: list[Exit], names: list[str] | None = None) -> str:
    """Every process that failed: its name, exit code or hang, and the tail of its output."""
    lines = []
    for index, done in enumerate(exits):
        if done.returncode == 0:
            continue
        name = names[index] if names else f"rank {index}"
        why = f"exit code {done.returncode}" if done.returncode is not None else done.killed
        lines.append(f"{name}: {why}; output:\n{done.output[-TAIL:]}")
    return "\n-----\n".join(lines)


def run_processes(
    commands: list[list[str]],
    envs: list[dict[str, str]],
    timeout: float,
    cwd: str | Path | None = None,
    grace_after_failure: float | None = None,
) -> list[Exit]:
    """Start every command at once (stdout and stderr together, to a file), wait for all of them, and kill
    every session still running at ``timeout`` or, with ``grace_after_failure``, that long after the first
    process failed (its peers may wait for it in a collective forever)."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile("w+b")) for _ in commands]
        procs = [
            subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: a kill reaches what it started too
            )
            for command, env, log in zip(commands, envs, files)
        ]
        exited: list[float | None] = [None] * len(procs)
        deadline = time.monotonic() + timeout
        killed = f"still running after {timeout:.0f} s (a hang): killed"
        while None in exited and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if exited[i] is None and proc.poll() is not None:
                    exited[i] = time.time()
                    if proc.returncode != 0 and grace_after_failure is not None:
                        killed = f"still running {grace_after_failure:.0f} s after another process failed: killed"
                        deadline = min(deadline, time.monotonic() + grace_after_failure)
            time.sleep(0.05)
        for proc in procs:
            with_group_killed(proc)
        outputs = []
        for log in files:
            log.seek(0)
            outputs.append(log.read().decode(errors="replace"))
    return [
        Exit(proc.returncode, out, t) if t is not None else Exit(None, out, None, killed)
        for proc, out, t in zip(procs, outputs, exited)
    ]


def with_group_killed(proc: subprocess.Popen) -> None:
    """Kill whatever is left of ``proc``'s session (itself if still running, and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the session is gone, all of it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(
    command: list[str], timeout: float = 300, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> str:
    """Run one process that starts its own ranks (Lightning's launcher), in a clean environment with a
    ``MASTER_PORT`` of its own; returns its output, or raises ``LaunchError`` with its tail."""
    for attempt in range(PORT_RETRIES):
        (done,) = run_processes([command], [{**(env or clean_env()), "MASTER_PORT": str(free_port())}], timeout, cwd)
        if done.returncode == 0:
            return done.output
        if not port_taken(done.output) or attempt == PORT_RETRIES - 1:
            raise LaunchError(f"{' '.join(map(str, command))}\n" + describe([done], ["the launch"]))
    raise AssertionError("unreachable")


def port_taken(output: str) -> bool:
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def run_script_ranks(command: list[str], world: int, timeout: float = 240) -> list[Exit]:
    """Every rank of ``command`` as its own process, as torchrun would start them (rank, world size and
    rendezvous in the environment); each rank's ``Exit``. Failed ranks are for the caller to judge; a
    rank still running at ``timeout`` (a hang) raises ``LaunchError``."""
    for attempt in range(PORT_RETRIES):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), NODE_RANK="0")
        envs = [{**env, "LOCAL_RANK": str(rank)} for rank in range(world)]
        exits = run_processes([command] * world, envs, timeout)
        if any(done.returncode is None for done in exits):
            raise LaunchError(describe(exits))
        if attempt == PORT_RETRIES - 1 or not any(done.returncode != 0 and port_taken(done.output) for done in exits):
            return exits
    raise AssertionError("unreachable")


def run_ranks(
    fn, world: int, tmp_path: str | Path, timeout: float = 120.0, backend: str = "gloo", preload: tuple[str, ...] = ()
) -> list:
    """Run ``fn(rank)`` (a top-level function or a partial of one, picklable by reference) in ``world``
    processes sharing a process group (``backend``; NCCL: one GPU per rank); their results
    (``torch.save``-able) by rank. ``preload``: modules to import before the group exists, where ``fn``'s
    own module does not import Lightning (see ``_rank_main``).

    Raises ``LaunchError`` with every failed rank's output tail if a rank raises, exits with a non-zero code
    (a crash, an abort at exit), leaves no result, or is still running at ``timeout``.
    """
    tmp = Path(tmp_path)
    main = sys.modules["__main__"]
    job = {
        "sys_path": sys.path,
        "main": getattr(main, "__file__", None) if getattr(fn, "func", fn).__module__ == "__main__" else None,
        "fn": pickle.dumps(fn),
        "world": world,
        "init": f"file://{tmp / 'rendezvous'}",
        "backend": backend,
        "results": str(tmp),
        "preload": preload,
    }
    (tmp / "job.pkl").write_bytes(pickle.dumps(job))
    commands = [
        [sys.executable, str(Path(__file__).resolve()), str(tmp / "job.pkl"), str(rank)] for rank in range(world)
    ]
    exits = run_processes(commands, [clean_env()] * world, timeout, cwd=os.getcwd(), grace_after_failure=GRACE_S)
    results = [tmp / f"rank{rank}.pt" for rank in range(world)]
    for done, result in zip(exits, results):
        if done.returncode == 0 and not result.exists():
            done.returncode, done.output = -1, f"exited 0 without a result\n{done.output}"
    if any(done.returncode != 0 for done in exits):
        raise LaunchError(describe(exits))
    import torch

    return [torch.load(result, weights_only=True) for result in results]


def _rank_main(job_path: str, rank: int) -> None:
    """One rank of ``run_ranks``: the group, ``fn(rank)``, its result saved; a raise exits non-zero with
    the traceback on stderr (Python's default)."""
    import gc
    import importlib
    import importlib.util

    with open(job_path, "rb") as f:
        job = pickle.load(f)
    sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
    if job["main"]:  # fn lives in a script run as __main__: import it under another name (as spawn does)
        spec = importlib.util.spec_from_file_location("__mp_main__", job["main"])
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = sys.modules["__main__"] = module
        spec.loader.exec_module(module)
    # Lightning imported after the group exists keeps references to it (lightning_fabric), so it is destroyed
    # during interpreter finalization: an abort at exit. Unpickling imports fn's module, and with it Lightning
    # (through this package) where that module imports it; preload covers the others.
    for module in job["preload"]:
        importlib.import_module(module)
    fn = pickle.loads(job["fn"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if job["backend"] == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(job["backend"], init_method=job["init"], rank=rank, world_size=job["world"])
    try:
        result = fn(rank)
        torch.save(result, Path(job["results"]) / f"rank{rank}.pt")
    finally:
        gc.collect()  # engines in reference cycles go now, not during interpreter exit after the group
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
