"""Start ``python -m <module>`` commands by forking a process that imported the heavy
libraries once, instead of paying their imports in every new interpreter.

An agent's imports (torch, transformers, peft, scikit-learn) cost about 7 CPU seconds
before it does anything (measured 2026-12-06: ``import peerlm.agent.daemon``, 6.2-6.6 s
user). ``peerlm up`` starts N agents side by side on the same cores, and restarts them; a
:class:`ForkServer` pays those imports once and forks each agent from that state, which is
what :mod:`multiprocessing`'s ``forkserver`` does for functions, here for whole commands
with their own arguments, environment, working directory and standard streams.

The child of a fork server behaves as ``subprocess.Popen([sys.executable, "-m", module,
*args], ...)`` would: its own argv, environment, cwd, umask, session and stdio, ``atexit``
handlers and non-daemon threads run at its end, and :class:`ForkedProcess` offers Popen's
``pid``, ``returncode``, ``stdout``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and
``kill``. Signals go through a pidfd, so a signal never reaches a reused pid. The exit
status comes from the server, the child's parent. One difference stays: a child started
without ``start_new_session`` is in the server's session (its own, so that a terminal's
Ctrl-C does not end the server), not the caller's process group; the caller stops it.

Where forking could differ from a fresh interpreter the client starts one instead (a plain
:class:`subprocess.Popen`) and says why in :attr:`ForkServer.fallback_reason`: an argv that
is not ``<this python> -m <module>``, an environment that differs from the server's outside
``PEERLM_*`` (libraries read variables such as ``OMP_NUM_THREADS`` or ``HF_HUB_OFFLINE``
once, at import), a server that did not start, or one that holds more than one thread after
its imports (forking a threaded process can copy a lock another thread held).

Run as ``python -m peerlm.forkserver --socket PATH --preload a,b,c``: the server. It ends
once its standard input (the lifeline from the process that started it) closes and its
last child has been reaped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["UNKNOWN_EXIT", "ChildProcess", "ForkServer", "ForkedProcess", "retitle"]

#: Environment keys a child may set differently from the server's: peerlm reads its own
#: settings when a command runs, never at import; pytest rewrites ``PYTEST_CURRENT_TEST``
#: for every phase of every test, and no library reads it.
RUNTIME_ENV_PREFIXES = ("PEERLM_", "PYTEST_CURRENT_TEST")

#: The exit code a :class:`ForkedProcess` reads when its server died before reporting one.
UNKNOWN_EXIT = 255

#: Bytes of command line the server reserves, so that each child can show its own argv in
#: ``ps`` and ``/proc/PID/cmdline`` (a child's title lives in the server's argv memory).
TITLE_ROOM = 1024

_HEADER = struct.Struct("!I")
#: Largest request (argv, environment, cwd) a server reads: a bound, not a limit in use.
_MAX_REQUEST = 4 << 20


def _module_of(argv: Sequence[str]) -> str | None:
    """The module ``argv`` runs when it is ``[sys.executable, "-m", module, ...]`` (this
    interpreter, no other flag), else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2]:
        return argv[2]
    return None


