"""The sandbox's system-call policy: deny by default, allow a list, check the arguments of
every allowed call that can name another process.

Three answers, one per kind of call:

* **allowed**: what the interpreter and a test program need (memory, files and
  directories, which Landlock governs, time, polling, identity, signals to itself). The
  list was measured with ``strace -f`` on the bootstrap and on programs that import most of
  the standard library, use files, ``asyncio``, ``sqlite3``, ``ctypes``, ``signal.alarm``,
  ``resource``, deep recursion, large output, ``MemoryError``; see docs/security.md.
* **EPERM** (the default): everything else. The program sees a ``PermissionError`` and
  fails like any program that does something it may not (``fork``, ``socket``, ``chmod``
  of a path, ``prctl``, …).
* **killed** (``SECCOMP_RET_KILL_PROCESS``, the run ends with ``SIGSYS``): calls that act on
  another process, or that leave kernel objects behind after the run. The caller sees the
  signal and counts the run (``peerlm_agent_sandbox_forbidden_calls_total``); no honest
  test program makes them.

Where an allowed call takes a process id it must name the caller: ``0`` for
``prlimit64``, ``setpriority``, ``getpriority`` (with ``PRIO_PROCESS``) and the
``sched_*`` calls (the form glibc and CPython use for "myself"), the program's own pid for
``kill``, ``tkill``, ``tgkill`` and the ``rt_*sigqueueinfo`` calls (the filter is built in
the program's process, so its pid is known). Any other value is killed. Comparisons are
on the full 64-bit register: a pid or command with junk in the upper half (which the
kernel would truncate) matches no allow rule and is refused.

The bootstrap loads this file by path (it runs ``python -I -S`` and imports only the
standard library), so it imports nothing at module level.
"""

# ruff: noqa: SIM105
# SIM105: loaded by the sandbox's child, which spares itself the contextlib import.
from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported by the sandbox's child
if TYPE_CHECKING:
    from typing import Any

#: Calls a confined test program may make with any arguments. Files: Landlock decides
#: which paths; ``chmod``/``chown``/``utime``/``*xattr`` on a path are left out because
#: Landlock does not govern them (the program could make the agent's key unreadable or
#: world-readable); ``fchmod`` stays, as it needs a descriptor Landlock let it open.
ALLOWED_SYSCALLS: tuple[str, ...] = (
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync",
    # descriptors and files
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "lseek", "close", "close_range", "dup", "dup2", "dup3",
    "open", "openat", "openat2", "creat", "stat", "fstat", "lstat", "newfstatat", "statx",
    "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink", "readlinkat",
    "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir",
    "unlink", "unlinkat", "rename", "renameat", "renameat2", "symlink", "symlinkat",
    "truncate", "ftruncate", "fsync", "fdatasync", "fallocate", "fadvise64", "flock",
    "sendfile", "copy_file_range", "umask", "fchmod", "pipe", "pipe2",
    # polling
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    # I/O on sockets it holds (it can create none but an AF_UNIX pair)
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown",
    "getsockname", "getpeername", "getsockopt", "setsockopt",
    # time
    "clock_gettime", "clock_getres", "gettimeofday", "time", "nanosleep", "clock_nanosleep",
    "alarm", "setitimer", "getitimer", "times", "getrusage",
    # identity and the machine, read only
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getgroups",
    "getresuid", "getresgid", "getpgrp", "uname", "sysinfo", "getcpu", "getrandom",
    # own resource limits (x86's legacy calls act on the caller only)
    "getrlimit", "setrlimit",
    # signals, synchronisation, the end
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait",
    "rt_sigsuspend", "sigaltstack", "pause", "restart_syscall", "futex", "set_robust_list",
    "rseq", "sched_yield", "sched_get_priority_max", "sched_get_priority_min", "exit",
    "exit_group",
)  # fmt: skip

#: Allowed only when the caller names itself with 0 (argument 0); any other target kills.
SELF_AS_ZERO: tuple[str, ...] = (
    "prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
)  # fmt: skip
#: Read-only calls allowed when argument 0 is 0 (the caller); other targets get EPERM.
SELF_AS_ZERO_READ: tuple[str, ...] = (
    "sched_getaffinity", "sched_getparam", "sched_getscheduler", "sched_getattr",
    "getpgid", "getsid",
)  # fmt: skip
#: Signals: argument 0 must be the program's own pid (and argument 1, the thread, too for
#: the thread-directed calls: the program has a single thread, whose id is its pid).
SIGNAL_BY_PID: tuple[str, ...] = ("kill", "tkill", "rt_sigqueueinfo")
SIGNAL_BY_TGID_TID: tuple[str, ...] = ("tgkill", "rt_tgsigqueueinfo")

