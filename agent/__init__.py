"""The agent: a daemon hosting one LoRA-tuned model that learns with its peers (KNEXA-FL
student/teacher exchanges, SemanticDFL pulls).

What other packages (the application layer, benchmarks, other subsystems) may use is
exported here; the modules behind it are the agent's own and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peerlm.exports import lazy_exports

if TYPE_CHECKING:
    from peerlm.agent.cpm_client import CpmClient, next_directive
    from peerlm.agent.daemon import AgentDaemon, AgentSummary
    from peerlm.agent.guardrail import Guardrail
    from peerlm.agent.main import run_agent
    from peerlm.agent.modelhost import ModelHost
    from peerlm.agent.models.lora import LoraSettings
    from peerlm.agent.models.tiny import ARCHITECTURES, BuildEvent, ModelInfo, build_models
    from peerlm.agent.models.tiny import read_manifest as read_models_manifest
    from peerlm.agent.package import build_text_package, decode_package
    from peerlm.agent.peer_client import PeerExchangeError, fetch_package, pull_adapter
    from peerlm.agent.peer_service import PeerExchangeService
    from peerlm.agent.rounds import (
        ProfileInputs,
        RoundConfig,
        build_package,
        category_counts,
        evaluate_pass,
        integrate_package,
        local_update,
        round_profile,
        sample_completions,
        score_completions,
        teacher_completions,
    )
    from peerlm.agent.tasks.dataset import (
        Manifest,
        Problem,
        build_federation_data,
        category_histogram,
        read_jsonl,
        read_manifest,
        transfer_set_sha256,
    )
    from peerlm.agent.training import TrainSettings

#: Public name -> (module, attribute): imported on first use, so that importing the
#: package stays cheap (no torch, numpy or grpc until a name needs them).
_EXPORTS: dict[str, tuple[str, str]] = {
    "ARCHITECTURES": ("peerlm.agent.models.tiny", "ARCHITECTURES"),
    "AgentDaemon": ("peerlm.agent.daemon", "AgentDaemon"),
    "AgentSummary": ("peerlm.agent.daemon", "AgentSummary"),
    "BuildEvent": ("peerlm.agent.models.tiny", "BuildEvent"),
    "CpmClient": ("peerlm.agent.cpm_client", "CpmClient"),
    "Guardrail": ("peerlm.agent.guardrail", "Guardrail"),
    "LoraSettings": ("peerlm.agent.models.lora", "LoraSettings"),
    "Manifest": ("peerlm.agent.tasks.dataset", "Manifest"),
    "ModelHost": ("peerlm.agent.modelhost", "ModelHost"),
    "ModelInfo": ("peerlm.agent.models.tiny", "ModelInfo"),
    "PeerExchangeError": ("peerlm.agent.peer_client", "PeerExchangeError"),
    "PeerExchangeService": ("peerlm.agent.peer_service", "PeerExchangeService"),
    "Problem": ("peerlm.agent.tasks.dataset", "Problem"),
    "ProfileInputs": ("peerlm.agent.rounds", "ProfileInputs"),
    "RoundConfig": ("peerlm.agent.rounds", "RoundConfig"),
    "TrainSettings": ("peerlm.agent.training", "TrainSettings"),
    "build_federation_data": ("peerlm.agent.tasks.dataset", "build_federation_data"),
    "build_models": ("peerlm.agent.models.tiny", "build_models"),
    "build_package": ("peerlm.agent.rounds", "build_package"),
    "build_text_package": ("peerlm.agent.package", "build_text_package"),
    "category_counts": ("peerlm.agent.rounds", "category_counts"),
    "category_histogram": ("peerlm.agent.tasks.dataset", "category_histogram"),
    "decode_package": ("peerlm.agent.package", "decode_package"),
    "evaluate_pass": ("peerlm.agent.rounds", "evaluate_pass"),
    "fetch_package": ("peerlm.agent.peer_client", "fetch_package"),
    "integrate_package": ("peerlm.agent.rounds", "integrate_package"),
    "local_update": ("peerlm.agent.rounds", "local_update"),
    "next_directive": ("peerlm.agent.cpm_client", "next_directive"),
    "pull_adapter": ("peerlm.agent.peer_client", "pull_adapter"),
    "read_jsonl": ("peerlm.agent.tasks.dataset", "read_jsonl"),
    "read_manifest": ("peerlm.agent.tasks.dataset", "read_manifest"),
    "read_models_manifest": ("peerlm.agent.models.tiny", "read_manifest"),
    "round_profile": ("peerlm.agent.rounds", "round_profile"),
    "run_agent": ("peerlm.agent.main", "run_agent"),
    "sample_completions": ("peerlm.agent.rounds", "sample_completions"),
    "score_completions": ("peerlm.agent.rounds", "score_completions"),
    "teacher_completions": ("peerlm.agent.rounds", "teacher_completions"),
    "transfer_set_sha256": ("peerlm.agent.tasks.dataset", "transfer_set_sha256"),
}

__all__ = [
    "ARCHITECTURES",
    "AgentDaemon",
    "AgentSummary",
    "BuildEvent",
    "CpmClient",
    "Guardrail",
    "LoraSettings",
    "Manifest",
    "ModelHost",
    "ModelInfo",
    "PeerExchangeError",
    "PeerExchangeService",
    "Problem",
    "ProfileInputs",
    "RoundConfig",
    "TrainSettings",
    "build_federation_data",
    "build_models",
    "build_package",
    "build_text_package",
    "category_counts",
    "category_histogram",
    "decode_package",
    "evaluate_pass",
    "fetch_package",
    "integrate_package",
    "local_update",
    "next_directive",
    "pull_adapter",
    "read_jsonl",
    "read_manifest",
    "read_models_manifest",
    "round_profile",
    "run_agent",
    "sample_completions",
    "score_completions",
    "teacher_completions",
    "transfer_set_sha256",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
