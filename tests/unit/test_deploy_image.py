"""deploy/Dockerfile: the properties the issue asks of the image, checked statically.

No Docker engine runs here, so the image is not built in CI; these checks read the file.
"""

from __future__ import annotations

import json
import re

from tests.deploy_tools import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _stages() -> list[tuple[str, list[str]]]:
    stages: list[tuple[str, list[str]]] = []
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
    return stages


def test_multi_stage_with_a_slim_runtime_and_cpu_or_cuda_torch() -> None:
    stages = _stages()
    assert len(stages) >= 3
    final, body = stages[-1]
    assert re.match(r"FROM python:\$\{PYTHON_VERSION\}-slim AS runtime", final), final
    text = DOCKERFILE.read_text()
    assert "ARG VARIANT=cpu" in text and "FROM torch-${VARIANT} AS app" in text
    assert "download.pytorch.org/whl/cpu" in text and "whl/cu" in text
    # Only the finished environment reaches the final stage: no pip, compilers or sources.
    assert any(line.startswith("COPY --from=app /opt/peerlm") for line in body)
    joined = " ".join(body)
    for forbidden in ("pip install", "apt-get", "gcc", "build-essential", "COPY . "):
        assert forbidden not in joined, forbidden
    assert "pip uninstall -y pip" in text


def test_non_root_volumes_healthcheck_and_entrypoint() -> None:
    body = " ".join(_stages()[-1][1])
    assert re.search(r"USER 10001(:10001)?\b", body)
    volumes = json.loads(re.search(r"VOLUME (\[.*?\])", body).group(1))  # type: ignore[union-attr]
    assert set(volumes) == {"/var/lib/peerlm", "/etc/peerlm/pki"}
    health = re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", body)
    assert health is not None
    assert json.loads(health.group(1))[:2] == ["peerlm", "health"]
    assert 'ENTRYPOINT ["peerlm"]' in body


def test_no_model_weights_or_data_in_the_image() -> None:
    text = DOCKERFILE.read_text()
    assert "models build" not in text.split("FROM python:${PYTHON_VERSION}-slim AS runtime")[1]
    copies = re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M)
    for copy in copies:
        assert not re.search(r"\b(state|data|models|\.venv)\b", copy), copy
    # The build context is an allow-list: .venv, state/ and data never reach the builder.
    ignore = [
        line
        for line in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[0] == "**" and all(line.startswith(("!", "**/")) for line in ignore[1:])


def test_size_is_stated_in_the_docs() -> None:
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert re.search(r"estimate", ops, flags=re.I) and re.search(r"\d(\.\d)? GB", ops)
