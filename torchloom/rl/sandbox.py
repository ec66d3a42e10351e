"""Run model-written Python in a guarded subprocess: the tool behind RL environments that let the
policy execute code (``torchloom.rl.tool_env.PythonToolEnv``).

``run_python(code)`` runs ``code`` in a fresh interpreter (``python -I -B``: no user site, no
``PYTHON*`` variables, no bytecode writes) whose working folder is a new temporary directory,
deleted afterwards, with an almost empty environment (``HOME`` and ``TMPDIR`` point at that
folder) and no stdin. What guards the run:

- **A private filesystem** (``torchloom.rl.isolation``): the child pivots into a mount
  namespace whose read-only root holds only its folder (the one writable place), the Python
  installation and shared libraries (read-only) and ``/dev/null``, ``/dev/zero``,
  ``/dev/urandom``; where Landlock exists, kernel rules also let it read only those paths and
  write only its folder. Either one keeps the user's files (``/etc/passwd``, keys, tokens, the
  home folder) from the code, and whatever it creates (files, FIFOs) stays in its folder,
  which is deleted. ``SandboxResult.filesystem_isolation`` says which worked; where neither
  does, the code does not run and ConfigError(``UNISOLATED``) says so, unless
  ``unsafe_sandbox=True``.
- **Limits** (kernel rlimits, set before the code runs and lowered for good): address space
  ``memory_mb`` (an allocation past it raises MemoryError in the child), CPU seconds just above
  the wall limit, 64 MiB per written file, no core dumps, 64 open files, and no new processes
  or threads for a non-root user (RLIMIT_NPROC 0; root is exempt from that one).
- **Wall time**: the child leads its own session; at ``timeout_s`` the whole process group is
  killed. Start-up (about 50 ms) counts.
- **Output**: stdout and stderr are read with a cap; once one outgrows ``max_output_chars``
  (plus a margin) the process group is killed and the text is cut, so a print loop costs
  neither time nor memory in the caller.
- **Network**: the child first moves itself into a new, empty network namespace (``unshare``:
  as root, or as any user where unprivileged user namespaces are enabled), a kernel boundary
  with only a loopback interface that is down. ``SandboxResult.network_isolated`` says whether
  that worked. Then it drops every capability and sets no-new-privileges.
- **An audit hook** (``sys.addaudithook``), installed before the code runs and impossible to
  remove, refuses with PermissionError: sockets and name lookups; subprocess, os.system, exec,
  fork, spawn and subinterpreters; ctypes and sqlite extensions; raising the limits; signals to
  other processes; links; and creating, writing, truncating, renaming, removing or changing the
  mode of anything outside the temporary folder (``/dev/null`` excepted). The interpreter leaves
  with ``os._exit``, so no user code runs after CPython clears its hooks at shutdown.

What this is not: a container. The hook sees only what CPython audits, and a deliberate attack
on the interpreter itself can get past it (then the kernel's boundaries above still hold, but
the code could start processes); the code can read the Python installation and system
libraries, and ``os.stat`` under Landlock alone still tells whether a path exists; the kernel
itself is shared. It keeps model-written code in RL from reading the user's files and from
doing damage by mistake or by reward hacking; run a large untrusted workload inside a
container or VM as well.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torchloom.config.errors import ConfigError
from torchloom.rl import isolation

_CODE_FILE = "main.py"
_FILE_LIMIT_BYTES = 64 * 2**20

# Runs in the child, compiled as "<sandbox>" by ``_LAUNCH``, after the source of
# ``torchloom.rl.isolation``, before the model's code: isolation, limits, audit hook, then the
# code from ``main.py`` as ``__main__``. Arguments: the folder, the code file, the status fd
# (three bytes: own network, own filesystem view, Landlock), the readable paths (one a line),
# whether to run without filesystem isolation, memory bytes, CPU seconds, file bytes.
_BOOTSTRAP = r'''

def _set_limits(memory_bytes, cpu_seconds, file_bytes):
    import resource

    limits = [
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),
        (resource.RLIMIT_FSIZE, file_bytes, file_bytes),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_NPROC, 0, 0),  # no fork or thread (root is exempt)
    ]
    for kind, soft, hard in limits:
        _, current_hard = resource.getrlimit(kind)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


def _install_guard(root):
    import _posixsubprocess, stat, types

    def inside(
        path, fd_ok, _root=root, _prefix=root + "/", _getcwd=os.getcwd, _type=type, _str=str,
        _bytes=bytes, _int=int,
    ):
        """Whether ``path`` names something in the folder, judged on its text: no links exist
        there, and a relative path may not climb (it may be relative to a dir_fd)."""
        kind = _type(path)
        if kind is _int:
            return fd_ok
        if kind is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif kind is not _str:  # a str subclass could lie about its text
            return False
        if path == "/dev/null":
            return True
        if not path.startswith("/"):
            depth = 0
            for part in path.split("/"):
                if part == "..":
                    depth -= 1
                    if depth < 0:
                        return False
                elif part not in ("", "."):
                    depth += 1
            path = _getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part not in ("", "."):
                parts.append(part)
        full = "/" + "/".join(parts)
        return full == _root or full.startswith(_prefix)

    def guard(
        event,
        args,
        _inside=inside,
        _type=type,
        _str=str,
        _error=PermissionError,
        _os_error=OSError,
        _stat=os.stat,
        _is_dir=stat.S_ISDIR,
        _pid=os.getpid(),
        _function=types.FunctionType,
        _climb=" (or up through '..' in a relative path)",
        _write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
        _path_events=frozenset(
            ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.chflags",
             "os.utime", "os.setxattr", "os.removexattr")
        ),
        _refused=(
            "socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty",
            "os.posix_spawn", "os.spawn", "pty.", "ctypes.", "cpython.PyInterpreterState_New",
            "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link", "gc.get_",
            "sqlite3.enable_load_extension", "sqlite3.load_extension",
        ),
    ):
        # Everything used here is a default argument (a tuple the hook itself keeps from being
        # replaced, with the code, on functions compiled from "<sandbox>") or a method of an
        # exact str, never a global or builtin the code could patch; and no user code runs here.
        if event == "open":
            path, mode, flags = args
            writes = flags & _write_flags or (
                _type(mode) is _str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
            )
            if writes and not _inside(path, True):
                raise _error(f"sandbox: writing outside the working folder{_climb}: {path!r}")
            if mode is None and not writes and not _inside(path, True):
                # A folder opened with os.open could anchor dir_fd-relative writes.
                try:
                    is_dir = _is_dir(_stat(path).st_mode)
                except _os_error:
                    is_dir = False
                if is_dir:
                    raise _error(f"sandbox: opening a folder outside the working folder: {path!r}")
        elif event in _path_events or event == "os.rename":
            for path in args[:2] if event == "os.rename" else args[:1]:
                if not _inside(path, False):
                    raise _error(f"sandbox: {event} outside the working folder{_climb}: {path!r}")
        elif event == "os.truncate":
            if not _inside(args[0], True):
                raise _error(f"sandbox: truncating outside the working folder{_climb}: {args[0]!r}")
        elif event == "sqlite3.connect":
            database = args[0]
            if database not in (":memory:", "") and (
                _type(database) is not _str or database.startswith("file:")
                or not _inside(database, False)
            ):
                raise _error(f"sandbox: a database outside the working folder: {database!r}")
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, _pid):
                raise _error("sandbox: signals to other processes are not allowed")
        elif event in ("object.__setattr__", "object.__delattr__"):
            target = args[0]
            if (
                _type(target) is _function
                and target.__code__.co_filename == "<sandbox>"
                and args[1] in ("__code__", "__defaults__", "__kwdefaults__")
            ):
                raise _error(f"sandbox: replacing the guard's {args[1]} is not allowed")
        elif event == "import":
            if args[0] == "_posixsubprocess":  # only on a re-import: it is loaded, stubbed, below
                raise _error("sandbox: starting processes is not allowed")
        elif event.startswith(_refused):
            raise _error(f"sandbox: {event} is not allowed")

    def refuse_fork_exec(*args, _error=PermissionError):
        raise _error("sandbox: starting processes is not allowed")

    # The one way to start a process that CPython 3.11 does not audit.
    _posixsubprocess.fork_exec = refuse_fork_exec
    sys.addaudithook(guard)


def _main(root, code_file, status_fd, readable, unsafe, memory_bytes, cpu_seconds, file_bytes):
    import linecache, traceback, types

    exit_ = os._exit
    network, view, landlock = isolate(root, readable.split("\n"))
    os.write(int(status_fd), bytes(b"01"[flag] for flag in (network, view, landlock)))
    os.close(int(status_fd))
    if not (view or landlock or unsafe == "1"):
        exit_(2)  # the parent says why
    with open(code_file, encoding="utf-8") as f:
        source = f.read()
    linecache.cache[code_file] = (len(source), None, source.splitlines(True), code_file)
    sys.stdout.reconfigure(line_buffering=True)  # lines printed before a kill still arrive
    _set_limits(int(memory_bytes), int(cpu_seconds), int(file_bytes))
    _install_guard(root)

    module = types.ModuleType("__main__")
    module.__file__ = code_file
    sys.modules["__main__"] = module
    sys.argv = [code_file]
    status = 1
    try:
        try:
            exec(compile(source, code_file, "exec"), module.__dict__)
            status = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                status = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException as error:
            module.__dict__.clear()  # drop what the code held (a memory bomb) before formatting
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # Leave without finalizing: CPython clears audit hooks before it destroys modules,
        # and a __del__ the code planted would then run unguarded.
        try:
            exit_(status)
        finally:
            exit_(1)


_main(*sys.argv[2:])
'''

_BOOTSTRAP = Path(isolation.__file__).read_text(encoding="utf-8") + _BOOTSTRAP
_LAUNCH = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
UNISOLATED = (
    "The Python sandbox cannot isolate the filesystem here (neither a mount namespace nor "
    "Landlock works), so model-written code could read your files; to run it anyway, set "
    "--rl.unsafe_sandbox true (unsafe_sandbox=True in Python)."
)


@dataclass
class SandboxResult:
    """What one ``run_python`` call saw."""

    stdout: str
    stderr: str
    exit_code: int
    """The child's exit status; negative: killed by that signal (a kill of ours included)."""
    timed_out: bool
    killed_reason: str | None
    """Why the sandbox killed the run: "timeout", "output_limit", or None."""
    truncated: bool
    """Whether stdout or stderr was cut to ``max_output_chars``."""
    wall_s: float
    network_isolated: bool
    """Whether the run had its own empty network namespace (the audit hook blocks sockets
    either way)."""
    filesystem_isolation: tuple[str, ...]
    """What kept the run's filesystem private: "mount namespace" (a view with only its folder,
    the Python installation and a few devices), "landlock" (kernel rules: read only those, write
    only the folder), both, or neither (only with ``unsafe_sandbox``)."""

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited with status 0."""
        return self.exit_code == 0 and self.killed_reason is None


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    unsafe_sandbox: bool = False,
) -> SandboxResult:
    """Run ``code`` as a script in a guarded subprocess (see the module docstring) and return
    its output, each stream cut to ``max_output_chars``. Where the child cannot make its
    filesystem private, the code does not run and ConfigError(``UNISOLATED``) is raised, unless
    ``unsafe_sandbox``."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_chars < 0:
        raise ValueError(
            f"run_python needs timeout_s > 0, memory_mb > 0 and max_output_chars >= 0; got "
            f"{timeout_s}, {memory_mb} and {max_output_chars}."
        )
    # The run's folder: "work" is the code's; the child mounts its private root on "view".
    base = os.path.realpath(tempfile.mkdtemp(prefix="torchloom-sandbox-"))
    root = os.path.join(base, "work")
    status_read, status_write = os.pipe()
    try:
        os.mkdir(root, 0o700)
        with open(os.path.join(root, _CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        limits = [memory_mb * 2**20, math.ceil(timeout_s) + 1, _FILE_LIMIT_BYTES]
        command = [sys.executable, "-I", "-B", "-c", _LAUNCH, _BOOTSTRAP, root, _CODE_FILE]
        readable = "\n".join(isolation.readable_paths())
        command += [str(status_write), readable, "01"[unsafe_sandbox], *map(str, limits)]
        start = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=root,
            env=_environment(root),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_write,),
            start_new_session=True,
        )
        os.close(status_write)
        status_write = -1
        outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
        reason: str | None = "interrupted"
        try:
            reason = _collect(process, outputs, start + timeout_s, 4 * max_output_chars + 64)
        finally:
            if reason is not None:  # still running, not yet reaped: its group id is its own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            exit_code = process.wait()
            process.stdout.close()
            process.stderr.close()
        wall_s = time.monotonic() - start
        network, view, landlock = (flag == ord("1") for flag in os.read(status_read, 3).ljust(3))
    finally:
        os.close(status_read)
        if status_write >= 0:
            os.close(status_write)
        _remove_tree(base)
    if not (view or landlock or unsafe_sandbox):
        raise ConfigError(UNISOLATED)
    stdout, stderr = (raw.decode("utf-8", "replace") for raw in outputs.values())
    truncated = reason == "output_limit" or max(len(stdout), len(stderr)) > max_output_chars
    return SandboxResult(
        stdout=stdout[:max_output_chars],
        stderr=stderr[:max_output_chars],
        exit_code=exit_code,
        timed_out=reason == "timeout",
        killed_reason=reason,
        truncated=truncated,
        wall_s=wall_s,
        network_isolated=network,
        filesystem_isolation=("mount namespace",) * view + ("landlock",) * landlock,
    )


@functools.cache
def probe_isolation() -> tuple[str, ...]:
    """What isolates a run's filesystem on this machine (empty: nothing does), from one run of
    an empty script; ``PythonToolEnv`` asks before its first run."""
    return run_python("", unsafe_sandbox=True).filesystem_isolation


def _environment(root: str) -> dict[str, str]:
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LC_ALL": "C.UTF-8", **threads}


def _collect(
    process: subprocess.Popen, outputs: dict[int, bytearray], deadline: float, max_bytes: int
) -> str | None:
    """Read the child's pipes into ``outputs`` until it exits; the reason to kill it instead
    ("timeout" or "output_limit"), if any. Never holds more than ``max_bytes`` per stream."""
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                output = outputs[key.fd]
                output += chunk
                if len(output) > max_bytes:
                    del output[max_bytes:]
                    return "output_limit"
    try:  # both pipes closed: the code may still be running
        process.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return "timeout"
    return None


def _remove_tree(root: str) -> None:
    """Delete the run's folder, also where the code took permissions away from its folders."""
    with contextlib.suppress(OSError):
        os.chmod(root, 0o700)
        for folder, subfolders, _ in os.walk(root):
            for name in subfolders:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)
