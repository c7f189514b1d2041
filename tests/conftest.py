"""Fixtures shared by the test modules: the offline hub, the micro models, a fork server for
agent processes, and the reaper of child processes a module left running."""

from __future__ import annotations

import contextlib
import os
import resource
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import psutil
import pytest

from peerlm.app.devfed import AGENT_ENV, AGENT_PRELOAD
from peerlm.forkserver import ForkServer


@pytest.fixture(scope="module")
def offline_hub() -> Iterator[None]:
    """Nothing may reach a hub: every model load is from a local directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def micro_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of micro models per session: whichever module runs first builds them."""
    return tmp_path_factory.getbasetemp() / "peerlm-micro-models"


@pytest.fixture(scope="module")
def micro_gpt2(micro_models_dir: Path, offline_hub: None) -> Path:
    """The micro gpt2 model's folder (built once per session), loaded offline."""
    from peerlm.agent.models.tiny import build_models

    [info] = build_models(micro_models_dir, ("gpt2",), size="micro")
    return Path(info.path)


@pytest.fixture(scope="module")
def agent_forks(request: pytest.FixtureRequest) -> Iterator[ForkServer]:
    """Where a module starts its ``peerlm agent`` processes: forked from one server that
    imported the agent's libraries once (what ``peerlm up`` does), about 7 CPU seconds saved
    per agent. A spawn this server cannot serve exactly (another environment) starts a new
    interpreter instead. Agents a module left running are killed at its end, and named."""
    forks = ForkServer({**os.environ, **AGENT_ENV}, AGENT_PRELOAD).start()
    yield forks
    killed = forks.close(timeout=5)
    if forks.started:
        # Still correct (a new interpreter each), only slower: say why, so it gets fixed.
        warnings.warn(
            f"{request.module.__name__}: {forks.started} agent(s) not forked: {forks.last_refusal}",
            stacklevel=1,
        )
    if killed:
        names = ", ".join(f"{p.pid}:{' '.join(p.args[2:5])}" for p in killed)
        warnings.warn(
            f"{request.module.__name__} left {len(killed)} agent(s) running: {names}",
            stacklevel=1,
        )


@pytest.fixture(scope="module", autouse=True)
def reap_leftover_children(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test module, kill every process the module started and left running.

    A test that fails between spawning a CPM or an agent and its own clean-up would otherwise
    leave the process holding ports, CPU and files for the rest of the session. Leftovers are
    reported as a warning naming the module, so the leak itself stays visible.
    """
    yield
    me = psutil.Process()
    leftovers = me.children(recursive=True)
    if not leftovers:
        return
    names = ", ".join(f"{p.pid}:{_cmdline(p)}" for p in leftovers)
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _gone, alive = psutil.wait_procs(leftovers, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    warnings.warn(
        f"{request.module.__name__} left {len(leftovers)} child process(es) running: {names}",
        stacklevel=1,
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with the largest time budget first, each module's tests in their own order.

    With parallel workers (scripts/test: ``-n 4 --dist loadfile``) modules are handed out in
    this order, so the longest ones (a from-scratch model build, the federations) start at
    once instead of last, and the short ones fill the other worker. A module's budget is the
    largest ``timeout`` marker among its tests; a ``slow`` test counts as the default timeout.
    Only the order changes: every collected test runs.
    """
    default = float(config.getini("timeout") or 0)
    budget: dict[str, float] = {}
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            seconds = float(marker.args[0])
        else:
            seconds = default if item.get_closest_marker("slow") is not None else 0.0
        module = item.nodeid.split("::", 1)[0]
        budget[module] = max(budget.get(module, 0.0), seconds)
    items.sort(key=lambda item: -budget[item.nodeid.split("::", 1)[0]])


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"


class _ModuleClock:
    """Seconds spent per test module (set-up, call and tear-down), summed on the controller,
    with the CPU seconds they cost (:class:`_PhaseCpu`).

    The ``--durations`` table names single tests; where a suite's minutes go is a question
    about modules (their fixtures, their federations), so the end of a run lists those too.
    On a loaded machine a module's wall time says little about what it costs the others; its
    CPU seconds do (the suite is CPU-bound on two cores).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration
        cpu = dict(report.user_properties).get(_CPU_PROPERTY, 0.0)
        self.cpu[module] = self.cpu.get(module, 0.0) + float(cpu)  # type: ignore[arg-type]

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds:
            return
        total, cpu = sum(self.seconds.values()), sum(self.cpu.values())
        terminalreporter.write_sep(
            "=", f"slowest modules ({total:.0f} s in all tests, {cpu:.0f} CPU s)"
        )
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        for module, seconds in ranked[:MODULE_CLOCK_LINES]:
            terminalreporter.write_line(
                f"{seconds:8.1f}s {100 * seconds / total:5.1f}% {self.cpu.get(module, 0.0):7.1f} "
                f"CPU s  {module}"
            )


#: The user property of a test report holding the CPU seconds of its phase.
_CPU_PROPERTY = "cpu_s"
_PHASE_CPU = pytest.StashKey[float]()


def _cpu_now() -> float:
    """CPU seconds of this process (every thread) and of its children waited for: a process
    a test started counts once it is reaped (a module's fork server and its agents at the
    module's end)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class _PhaseCpu:
    """In the process that runs the tests: the CPU seconds of each phase (set-up, call,
    tear-down) go with its report, as the user property ``cpu_s``, to whoever sums them."""

    def _measured(self, item: pytest.Item) -> Iterator[None]:
        start = _cpu_now()
        yield
        item.stash[_PHASE_CPU] = _cpu_now() - start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()  # type: ignore[attr-defined]
        report.user_properties.append((_CPU_PROPERTY, round(item.stash.get(_PHASE_CPU, 0.0), 3)))
        item.stash[_PHASE_CPU] = 0.0


#: How many modules the end-of-run summary lists.
MODULE_CLOCK_LINES = 30


def pytest_configure(config: pytest.Config) -> None:
    # Only the process that prints the summary keeps a clock: with xdist, the controller,
    # which receives every worker's reports.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ModuleClock(), "peerlm-module-clock")
    # The processes that run tests measure their phases' CPU: the workers under xdist, this
    # process without it (the controller runs none).
    if hasattr(config, "workerinput") or not _distributed(config):
        config.pluginmanager.register(_PhaseCpu(), "peerlm-phase-cpu")


def _distributed(config: pytest.Config) -> bool:
    """Whether xdist hands the tests to worker processes (``-n N`` with N > 0)."""
    return bool(getattr(config.option, "numprocesses", None))
