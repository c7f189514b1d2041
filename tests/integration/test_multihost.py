"""The Compose federation across hosts: every service in its own network namespace.

Reads ``docker-compose.yml`` (not a copy of it) and runs its services as Compose would, each
``peerlm`` process in its own network namespace with its own address on a bridge this test
creates (10.231.0.0/24, no address in the root namespace), names resolved through a
per-namespace ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` binds over
``/etc/hosts``), volumes mapped to temporary directories. Container paths in commands,
environment and mounted config files are rewritten to those directories; nothing else of
a service is changed except the overrides in ``TEST_OVERRIDES`` / ``--size micro``, which
keep the run within a few minutes on two cores (micro models, short timers).

Order is the Compose order: the ``certs``, ``models``, ``data`` and ``scrape-targets``
one-shots (``certs`` twice: a rerun keeps the CA), then the CPM (and the overlay node when
``peerlm overlay-node`` exists), gated on the services' own healthcheck commands run inside
their namespaces, then three agents. Checks, from an observer namespace that plays
Prometheus: two rounds by every agent; ``/metrics`` from every started target of the
generated scrape-target files; then one agent's link is cut (``ip link set ... down``): the
other agents keep getting rounds and rewards; the link comes back and the agent rejoins
(new profiles at the CPM, feed reconnected, rounds continue). Every namespace, the bridge
and the hosts files are removed at the end, also on failure.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SUBNET = "10.231.0"
AGENTS = ("agent-0", "agent-1", "agent-2")
CUT = "agent-2"
PY = [sys.executable, "-m", "peerlm"]

#: Seconds from the test's start to the overlay's first build.
OVERLAY_GENESIS_DELAY_S = 40.0
#: Overlay step outcomes of a search the overlay answered (docs/overlay-aggregation.md).
ANSWERED = ("aggregated", "identity", "no_candidates")

#: Pace of the test run, not of a deployment: short timers so rounds take seconds.
TEST_OVERRIDES: dict[str, dict[str, str]] = {
    "cpm": {"PEERLM_CPM_ROUND_INTERVAL_S": "4", "PEERLM_CPM_INIT": "true"},
    "agent": {
        "PEERLM_AGENT_ROUND_TIMEOUT_S": "10",
        "PEERLM_AGENT_LOCAL_STEPS": "2",
        "PEERLM_AGENT_EVAL_LIMIT": "2",
        "PEERLM_AGENT_TRANSFER_LIMIT": "4",
        "PEERLM_AGENT_MAX_NEW_TOKENS": "16",
        "PEERLM_AGENT_LIMITS__RPC_TIMEOUT_S": "5",
    },
}


def _run(args: list[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out


def _interpolate(value: str) -> str:
    """Compose's variable interpolation for the forms the file uses: ``$$``, ``${V:-d}``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return os.environ.get(m.group(1), m.group(2) or "")

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}", sub, value)


@dataclass
class Service:
    """One Compose service as this test runs it."""

    name: str
    spec: dict[str, Any]
    volumes_root: Path
    mounts: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for entry in self.spec.get("volumes", []):
            source, target = entry.split(":")[:2]
            if source.startswith("./"):
                self.mounts[target] = ROOT / source[2:]
            else:
                host = self.volumes_root / source
                host.mkdir(parents=True, exist_ok=True)
                self.mounts[target] = host

    def rewrite(self, text: str) -> str:
        """Container paths to this machine's paths (longest mount target first, one pass)."""
        targets = sorted(self.mounts, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(t) for t in targets))
        return pattern.sub(lambda m: str(self._host_path(m.group(0))), text)

    def _host_path(self, target: str) -> Path:
        source = self.mounts[target]
        if source.is_file() and str(source).startswith(str(ROOT)):
            return self._config_copy(target, source)
        return source

    def _config_copy(self, target: str, source: Path) -> Path:
        # A mounted config file names container paths too: hand the process a rewritten copy.
        copy = self.volumes_root / "config" / self.name / Path(target).name
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            others = {t: p for t, p in self.mounts.items() if t != target}
            text = source.read_text()
            pattern = re.compile("|".join(re.escape(t) for t in sorted(others, key=len)[::-1]))
            copy.write_text(pattern.sub(lambda m: str(others[m.group(0)]), text))
        return copy

    def argv(self, words: list[str] | None = None) -> list[str]:
        words = list(self.spec.get("command", [])) if words is None else words
        words = [self.rewrite(_interpolate(w)) for w in words]
        entry = self.spec.get("entrypoint")
        if entry:
            return [*entry, *words]
        return [*PY, *words]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        for key, value in (self.spec.get("environment") or {}).items():
            env[key] = self.rewrite(_interpolate(str(value)))
        env.update(extra or {})
        return env

    def healthcheck(self) -> list[str]:
        test = list(self.spec["healthcheck"]["test"])
        assert test[0] == "CMD", test
        words = test[1:]
        assert words[0] == "peerlm", words
        return [*PY, *[self.rewrite(w) for w in words[1:]]]