#: ``fcntl`` commands allowed (by number, x86-64 and generic Linux values).
FCNTL_ALLOWED: dict[int, str] = {
    0: "F_DUPFD", 1: "F_GETFD", 2: "F_SETFD", 3: "F_GETFL", 4: "F_SETFL", 5: "F_GETLK",
    6: "F_SETLK", 7: "F_SETLKW", 9: "F_GETOWN", 11: "F_GETSIG", 16: "F_GETOWN_EX",
    36: "F_OFD_GETLK", 37: "F_OFD_SETLK", 38: "F_OFD_SETLKW", 1030: "F_DUPFD_CLOEXEC",
    1031: "F_SETPIPE_SZ", 1032: "F_GETPIPE_SZ", 1033: "F_ADD_SEALS", 1034: "F_GET_SEALS",
}  # fmt: skip
#: ``fcntl`` commands that choose which process receives a descriptor's I/O signal (and
#: which signal: ``SIGKILL`` included): killed.
FCNTL_FORBIDDEN: dict[int, str] = {8: "F_SETOWN", 10: "F_SETSIG", 15: "F_SETOWN_EX"}
#: ``ioctl`` requests allowed: what ``isatty``, ``get_terminal_size``, non-blocking mode
#: and close-on-exec use.
IOCTL_ALLOWED: dict[int, str] = {
    0x5401: "TCGETS", 0x5413: "TIOCGWINSZ", 0x541B: "FIONREAD", 0x5421: "FIONBIO",
    0x5450: "FIONCLEX", 0x5451: "FIOCLEX",
}  # fmt: skip
#: ``ioctl`` requests that do what ``F_SETOWN`` does (or set a terminal's process group):
#: killed.
IOCTL_FORBIDDEN: dict[int, str] = {0x8901: "FIOSETOWN", 0x8902: "SIOCSPGRP", 0x5410: "TIOCSPGRP"}

#: Calls that act on another process, or create System V or POSIX message-queue objects
#: that outlive the process: the run is killed.
FORBIDDEN_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise",
    "process_mrelease", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "kcmp",
    "ioprio_set", "migrate_pages", "move_pages",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "ipc",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)  # fmt: skip

#: Added to the allowed calls only when the caller allowed the network.
NETWORK_SYSCALLS: tuple[str, ...] = ("socket", "connect", "bind", "listen", "accept", "accept4")

_AF_UNIX = 1
_PRIO_PROCESS = 0


def install(seccomp: Any, *, pid: int, allow_network: bool) -> None:
    """Build the filter with the ``pyseccomp`` module ``seccomp`` and load it into this
    process (irrevocably). ``pid`` is this process's id.

    Names this libseccomp does not know on this architecture are skipped (they stay
    denied); calls from another architecture (x32, i386 on x86-64) kill.
    """
    import errno

    kill = seccomp.KILL_PROCESS if seccomp.get_api() >= 3 else seccomp.KILL
    arg, eq, ne = seccomp.Arg, seccomp.EQ, seccomp.NE
    syscall_filter = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))

    def rule(action: int, name: str, *args: Any) -> None:
        try:
            syscall_filter.add_rule(action, name, *args)
        except ValueError:
            pass  # unknown on this architecture: stays denied

    allowed = ALLOWED_SYSCALLS + (NETWORK_SYSCALLS if allow_network else ())
    for name in allowed:
        rule(seccomp.ALLOW, name)
    for name in FORBIDDEN_SYSCALLS:
        rule(kill, name)
    for name in SELF_AS_ZERO:
        rule(seccomp.ALLOW, name, arg(0, eq, 0))
        rule(kill, name, arg(0, ne, 0))
    for name in SELF_AS_ZERO_READ:
        rule(seccomp.ALLOW, name, arg(0, eq, 0))
    # PRIO_PROCESS with who 0 is the caller; PRIO_PGRP and PRIO_USER reach other processes.
    rule(seccomp.ALLOW, "setpriority", arg(0, eq, _PRIO_PROCESS), arg(1, eq, 0))
    rule(kill, "setpriority", arg(0, ne, _PRIO_PROCESS))
    rule(kill, "setpriority", arg(1, ne, 0))
    rule(seccomp.ALLOW, "getpriority", arg(0, eq, _PRIO_PROCESS), arg(1, eq, 0))
    for name in SIGNAL_BY_PID:
        rule(seccomp.ALLOW, name, arg(0, eq, pid))
        rule(kill, name, arg(0, ne, pid))
    for name in SIGNAL_BY_TGID_TID:
        rule(seccomp.ALLOW, name, arg(0, eq, pid), arg(1, eq, pid))
        rule(kill, name, arg(0, ne, pid))
        rule(kill, name, arg(1, ne, pid))
    for command in FCNTL_ALLOWED:
        rule(seccomp.ALLOW, "fcntl", arg(1, eq, command))
    for command in FCNTL_FORBIDDEN:
        rule(kill, "fcntl", arg(1, eq, command))
    for request in IOCTL_ALLOWED:
        rule(seccomp.ALLOW, "ioctl", arg(1, eq, request))
    for request in IOCTL_FORBIDDEN:
        rule(kill, "ioctl", arg(1, eq, request))
    if allow_network:
        rule(seccomp.ALLOW, "socketpair")
    else:
        rule(seccomp.ALLOW, "socketpair", arg(0, eq, _AF_UNIX))
    syscall_filter.load()
