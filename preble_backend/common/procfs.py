"""What ``/proc`` says about processes: whether one runs, a server's process tree and
process group (the launcher, the router's engine monitor and the burst tool ask), a
process's role in the stack and CPU time (the bench tools), pinning this process to
cores (a CPU engine), a child's death with its parent, and who holds a port."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _all() -> dict[int, tuple[str, int, int]]:
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            stats[int(entry.name)] = stat
    return stats


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def group_running(pgid: int) -> bool:
    """Whether a process of the group still runs."""
    return any(state not in ("Z", "X") and group == pgid for state, _, group in _all().values())


def children(pid: int, name_prefix: str = "") -> list[int]:
    """The running children of ``pid`` whose command name starts with ``name_prefix``."""
    found = []
    for child, (state, ppid, _) in _all().items():
        if ppid == pid and state not in ("Z", "X") and command_name(child).startswith(name_prefix):
            found.append(child)
    return found


def command_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (15 characters at most), or "" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def command_line(pid: int) -> list[bytes]:
    """The process's arguments, or [] once it is gone (a listed child may exit before its
    arguments are read)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return argv.split(b"\0") if argv else []


def process_role(pid: int) -> str | None:
    """``tritonserver``, ``stub:<model>`` for a Python-backend model's stub (its second
    argument is the model's ``model.py``, whose directory names the model), another
    program's name, or None once the process is gone."""
    argv = command_line(pid)
    if not argv or not argv[0]:
        return None
    name = Path(argv[0].decode()).name
    if name == "triton_python_backend_stub" and len(argv) > 1:
        return f"stub:{Path(argv[1].decode()).parent.parent.name}"
    return name


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` so far, its threads included; None once gone."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in _all().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pin_process(cores: list[int]) -> None:
    """Run every thread of this process, and those it starts later, on ``cores`` only.
    (``sched_setaffinity`` moves one thread; a Triton stub has several by the time a model
    initializes.)"""
    import os

    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def terminate(process, timeout: float) -> None:
    """SIGTERM a ``Popen`` child, then SIGKILL it if it has not exited after ``timeout``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def die_with_parent() -> None:
    """In a child between fork and exec (``Popen(preexec_fn=...)``): SIGKILL this process
    when the process that started it dies, however it dies (SIGKILL, an OOM kill), so no
    server of the stack outlives its supervisor. Linux ties this to the forking thread:
    start children from a thread that lives as long as they should."""
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def port_holder(port: int) -> str | None:
    """Which process listens on TCP ``port`` ("tritonserver (pid 123)"), where this user
    can see it; None if none is seen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in _all():
        try:
            if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return f"{command_name(pid)} (pid {pid})"
        except OSError:
            continue
    return None