class Network:
    """A bridge with one namespace per host; cleans up everything it made."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"plm{self.tag}br"
        self.hosts: dict[str, str] = {}
        self.namespaces: dict[str, str] = {}
        self.host_veth: dict[str, str] = {}

    def ns(self, host: str) -> str:
        return self.namespaces[host]

    def create(self, names: list[str]) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, name in enumerate(names):
            self.hosts[name] = f"{SUBNET}.{10 + i}"
        lines = ["127.0.0.1 localhost"] + [f"{ip} {n}" for n, ip in self.hosts.items()]
        for i, name in enumerate(names):
            ns = f"plm{self.tag}-{name}"
            _run(["ip", "netns", "add", ns])
            self.namespaces[name] = ns
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            outside, inside = f"v{self.tag}{i}h", f"v{self.tag}{i}n"
            _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
            _run(["ip", "link", "set", inside, "netns", ns])
            _run(["ip", "link", "set", outside, "master", self.bridge, "up"])
            self.host_veth[name] = outside
            _run(["ip", "-n", ns, "link", "set", inside, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.hosts[name]}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def set_link(self, host: str, up: bool) -> None:
        _run(["ip", "link", "set", self.host_veth[host], "up" if up else "down"])

    def exec(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def destroy(self) -> None:
        for ns in self.namespaces.values():
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _run(["ip", "link", "del", self.bridge], check=False)


def _namespaces_usable() -> str | None:
    """None if this machine lets us build the network, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"plmprobe{secrets.token_hex(2)}"
    out = _run(["ip", "netns", "add", probe], check=False)
    if out.returncode != 0:
        return f"cannot create a network namespace: {out.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


@pytest.fixture
def network() -> Iterator[Network]:
    reason = _namespaces_usable()
    if reason:
        pytest.skip(reason)
    net = Network()
    try:
        yield net
    finally:
        net.destroy()


class Processes:
    """Long-running services; stopped (SIGTERM, then SIGKILL) whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
        )

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def log(self, name: str, tail: int = 3000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-tail:]

    def stop(self, name: str, timeout: float = 30) -> tuple[int, str]:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return proc.returncode, out.decode(errors="replace")

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                self.stop(name, timeout=15)


def _wait(what: str, check: Callable[[], bool], timeout: float, step: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


_SCRAPE = """
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
out = {}
for target in sys.argv[1:]:
    try:
        text = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
        out[target] = sorted({f.name for f in text_string_to_metric_families(text)})
    except OSError as err:
        out[target] = str(err)