def _send_message(sock: socket.socket, payload: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(payload).encode()
    message = _HEADER.pack(len(data)) + data
    # Header and body in one call: a reader that saw the socket readable finds it whole.
    sent = socket.send_fds(sock, [message], list(fds)) if fds else sock.send(message)
    if sent < len(message):
        # Only what is left: a send of nothing after the whole message would still fail
        # with EPIPE once the peer has read it and closed, and so hide that it was sent.
        sock.sendall(message[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise EOFError("connection closed mid-message")
        chunks += chunk
    return bytes(chunks)


def _recv_message(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if maxfds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, maxfds)
    else:
        head = _recv_exact(sock, _HEADER.size)
    try:
        if not head:
            raise EOFError("connection closed")
        if len(head) < _HEADER.size:
            head += _recv_exact(sock, _HEADER.size - len(head))
        (length,) = _HEADER.unpack(head)
        if length > _MAX_REQUEST:
            raise ValueError(f"message of {length} bytes is over {_MAX_REQUEST}")
        payload = json.loads(_recv_exact(sock, length))
        if not isinstance(payload, dict):
            raise ValueError("message is not a JSON object")
    except BaseException:
        # Descriptors that came with a message nobody will use must not pile up.
        for fd in fds:
            os.close(fd)
        raise
    return payload, fds


class _ServerGone(OSError):
    """The fork server could not be reached, or closed the connection before a request was
    whole: no child was forked for it."""


class ForkedProcess:
    """A command forked by a :class:`ForkServer`, driven like a :class:`subprocess.Popen`."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        conn: socket.socket,
        pidfd: int | None,
        stdout: IO[Any] | None,
    ) -> None:
        self.args = args
        self.pid = pid
        self.stdout: IO[Any] | None = stdout
        self.stderr: IO[Any] | None = None
        self.stdin: IO[Any] | None = None
        self.returncode: int | None = None
        self._conn = conn
        self._pidfd = pidfd
        self._output: list[bytes] = []

    def _take_status(self, timeout: float | None) -> bool:
        """Read the exit status if the server sent it within ``timeout``; True once known."""
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        self._conn.settimeout(10)
        try:
            message, _ = _recv_message(self._conn)
        except (EOFError, OSError, ValueError):
            # The server ended without sending the status (it was killed): the process,
            # reaped by whoever inherited it, has a status nobody can read.
            if self._pidfd is not None:
                gone, _, _ = select.select([self._pidfd], [], [], timeout)
                if not gone:
                    return False
            self.returncode = UNKNOWN_EXIT
            self._close()
            return True
        self.returncode = int(message["exit"])
        self._close()
        return True

    def _close(self) -> None:
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        """The exit code if the command ended, else None (Popen semantics: ``-N`` for a
        signal N)."""
        self._take_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the command ends; :class:`subprocess.TimeoutExpired` after
        ``timeout`` seconds."""
        if not self._take_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(
        self, input: bytes | str | None = None, timeout: float | None = None
    ) -> tuple[Any, None]:
        """Read standard output (a ``PIPE``) to its end and wait for the command, as
        :meth:`subprocess.Popen.communicate` does; ``input`` is not supported (no stdin
        pipe). :class:`subprocess.TimeoutExpired` after ``timeout`` seconds, the output read
        so far kept for the next call."""
        if input:
            raise ValueError("a forked process has no stdin pipe")
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self.stdout is not None and not self.stdout.closed:
            fd = self.stdout.fileno()
            while True:
                ready, _, _ = select.select([fd], [], [], left())
                if not ready:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                self._output.append(chunk)
            self.stdout.close()
        if not self._take_status(left()):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        if self.stdout is None:
            return None, None
        data = b"".join(self._output)
        text = "b" not in getattr(self.stdout, "mode", "rb")
        return (data.decode() if text else data), None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the command already ended (through its pidfd: never to a
        process that reused the pid)."""
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stdout is not None:
            self.stdout.close()
        self.wait()


ChildProcess = ForkedProcess | subprocess.Popen[Any]


@dataclass
class ForkServer:
    """A warm server forking ``python -m <module>`` commands (module docstring).

    ``env`` is the environment the server imports under, and the one every child forked
    from it must have outside ``PEERLM_*``; ``preload``, the modules it imports once.
    ``log`` receives the server's own standard error (its import warnings, a refused
    request). Start it early (:meth:`start` returns at once); the first :meth:`spawn`
    waits for it to be ready. ``forked`` and ``started`` count the commands forked and
    those started as new interpreters; ``last_refusal`` says why the last of those was,
    ``fallback_reason`` why the server serves none (it did not start, or holds threads)."""

    env: Mapping[str, str]
    preload: Sequence[str]
    log: Path | None = None
    ready_timeout_s: float = 180.0
    fallback_reason: str | None = None
    last_refusal: str | None = None
    forked: int = 0
    started: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    _ready: bool = field(default=False, repr=False)
    _info: dict[str, Any] = field(default_factory=dict, repr=False)
    _children: list[ForkedProcess] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def socket_path(self) -> Path:
        assert self._dir is not None
        return Path(self._dir.name) / "fork.sock"

    @property
    def info(self) -> dict[str, Any]:
        """What the server reported when ready: pid, threads, import seconds, modules."""
        return dict(self._info)

    def start(self) -> ForkServer:
        """Launch the server process; it imports in the background. Where it cannot be
        launched (no writable temporary folder, no process left) every spawn starts a new
        interpreter, and :attr:`fallback_reason` says why."""
        if self._proc is not None or self.fallback_reason is not None:
            return self
        try:
            self._launch()
        except OSError as error:
            self.fallback_reason = f"server not launched: {error}"
            self.close()
        return self

    def _launch(self) -> None:
        # A private folder: only this user may reach the socket.
        self._dir = tempfile.TemporaryDirectory(prefix="peerlm-fork-")
        os.chmod(self._dir.name, 0o700)
        argv = [sys.executable, "-m", "peerlm.forkserver", "--socket", str(self.socket_path)]
        argv += ["--preload", ",".join(self.preload), "--title-room", "." * TITLE_ROOM]
        err: Any = subprocess.DEVNULL
        if self.log is not None:
            err = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # Its own session: a Ctrl-C in the terminal must not end the server (and with
            # it every child's exit status) before the command stops its children in order.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=dict(self.env),
                start_new_session=True,
            )
        finally:
            if isinstance(err, int) and err != subprocess.DEVNULL:
                os.close(err)

    def _await_ready(self) -> bool:
        # One reader of the server's ready line, whichever thread spawns first.
        with self._lock:
            return self._read_ready()

    def _read_ready(self) -> bool:
        if self._ready:
            return True
        if self.fallback_reason is not None:
            return False
        if self._proc is None:
            self.start()
        assert self._proc is not None and self._proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self._proc.stdout, selectors.EVENT_READ)
        try:
            if not selector.select(self.ready_timeout_s):
                self.fallback_reason = f"server not ready within {self.ready_timeout_s:g} s"
                return False
        finally:
            selector.close()
        line = self._proc.stdout.readline()
        try:
            info = json.loads(line)
        except json.JSONDecodeError:
            self.fallback_reason = f"server did not start (exit {self._proc.poll()})"
            return False
        self._info = info
        if info.get("threads", 1) > 1:
            self.fallback_reason = f"server holds {info['threads']} threads after its imports"
            # Nothing will be forked from it: its memory (the imports) goes back now.
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            return False
        self._ready = True
        return True

    def _refusal(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        if _module_of(argv) is None:
            return "not `<this python> -m <module>`"
        keys = set(env) | set(self.env)
        differ = sorted(
            k
            for k in keys
            if not k.startswith(RUNTIME_ENV_PREFIXES) and env.get(k) != self.env.get(k)
        )
        if differ:
            return f"environment differs from the server's in {', '.join(differ[:5])}"
        return None

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        start_new_session: bool = False,
        umask: int = -1,
        text: bool = False,
    ) -> ChildProcess:
        """Start ``argv`` forked from the server, or as a new interpreter where forking
        could differ (module docstring). Stream arguments as :class:`subprocess.Popen`'s:
        None (inherit), ``DEVNULL``, ``PIPE`` (forked for ``stdout`` only), ``STDOUT``
        (``stderr``), an fd or a file object."""
        env = dict(os.environ if env is None else env)
        refusal = self._refusal(argv, env)
        if refusal is None and subprocess.PIPE in (stdin, stderr):
            # Only stdout has a pipe here; reading two pipes needs Popen.communicate.
            refusal = "a stdin or stderr pipe"
        if refusal is None and not self._await_ready():
            refusal = self.fallback_reason
        if refusal is None:
            try:
                return self._fork(
                    list(argv), stdin, stdout, stderr, env, cwd, start_new_session, umask, text
                )
            except _ServerGone as gone:
                self._ready = False
                self.fallback_reason = refusal = str(gone)
        self.started += 1
        self.last_refusal = refusal
        return subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=cwd,
            start_new_session=start_new_session,
            umask=umask,
            text=text,
        )

    def _fork(
        self,
        argv: list[str],
        stdin: int | IO[Any] | None,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
        env: dict[str, str],
        cwd: str | Path | None,
        session: bool,
        umask: int,
        text: bool,
    ) -> ForkedProcess:
        opened: list[int] = []

        def fd_of(stream: int | IO[Any] | None, default: int) -> int:
            if stream is None:
                return default
            if stream == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
                return fd
            if isinstance(stream, int):
                return stream
            return stream.fileno()

        reader: IO[Any] | None = None
        try:
            in_fd = fd_of(stdin, 0)
            if stdout == subprocess.PIPE:
                r, out_fd = os.pipe()
                opened.append(out_fd)
                reader = open(r, "r" if text else "rb")  # noqa: SIM115 - the caller closes it
            else:
                out_fd = fd_of(stdout, 1)
            err_fd = out_fd if stderr == subprocess.STDOUT else fd_of(stderr, 2)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                try:
                    conn.connect(str(self.socket_path))
                except OSError as error:
                    # Nothing was sent: the server is gone (killed, out of memory).
                    raise _ServerGone(f"server gone: {error}") from error
                request = {
                    "module": _module_of(argv),
                    "args": argv[3:],
                    "env": env,
                    "cwd": str(cwd) if cwd is not None else os.getcwd(),
                    "session": session,
                    "umask": umask,
                }
                try:
                    _send_message(conn, request, [in_fd, out_fd, err_fd])
                except (BrokenPipeError, ConnectionResetError) as error:
                    # The server closed the connection before the request was whole in its
                    # socket (it died, or stopped listening, after it was ready): the send
                    # fails only while bytes of it are left, so the server can have read
                    # none of it whole and forked nothing; a new interpreter runs it.
                    raise _ServerGone(f"server gone: {error}") from error
                reply, fds = _recv_message(conn, maxfds=1)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)
        if "error" in reply:
            conn.close()
            if reader is not None:
                reader.close()
            raise OSError(f"fork server refused {argv[2:4]}: {reply['error']}")
        for fd in fds:
            os.set_inheritable(fd, False)  # this process's later children need no pidfd
        self.forked += 1
        child = ForkedProcess(argv, int(reply["pid"]), conn, fds[0] if fds else None, reader)
        self._children.append(child)
        return child

    def close(self, timeout: float = 10.0) -> list[ForkedProcess]:
        """End the lifeline: the server stops taking requests, reaps its children (still
        reporting their exit to their :class:`ForkedProcess`) and exits. A child still
        running ``timeout`` seconds later is killed, while it is still this process's
        descendant (a killed server would orphan it); those children are returned."""
        killed: list[ForkedProcess] = []
        if self._proc is not None:
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = [child for child in self._children if child.poll() is None]
                for child in killed:
                    child.kill()
                try:
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        self._children.clear()
        return killed

    def __enter__(self) -> ForkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the server -------------------------------------------------------------------------


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket


@dataclass
class _Server:
    listener: socket.socket | None
    selector: selectors.BaseSelector
    children: dict[int, _Child] = field(default_factory=dict)

    def release_in_child(self) -> None:
        """In a forked child: drop the server's descriptors without touching the ones the
        child's streams are about to take."""
        self.selector.close()
        if self.listener is not None:
            os.close(self.listener.detach())
        for child in self.children.values():
            os.close(child.pidfd)
            os.close(child.conn.detach())


def retitle(argv: Sequence[str]) -> bool:
    """Make this process's ``/proc/self/cmdline`` (what ``ps``, ``pgrep -f`` and psutil
    read) show ``argv``, NUL-separated as the kernel wrote it at exec, in the memory the
    original command line occupies (its length cannot grow without CAP_SYS_RESOURCE: a
    longer ``argv`` is cut). False where /proc cannot be written (not Linux, a locked-down
    /proc): the old title stays."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5))
        data = b"\0".join(str(a).encode() for a in argv)[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data + b"\0" * (end - start - len(data)))
    except (OSError, ValueError, IndexError):
        return False
    return True


def _reopen_stdio() -> None:
    """Standard streams as a fresh interpreter would set them up on fds 0-2 (the server's
    were made for its own pipes)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def text(fd: int, mode: str, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any
        if mode == "r":
            buffered = io.BufferedReader(raw)
        elif unbuffered:
            buffered = raw  # as `python -u`: text straight to the descriptor
        else:
            buffered = io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffered,
            encoding=sys.stdout.encoding or "utf-8",
            errors=errors,
            line_buffering=line,
            write_through=unbuffered and mode == "w",
        )

    streams = {
        "stdin": text(0, "r", "strict", False),
        "stdout": text(1, "w", "strict", os.isatty(1)),
        "stderr": text(2, "w", "backslashreplace", True),
    }
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_child(
    server: _Server, conn: socket.socket, request: dict[str, Any], fds: list[int]
) -> int:
    """Become the requested command (in the forked child); its exit code."""
    import atexit
    import runpy
    import traceback

    server.release_in_child()
    os.close(conn.detach())
    if request.get("session"):
        os.setsid()
    if int(request.get("umask", -1)) >= 0:
        os.umask(int(request["umask"]))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    os.chdir(request["cwd"])
    _reopen_stdio()
    sys.path[0] = os.getcwd()
    if "numpy" in sys.modules:
        # A fresh interpreter seeds numpy's global generator from the OS; so does each child.
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *[str(a) for a in request["args"]]]
    retitle([sys.executable, "-m", str(request["module"]), *sys.argv[1:]])
    code = 0
    try:
        runpy.run_module(str(request["module"]), run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # What an interpreter does at its end: threading's shutdown (its exit hooks, such as
    # concurrent.futures stopping idle pool workers, then a join of non-daemon threads),
    # then atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _serve_one(server: _Server, conn: socket.socket) -> None:
    conn.settimeout(10)
    try:
        request, fds = _recv_message(conn, maxfds=3)
    except (OSError, EOFError, ValueError) as error:
        print(f"forkserver: bad request: {error}", file=sys.stderr, flush=True)
        conn.close()
        return
    try:
        if len(fds) != 3 or not isinstance(request.get("module"), str):
            raise ValueError("a request needs a module and three descriptors")
        if not isinstance(request.get("env"), dict) or not isinstance(request.get("args"), list):
            raise ValueError("a request needs env (object) and args (list)")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 70  # EX_SOFTWARE: the child failed before the command ran
            try:
                code = _run_child(server, conn, request, fds)
            except BaseException as error:
                # On the command's own stderr where the streams were already in place.
                with contextlib.suppress(Exception):
                    os.write(2, f"forkserver: cannot start the command: {error}\n".encode())
            finally:
                os._exit(code)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            # A command nobody can follow must not run: end it before saying "refused".
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        server.children[pidfd] = _Child(pid, pidfd, conn)
        server.selector.register(pidfd, selectors.EVENT_READ, pidfd)
        try:
            _send_message(conn, {"pid": pid}, [pidfd])
        except OSError:
            # The client is gone before it learnt the pid: end the child (reaped below).
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            raise
    except (OSError, ValueError) as error:
        print(f"forkserver: refused: {error}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            _send_message(conn, {"error": str(error)})
        if not any(c.conn is conn for c in server.children.values()):
            conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def _reap(server: _Server, pidfd: int) -> None:
    child = server.children.pop(pidfd)
    server.selector.unregister(pidfd)
    try:
        _, status = os.waitpid(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:  # reaped by someone else: its status is gone
        code = UNKNOWN_EXIT
    with contextlib.suppress(OSError):
        child.conn.settimeout(5)
        _send_message(child.conn, {"exit": code})
    child.conn.close()
    os.close(pidfd)


def serve(socket_path: Path, preload: Sequence[str]) -> None:
    """The server's loop: import ``preload``, report readiness on stdout, then fork one
    child per request until the lifeline (stdin) closes and every child is reaped."""
    import importlib

    retitle([sys.executable, "-m", "peerlm.forkserver", "--socket", str(socket_path)])
    # An ignored SIGCHLD survives exec and would let the kernel reap the children before
    # their status is read; the children get the default back with it, as a fresh one has.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    started = time.process_time()
    for name in preload:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task")) if Path("/proc/self/task").is_dir() else 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(64)
    server = _Server(listener, selectors.DefaultSelector())
    server.selector.register(listener, selectors.EVENT_READ, "accept")
    server.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    ready = {
        "pid": os.getpid(),
        "threads": threads,
        "import_cpu_s": round(time.process_time() - started, 3),
        "modules": len(sys.modules),
    }
    print(json.dumps(ready), flush=True)
    while server.listener is not None or server.children:
        for key, _ in server.selector.select():
            if key.data == "accept" and server.listener is not None:
                try:
                    conn, _ = server.listener.accept()
                except OSError as error:  # out of descriptors: refuse this one, live on
                    print(f"forkserver: accept failed: {error}", file=sys.stderr, flush=True)
                    time.sleep(0.1)
                    continue
                _serve_one(server, conn)
            elif key.data == "lifeline":
                if os.read(sys.stdin.fileno(), 4096):
                    continue
                server.selector.unregister(sys.stdin.fileno())
                if server.listener is not None:
                    server.selector.unregister(server.listener)
                    server.listener.close()
                    server.listener = None
            elif isinstance(key.data, int):
                _reap(server, key.data)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m peerlm.forkserver --socket PATH --preload a,b``."""
    parser = argparse.ArgumentParser(prog="python -m peerlm.forkserver")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--title-room", default="", help="room for the children's titles")
    args = parser.parse_args(argv)
    serve(args.socket, [m for m in args.preload.split(",") if m])


if __name__ == "__main__":
    main()
