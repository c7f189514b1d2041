"""Starting ``peer_server_process`` and watching it from outside, for the slow-reader tests:
its resident memory (sampled, with a kill switch), whether a process is stopped, its
Prometheus samples, and a polled wait for a condition (nothing is timed: a wait has a
generous deadline)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "RssSampler",
    "ServerProcess",
    "SlowReader",
    "peer_server",
    "rss",
    "scrape",
    "start_slow_reader",
    "stopped",
    "wait_for",
]


def rss(pid: int) -> int:
    """The resident memory of ``pid`` in bytes (``/proc/PID/status`` VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal."""
    # /proc/PID/stat: "pid (comm) state ..."; T = stopped by a signal.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def wait_for(
    what: str, check: Callable[[], bool], deadline_s: float = 120.0, *, required: bool = True
) -> bool:
    """Poll ``check`` until it holds; past ``deadline_s`` fail (or return False if not
    ``required``)."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            if required:
                raise AssertionError(f"gave up waiting for {what}")
            return False
        time.sleep(0.1)
    return True


def scrape(metrics_port: int) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the ``/metrics`` page on ``metrics_port`` as (name, labels, value);
    empty when the process is gone."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as reply:
            text = reply.read().decode()
    except OSError:  # the server is gone (killed past the sampler's limit)
        return []
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


@dataclass
class RssSampler:
    """The server's RSS, sampled every 50 ms in a thread, and its peak. Past ``kill_above``
    the server is killed: a server without the bound would take gigabytes of a shared
    machine (the peak then shows it)."""

    pid: int
    kill_above: int
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss(self.pid))
                if self.peak > self.kill_above:
                    os.kill(self.pid, signal.SIGKILL)
                    return
            except (FileNotFoundError, ProcessLookupError):
                return

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


@dataclass
class ServerProcess:
    """A running ``peer_server_process``: its process, gRPC target and metrics port."""

    proc: subprocess.Popen[bytes]
    target: str
    metrics_port: int


@contextlib.contextmanager
def peer_server(pki: Path, work: Path, args: Sequence[str]) -> Iterator[ServerProcess]:
    """Start ``tests.security.peer_server_process`` (``teacher``, student ``honest``) with
    ``args`` on top, logging to ``work/server.log``; stopped (SIGTERM, then SIGKILL) after."""
    port_file, metrics_file = work / "port", work / "metrics"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.security.peer_server_process",
            "--pki",
            str(pki),
            "--name",
            "teacher",
            "--student",
            "honest",
            "--port-file",
            str(port_file),
            "--metrics-port-file",
            str(metrics_file),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "server.log").open("wb"),
    )
    try:
        wait_for("the server's ports", lambda: port_file.exists() and metrics_file.exists(), 120)
        wait_for("the port files' contents", lambda: bool(port_file.read_text()), 10)
        yield ServerProcess(
            proc, f"127.0.0.1:{port_file.read_text()}", int(metrics_file.read_text() or 0)
        )
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SlowReader(NamedTuple):
    """A running ``slow_reader_process`` and the files it reports to."""

    proc: subprocess.Popen[bytes]
    ready: Path
    final: Path


def start_slow_reader(
    pki: Path,
    target: str,
    work: Path,
    tag: str,
    *,
    names: Sequence[str],
    streams: int,
    rpcs: Sequence[str] = ("PullAdapter",),
) -> SlowReader:
    """Start ``tests.security.slow_reader_process``: ``streams`` streams per identity of
    ``names`` (the RPCs of ``rpcs`` in turn) against ``target``; files ``work/*{tag}``."""
    ready, final = work / f"ready{tag}", work / f"final{tag}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.security.slow_reader_process",
            "--pki",
            str(pki),
            "--names",
            ",".join(names),
            "--target",
            target,
            "--streams",
            str(streams),
            "--rpcs",
            ",".join(rpcs),
            "--ready-file",
            str(ready),
            "--final-file",
            str(final),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / f"reader{tag}.log").open("wb"),
    )
    return SlowReader(proc, ready, final)
