"""The kernel side of the Python sandbox (``torchloom.rl.sandbox``): ``isolate`` cuts the child
off from the network and the filesystem before the model's code runs.

The sandbox's bootstrap carries this file's source and runs ``isolate`` in the child, which is
still single-threaded and has not run any model code yet. Each mechanism is used where the
kernel allows it, and the child reports which ones worked:

- **Mount namespace** (in a new user namespace, or directly as root): the child pivots into a
  read-only tmpfs root that holds only its work folder (writable), the Python installation and
  the shared libraries (read-only binds) and ``/dev/null``, ``/dev/zero`` and ``/dev/urandom``.
  The real root is detached: no other path exists for the code.
- **Landlock** (Linux 5.13+): rules allow reading only beneath those same paths and writing
  only beneath the work folder; from ABI 4 TCP is refused, from ABI 6 signals and abstract
  unix sockets outside the child too.
- **Network namespace**: a new one has only a loopback interface, and it is down.

Then the child drops every capability and sets no-new-privileges, so nothing it execs could
gain them back. ``readable_paths`` (run in the parent) lists what the child may read.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

_NEW_NET, _NEW_NS, _NEW_USER = 0x40000000, 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # syscall numbers
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_READ = 1 | 4 | 8  # execute, read file, read dir
_LANDLOCK_FILE = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # rights a rule on a file may carry
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


def readable_paths() -> list[str]:
    """What a sandboxed run reads beside its folder: the interpreter's installation (prefix,
    base prefix: the standard library and site-packages) and the shared libraries it loads."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths.append(os.path.dirname(os.path.realpath(sys.executable)))
    paths += ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache"]
    return [path for path in dict.fromkeys(paths) if os.path.exists(path)]


def isolate(root: str, readable: list[str]) -> tuple[bool, bool, bool]:
    """Isolate this process (see the module docstring); whether it got its own network, its own
    filesystem view (mount namespace) and Landlock rules. ``root``: the work folder."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    network = view = False
    for flags in (_NEW_USER | _NEW_NS | _NEW_NET, _NEW_NS | _NEW_NET):
        if libc.unshare(flags) == 0:
            network = True
            try:
                if flags & _NEW_USER:
                    _map_ids(uid, gid)
                _private_view(libc, root, readable)
                view = True
            except OSError:
                pass  # Landlock may still work; the caller decides whether that is enough
            break
    os.chdir(root)  # the same path in the new view, or in the old one after a failure
    if not network:
        network = libc.unshare(_NEW_NET) == 0 or libc.unshare(_NEW_USER | _NEW_NET) == 0
    _drop_privileges(libc)
    return network, view, _landlock(libc, root, readable)


def _map_ids(uid: int, gid: int) -> None:
    """Keep our own user and group ids inside the new user namespace (no others exist there)."""
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"),
                       ("gid_map", f"{gid} {gid} 1")):  # fmt: skip
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _private_view(libc: ctypes.CDLL, root: str, readable: list[str]) -> None:
    """Pivot into a read-only tmpfs holding only ``readable`` (read-only), the devices and
    ``root`` (writable), each at its own path; detach the old root. Raises OSError."""

    def mount(
        source: str | None, target: str, kind: str | None, flags: int, data: str = ""
    ) -> None:
        encoded = [None if s is None else s.encode() for s in (source, target, kind, data)]
        if libc.mount(*encoded[:3], flags, encoded[3]) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target}")

    mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount reaches the parent
    new_root = os.path.dirname(root) + "/view"  # the parent's folder for this run
    os.mkdir(new_root, 0o700)
    mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    targets = sorted({(alias, os.path.realpath(path)) for path in readable
                      for alias in (path, os.path.realpath(path))})  # fmt: skip
    bound: list[str] = []
    for target, source in targets:
        if any(target.startswith(outer + "/") for outer in bound):
            continue  # already visible through the folder above it
        _bind(mount, source, new_root + target, read_only=True)
        bound.append(target)
    for device in _DEVICES:
        _bind(mount, device, new_root + device, read_only=False)
    _bind(mount, root, new_root + root, read_only=False)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(new_root)
    if libc.syscall(number, b".", b".") != 0:  # the old root now lies on top of the new one
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount the old root")
    mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _bind(mount: Callable[..., None], source: str, target: str, *, read_only: bool) -> None:
    """Show ``source`` at ``target`` (a new folder or file in the tmpfs root)."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    mount(source, target, None, _MS_BIND | _MS_REC)
    if read_only:
        # A bind remount in a user namespace must keep the flags the source mount locks.
        st = os.statvfs(target).f_flag
        kept = [(os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
                (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME),
                (os.ST_RELATIME, _MS_RELATIME)]  # fmt: skip
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        mount(None, target, None, flags | sum(ms for st_flag, ms in kept if st & st_flag))


def _drop_privileges(libc: ctypes.CDLL) -> None:
    """No capabilities (not even inside our user namespace) and no way to gain any by exec."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    libc.capset(header, (ctypes.c_uint32 * 6)())
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def _landlock(libc: ctypes.CDLL, root: str, readable: list[str]) -> bool:
    """Restrict this process with Landlock (see the module docstring); whether it worked."""
    abi = libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)  # 1: ask for the ABI version
    if abi < 1:
        return False
    handled_fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
    # handled filesystem rights, handled network rights (TCP bind and connect), scopes
    # (abstract unix sockets and signals); each field exists from some ABI on.
    attr = (ctypes.c_uint64 * 3)(handled_fs, 3, 3)
    size = 8 * (1 if abi < 4 else 2 if abi < 6 else 3)
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, attr, size, 0)
    if ruleset < 0:
        return False

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    rules = [(path, _LANDLOCK_READ) for path in readable]
    rules += [(device, 1 | 2 | 4 | (1 << 14)) for device in _DEVICES]
    rules.append((root, handled_fs))
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not in this view: nothing to allow
            try:
                if not os.path.isdir(path):
                    allowed &= _LANDLOCK_FILE
                rule = PathBeneath(allowed & handled_fs, fd)
                if libc.syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                    return False
            finally:
                os.close(fd)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: Landlock needs it without privileges
        return libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0) == 0
    finally:
        os.close(ruleset)