print(json.dumps(out))
"""


def test_compose_services_across_network_namespaces(network: Network, tmp_path: Path) -> None:
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    volumes = tmp_path / "volumes"
    services = {name: Service(name, s, volumes) for name, s in spec.items()}

    # One-shot steps, as `depends_on: service_completed_successfully` orders them.
    certs = services["certs"]
    _run(certs.argv(), env=certs.env())
    ca = (volumes / "ca" / "ca.crt").read_bytes()
    _run(certs.argv(), env=certs.env())
    assert (volumes / "ca" / "ca.crt").read_bytes() == ca, "a rerun of certs replaced the CA"
    for name in ("cpm", *AGENTS):
        kit = sorted(p.name for p in (volumes / f"kit-{name}").iterdir())
        vrf = [f"{name}.vrf.key"] if name != "cpm" else []  # the certified overlay key
        assert kit == sorted(["ca.crt", f"{name}.crt", f"{name}.key", *vrf]), kit
    models = services["models"]
    words = list(models.spec["command"])
    words[words.index("--size") + 1] = "micro"
    _run(models.argv(words), env=models.env(), timeout=600)
    _run(services["data"].argv(), env=services["data"].env())
    targets_service = services["scrape-targets"]
    _run(targets_service.argv(), env=targets_service.env())

    overlay = _run([*PY, "overlay-node", "--help"], check=False).returncode == 0
    if not overlay:
        warnings.warn(
            "overlay-0 not started: `peerlm overlay-node --help` fails (command not merged yet)",
            stacklevel=1,
        )
    hosts = ["observer", "cpm", *(["overlay-0"] if overlay else []), *AGENTS]
    network.create(hosts)
    procs = Processes(tmp_path)
    admin_kit = volumes / "kit-admin"

    def status() -> dict[str, Any]:
        out = _run(
            network.exec("observer", [*PY, "status", "--cpm", "cpm:50051", "--pki-dir",
                                      str(admin_kit), "--name", "admin", "--json"]),
            check=False,
        )  # fmt: skip
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def agent_round(name: str) -> int:
        for a in status().get("agents", []):
            if a["name"] == name:
                return int(a["last_round"])
        return 0

    def healthy(name: str) -> bool:
        s = services[name]
        out = _run(network.exec(name, s.healthcheck()), check=False, env=s.env(), timeout=30)
        return out.returncode == 0

    def start(name: str, component: str) -> None:
        s = services[name]
        env = s.env(overrides.get(component))
        procs.start(name, network.exec(name, s.argv()), env)

    # The overlay's first build (network-wide schedule): soon enough to watch, late enough
    # for most agents to have joined first (a later one enters through the tree).
    genesis = str(time.time() + OVERLAY_GENESIS_DELAY_S)
    overrides = {
        **TEST_OVERRIDES,
        "overlay": {"PEERLM_OVERLAY_PROTOCOL__GENESIS_TIME": genesis},
        "agent": {
            **TEST_OVERRIDES["agent"],
            "PEERLM_AGENT_OVERLAY__PROTOCOL__GENESIS_TIME": genesis,
        },
    }
    try:
        start("cpm", "cpm")
        _wait("the CPM to be healthy", lambda: healthy("cpm") or not procs.alive("cpm"), 60)
        assert procs.alive("cpm"), procs.log("cpm")
        if overlay:
            start("overlay-0", "overlay")
            _wait("overlay-0 to be healthy", lambda: healthy("overlay-0"), 60)
        for name in AGENTS:
            start(name, "agent")
        for name in AGENTS:
            _wait(f"{name} to be healthy", lambda n=name: healthy(n) or not procs.alive(n), 120)
            assert procs.alive(name), procs.log(name)

        # Every agent completes two rounds across namespaces.
        _wait(
            "two rounds by every agent",
            lambda: all(agent_round(a) >= 2 for a in AGENTS),
            120,
            step=2,
        )
        # Every agent joined overlay-0 across namespaces, and after the build its searches
        # are answered (different model families: answers, not necessarily pulls).
        for name in AGENTS:
            assert '"event": "overlay_joined"' in procs.log(name, tail=10**7), procs.log(name)

        def answered(name: str) -> bool:
            log = procs.log(name, tail=10**7)
            return any(f'"outcome": "{o}"' in log for o in ANSWERED)

        _wait("an answered overlay search by every agent",
              lambda: all(answered(a) for a in AGENTS), 120, step=2)  # fmt: skip
        first = status()
        assert first["rewards_observed"] >= 1, first
        endpoints = {a["name"]: a["peer_endpoint"] for a in first["agents"]}
        assert endpoints == {a: f"{a}:50061" for a in AGENTS}, endpoints

        # Prometheus's view: every started target of the generated file-SD files.
        started = set(hosts)
        wanted: dict[str, str] = {}
        for file, expect in (("cpm.json", "peerlm_cpm_matchmaking_rounds"),
                             ("agents.json", "peerlm_agent_rounds"),
                             ("overlay.json", "")):  # fmt: skip
            for group in json.loads((volumes / "prometheus-targets" / file).read_text()):
                for target in group["targets"]:
                    if target.split(":")[0] in started:
                        wanted[target] = expect
        assert len(wanted) == 1 + len(AGENTS) + (1 if overlay else 0), wanted
        scraped = json.loads(
            _run(network.exec("observer", [sys.executable, "-c", _SCRAPE, *wanted])).stdout
        )
        for target, metric in wanted.items():
            assert isinstance(scraped[target], list), (target, scraped[target])
            assert not metric or metric in scraped[target], (target, scraped[target])

        # Cut one agent off: the others carry on.
        cut_round = agent_round(CUT)
        before = status()
        network.set_link(CUT, up=False)
        _wait(
            "a reward between the remaining agents while agent-2 is cut off",
            lambda: (
                status().get("rewards_observed", 0) > before["rewards_observed"]
                and status().get("matchmaking_rounds", 0) > before["matchmaking_rounds"]
            ),
            90,
            step=2,
        )
        # It notices (a profile submission times out) and keeps playing local rounds. Only
        # at its next submission: after the round it is in, which on a loaded 2-core machine
        # took more than the 60 s this once waited (CI of 2026-12-07).
        _wait(
            "agent-2 to find the CPM unreachable",
            lambda: '"event": "cpm_unreachable"' in procs.log(CUT, tail=10**7),
            180,
        )
        assert procs.alive(CUT), "the cut-off agent must keep running, not exit"
        during = agent_round(CUT)
        assert during <= cut_round + 1, (cut_round, during)

        # The link returns: the agent rejoins.
        network.set_link(CUT, up=True)
        restored = time.time()

        def rejoined() -> bool:
            for a in status().get("agents", []):
                if a["name"] == CUT and a["last_round"] > during:
                    age = a["last_profile_age_s"]
                    return age is not None and time.time() - age >= restored - 1
            return False

        _wait("agent-2 to send profiles again", rejoined, 90, step=2)

        summaries = {}
        for name in AGENTS:
            code, out = procs.stop(name)
            assert code == 0, (name, code, procs.log(name))
            summaries[name] = json.loads(out.strip().splitlines()[-1])
        assert all(s["rounds_completed"] >= 2 for s in summaries.values()), summaries
        assert summaries[CUT]["rounds_completed"] > during
        code, _ = procs.stop("cpm")
        assert code == 0, procs.log("cpm")
    finally:
        procs.stop_all()
