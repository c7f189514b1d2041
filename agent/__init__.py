"""The agent: a daemon hosting one LoRA-tuned model that learns with its peers (KNEXA-FL
student/teacher exchanges, SemanticDFL pulls, OnePeFT aggregation of LoRA adapters).

What other packages (the application layer, benchmarks, other subsystems) may use is
exported here; the modules behind it are the agent's own and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peerlm.exports import lazy_exports

if TYPE_CHECKING:
    from peerlm.agent.acceptance import AcceptanceGate
    from peerlm.agent.adapter_codec import AdapterSpec, encode_adapter, state_digest
    from peerlm.agent.cpm.client import CpmClient, next_directive, rest_of_round
    from peerlm.agent.cpm.directives import DirectiveBook
    from peerlm.agent.cpm.profile import host_parameter_space
    from peerlm.agent.daemon import AgentDaemon, AgentSummary
    from peerlm.agent.eval.evaluation import evaluate, structural_match_rate
    from peerlm.agent.exchange.answer_check import (
        ANSWER_CHECKS,
        AnswerCheck,
        CheckedAnswers,
        check_answers,
    )
    from peerlm.agent.exchange.package import build_text_package, decode_package
    from peerlm.agent.exchange.peer_knowledge import InputRouter, PeerSlot, route_map
    from peerlm.agent.exchange.protocol import (
        CpmReporter,
        ExchangeContext,
        ExchangeProtocol,
        ProtocolRegistry,
    )
    from peerlm.agent.exchange.registry import agent_registry
    from peerlm.agent.exchange.reward_probe import AnsweredProbe
    from peerlm.agent.exchange.rounds import (
        Integration,
        ProfileInputs,
        RoundConfig,
        build_package,
        category_counts,
        evaluate_pass,
        integrate_package,
        local_update,
        reference_nll,
        reward_eq3,
        round_profile,
        sample_completions,
        score_completions,
        teacher_completions,
    )
    from peerlm.agent.exchange.self_check import example_verdicts, self_check
    from peerlm.agent.exchange.teaching import (
        Competence,
        TeachScope,
        competence_of,
        teachable_indices,
    )
    from peerlm.agent.fedproxy.codec import encode_proxy, encode_update
    from peerlm.agent.fedproxy.cohort import (
        PROXY_MERGES,
        CompressedProxy,
        ProxyMerge,
        compress_by_influence,
        merge_proxies,
        uses_pcr,
    )
    from peerlm.agent.fedproxy.compress import (
        block_influence,
        blocks_to_keep,
        kept_count,
        token_batches,
    )
    from peerlm.agent.fedproxy.hties import (
        CohortAnalysis,
        HTiesResult,
        fedavg_proxies,
        h_ties,
        ties_merge,
    )
    from peerlm.agent.fedproxy.member import text_trainer
    from peerlm.agent.fedproxy.pcr import ConflictRegulariser, pcr_penalty
    from peerlm.agent.fedproxy.proxy import ProxyError, build_proxy, fuse_into, proxy_info
    from peerlm.agent.fedproxy.tuning import ProxyTunedHost
    from peerlm.agent.fedwave.assembly import AssembledModel, assembled_generate
    from peerlm.agent.fedwave.chain_tasks import score_chain_tasks
    from peerlm.agent.fedwave.code_chain import CODE_CHAIN_STAGES, build_code_chain
    from peerlm.agent.fedwave.dpo_phase import build_preference_pairs, run_dpo_phase
    from peerlm.agent.fedwave.exchange import PartKind, PartStore, ShapeBounds
    from peerlm.agent.fedwave.exchange_client import aggregate_round_routers, pull_round
    from peerlm.agent.fedwave.exchange_service import FedWaveExchangeService, serve_fedwave
    from peerlm.agent.fedwave.expert_step import encode_stage_examples, expert_loss
    from peerlm.agent.fedwave.generation import greedy_generate
    from peerlm.agent.fedwave.router_codec import encode_router, router_shapes
    from peerlm.agent.fedwave.settings import FedWaveSettings
    from peerlm.agent.fedwave.simulation import (
        BASELINES as FEDWAVE_BASELINES,
    )
    from peerlm.agent.fedwave.simulation import (
        DEFAULT_STRATEGIES as FEDWAVE_DEFAULT_STRATEGIES,
    )
    from peerlm.agent.fedwave.simulation import (
        STRATEGIES as FEDWAVE_STRATEGIES,
    )
    from peerlm.agent.fedwave.simulation import (
        SimulationConfig as FedWaveSimulationConfig,
    )
    from peerlm.agent.fedwave.simulation import (
        StrategyResult as FedWaveStrategyResult,
    )
    from peerlm.agent.fedwave.simulation import (
        score_strategy as score_fedwave_strategy,
    )
    from peerlm.agent.fedwave.simulation import (
        simulate_strategy as simulate_fedwave_strategy,
    )
    from peerlm.agent.fedwave.text_metrics import corpus_scores
    from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer, encode_vclayer
    from peerlm.agent.fedwave.workflow import Workflow
    from peerlm.agent.main import run_agent
    from peerlm.agent.merging.lora_merge import (
        ClientAdapter,
        MergedAdapter,
        aggregate_fedavg_factors,
        aggregate_ffa,
        aggregate_svd,
        delta_weights,
        normalise_weights,
    )
    from peerlm.agent.merging.onepeft import OneShotResult, one_shot
    from peerlm.agent.merging.pull_aggregate import (
        Candidate,
        PullReport,
        PullSettings,
        integrate_adapters,
        pull_and_aggregate,
    )
    from peerlm.agent.metrics import AgentTelemetry
    from peerlm.agent.modelhost import ModelHost
    from peerlm.agent.models.lora import LoraSettings, apply_lora
    from peerlm.agent.models.tiny import (
        ARCHITECTURES,
        DEFAULT_HIDDEN,
        SHIPPED_DIR,
        BuildEvent,
        ModelInfo,
        build_models,
    )
    from peerlm.agent.models.tiny import read_manifest as read_models_manifest
    from peerlm.agent.overlay_client.step import pull_settings, signature_inputs
    from peerlm.agent.peer.client import (
        PeerExchangeError,
        fetch_package,
        pull_adapter,
        pull_adapter_with_round,
    )
    from peerlm.agent.peer.service import PeerExchangeService, serve_peer
    from peerlm.agent.peer.transport import GrpcPeers, PeerTransport
    from peerlm.agent.peer_integration import (
        INTEGRATIONS,
        in_slot,
        learnt_anything,
        slot_learns,
        slot_runner,
    )
    from peerlm.agent.settings import AgentOverlaySettings, AgentSettings
    from peerlm.agent.tasks.bank import (
        CATEGORIES,
        function_key,
        generate_bank,
        probe_problems,
        public_problems,
    )
    from peerlm.agent.tasks.copy_drills import held_out_drills
    from peerlm.agent.tasks.dataset import (
        Manifest,
        Problem,
        build_federation_data,
        category_histogram,
        read_jsonl,
        read_manifest,
        transfer_set_sha256,
        write_jsonl,
    )
    from peerlm.agent.tasks.world import DEFAULT_PRIVATE_CATEGORIES, World, WorldSpec
    from peerlm.agent.training import TrainSettings
    from peerlm.agent.vetting.code_index import code_tokens
    from peerlm.agent.vetting.guardrail import Guardrail, agent_guardrail

#: Public name -> (module, attribute): imported on first use, so that importing the
#: package stays cheap (no torch, numpy or grpc until a name needs them).
_EXPORTS: dict[str, tuple[str, str]] = {
    "Candidate": ("peerlm.agent.merging.pull_aggregate", "Candidate"),
    "PullReport": ("peerlm.agent.merging.pull_aggregate", "PullReport"),
    "pull_and_aggregate": ("peerlm.agent.merging.pull_aggregate", "pull_and_aggregate"),
    "AgentTelemetry": ("peerlm.agent.metrics", "AgentTelemetry"),
    "CpmReporter": ("peerlm.agent.exchange.protocol", "CpmReporter"),
    "ExchangeContext": ("peerlm.agent.exchange.protocol", "ExchangeContext"),
    "ExchangeProtocol": ("peerlm.agent.exchange.protocol", "ExchangeProtocol"),
    "ProtocolRegistry": ("peerlm.agent.exchange.protocol", "ProtocolRegistry"),
    "agent_registry": ("peerlm.agent.exchange.registry", "agent_registry"),
    "GrpcPeers": ("peerlm.agent.peer.transport", "GrpcPeers"),
    "PeerTransport": ("peerlm.agent.peer.transport", "PeerTransport"),
    "INTEGRATIONS": ("peerlm.agent.peer_integration", "INTEGRATIONS"),
    "slot_runner": ("peerlm.agent.peer_integration", "slot_runner"),
    "in_slot": ("peerlm.agent.peer_integration", "in_slot"),
    "learnt_anything": ("peerlm.agent.peer_integration", "learnt_anything"),
    "slot_learns": ("peerlm.agent.peer_integration", "slot_learns"),
    "AgentOverlaySettings": ("peerlm.agent.settings", "AgentOverlaySettings"),
    "AgentSettings": ("peerlm.agent.settings", "AgentSettings"),
    "pull_settings": ("peerlm.agent.overlay_client.step", "pull_settings"),
    "signature_inputs": ("peerlm.agent.overlay_client.step", "signature_inputs"),
    "pull_adapter_with_round": ("peerlm.agent.peer.client", "pull_adapter_with_round"),
    "agent_guardrail": ("peerlm.agent.vetting.guardrail", "agent_guardrail"),
    "DEFAULT_HIDDEN": ("peerlm.agent.models.tiny", "DEFAULT_HIDDEN"),
    "ARCHITECTURES": ("peerlm.agent.models.tiny", "ARCHITECTURES"),
    "AdapterSpec": ("peerlm.agent.adapter_codec", "AdapterSpec"),
    "AgentDaemon": ("peerlm.agent.daemon", "AgentDaemon"),
    "AgentSummary": ("peerlm.agent.daemon", "AgentSummary"),
    "BuildEvent": ("peerlm.agent.models.tiny", "BuildEvent"),
    "CATEGORIES": ("peerlm.agent.tasks.bank", "CATEGORIES"),
    "CpmClient": ("peerlm.agent.cpm.client", "CpmClient"),
    "DEFAULT_PRIVATE_CATEGORIES": ("peerlm.agent.tasks.world", "DEFAULT_PRIVATE_CATEGORIES"),
    "DirectiveBook": ("peerlm.agent.cpm.directives", "DirectiveBook"),
    "Guardrail": ("peerlm.agent.vetting.guardrail", "Guardrail"),
    "Integration": ("peerlm.agent.exchange.rounds", "Integration"),
    "LoraSettings": ("peerlm.agent.models.lora", "LoraSettings"),
    "Manifest": ("peerlm.agent.tasks.dataset", "Manifest"),
    "ModelHost": ("peerlm.agent.modelhost", "ModelHost"),
    "ModelInfo": ("peerlm.agent.models.tiny", "ModelInfo"),
    "PeerExchangeError": ("peerlm.agent.peer.client", "PeerExchangeError"),
    "PeerExchangeService": ("peerlm.agent.peer.service", "PeerExchangeService"),
    "Problem": ("peerlm.agent.tasks.dataset", "Problem"),
    "ProfileInputs": ("peerlm.agent.exchange.rounds", "ProfileInputs"),
    "RoundConfig": ("peerlm.agent.exchange.rounds", "RoundConfig"),
    "TrainSettings": ("peerlm.agent.training", "TrainSettings"),
    "World": ("peerlm.agent.tasks.world", "World"),
    "WorldSpec": ("peerlm.agent.tasks.world", "WorldSpec"),
    "build_federation_data": ("peerlm.agent.tasks.dataset", "build_federation_data"),
    "build_models": ("peerlm.agent.models.tiny", "build_models"),
    "held_out_drills": ("peerlm.agent.tasks.copy_drills", "held_out_drills"),
    "build_package": ("peerlm.agent.exchange.rounds", "build_package"),
    "build_text_package": ("peerlm.agent.exchange.package", "build_text_package"),
    "category_counts": ("peerlm.agent.exchange.rounds", "category_counts"),
    "category_histogram": ("peerlm.agent.tasks.dataset", "category_histogram"),
    "code_tokens": ("peerlm.agent.vetting.code_index", "code_tokens"),
    "decode_package": ("peerlm.agent.exchange.package", "decode_package"),
    "encode_adapter": ("peerlm.agent.adapter_codec", "encode_adapter"),
    "state_digest": ("peerlm.agent.adapter_codec", "state_digest"),
    "evaluate": ("peerlm.agent.eval.evaluation", "evaluate"),
    "evaluate_pass": ("peerlm.agent.exchange.rounds", "evaluate_pass"),
    "fetch_package": ("peerlm.agent.peer.client", "fetch_package"),
    "function_key": ("peerlm.agent.tasks.bank", "function_key"),
    "generate_bank": ("peerlm.agent.tasks.bank", "generate_bank"),
    "integrate_package": ("peerlm.agent.exchange.rounds", "integrate_package"),
    "local_update": ("peerlm.agent.exchange.rounds", "local_update"),
    "next_directive": ("peerlm.agent.cpm.client", "next_directive"),
    "rest_of_round": ("peerlm.agent.cpm.client", "rest_of_round"),
    "probe_problems": ("peerlm.agent.tasks.bank", "probe_problems"),
    "public_problems": ("peerlm.agent.tasks.bank", "public_problems"),
    "pull_adapter": ("peerlm.agent.peer.client", "pull_adapter"),
    "read_jsonl": ("peerlm.agent.tasks.dataset", "read_jsonl"),
    "read_manifest": ("peerlm.agent.tasks.dataset", "read_manifest"),
    "read_models_manifest": ("peerlm.agent.models.tiny", "read_manifest"),
    "reference_nll": ("peerlm.agent.exchange.rounds", "reference_nll"),
    "round_profile": ("peerlm.agent.exchange.rounds", "round_profile"),
    "run_agent": ("peerlm.agent.main", "run_agent"),
    "sample_completions": ("peerlm.agent.exchange.rounds", "sample_completions"),
    "score_completions": ("peerlm.agent.exchange.rounds", "score_completions"),
    "serve_peer": ("peerlm.agent.peer.service", "serve_peer"),
    "self_check": ("peerlm.agent.exchange.self_check", "self_check"),
    "example_verdicts": ("peerlm.agent.exchange.self_check", "example_verdicts"),
    "AnswerCheck": ("peerlm.agent.exchange.answer_check", "AnswerCheck"),
    "ANSWER_CHECKS": ("peerlm.agent.exchange.answer_check", "ANSWER_CHECKS"),
    "CheckedAnswers": ("peerlm.agent.exchange.answer_check", "CheckedAnswers"),
    "check_answers": ("peerlm.agent.exchange.answer_check", "check_answers"),
    "structural_match_rate": ("peerlm.agent.eval.evaluation", "structural_match_rate"),
    "teacher_completions": ("peerlm.agent.exchange.rounds", "teacher_completions"),
    "transfer_set_sha256": ("peerlm.agent.tasks.dataset", "transfer_set_sha256"),
    "write_jsonl": ("peerlm.agent.tasks.dataset", "write_jsonl"),
    "AcceptanceGate": ("peerlm.agent.acceptance", "AcceptanceGate"),
    "host_parameter_space": ("peerlm.agent.cpm.profile", "host_parameter_space"),
    "PullSettings": ("peerlm.agent.merging.pull_aggregate", "PullSettings"),
    "integrate_adapters": ("peerlm.agent.merging.pull_aggregate", "integrate_adapters"),
    "reward_eq3": ("peerlm.agent.exchange.rounds", "reward_eq3"),
    "Competence": ("peerlm.agent.exchange.teaching", "Competence"),
    "TeachScope": ("peerlm.agent.exchange.teaching", "TeachScope"),
    "competence_of": ("peerlm.agent.exchange.teaching", "competence_of"),
    "teachable_indices": ("peerlm.agent.exchange.teaching", "teachable_indices"),
    "InputRouter": ("peerlm.agent.exchange.peer_knowledge", "InputRouter"),
    "PeerSlot": ("peerlm.agent.exchange.peer_knowledge", "PeerSlot"),
    "route_map": ("peerlm.agent.exchange.peer_knowledge", "route_map"),
    "AnsweredProbe": ("peerlm.agent.exchange.reward_probe", "AnsweredProbe"),
    "ClientAdapter": ("peerlm.agent.merging.lora_merge", "ClientAdapter"),
    "MergedAdapter": ("peerlm.agent.merging.lora_merge", "MergedAdapter"),
    "aggregate_fedavg_factors": ("peerlm.agent.merging.lora_merge", "aggregate_fedavg_factors"),
    "aggregate_ffa": ("peerlm.agent.merging.lora_merge", "aggregate_ffa"),
    "aggregate_svd": ("peerlm.agent.merging.lora_merge", "aggregate_svd"),
    "delta_weights": ("peerlm.agent.merging.lora_merge", "delta_weights"),
    "normalise_weights": ("peerlm.agent.merging.lora_merge", "normalise_weights"),
    "one_shot": ("peerlm.agent.merging.onepeft", "one_shot"),
    "OneShotResult": ("peerlm.agent.merging.onepeft", "OneShotResult"),
    "ProxyError": ("peerlm.agent.fedproxy.proxy", "ProxyError"),
    "ProxyTunedHost": ("peerlm.agent.fedproxy.tuning", "ProxyTunedHost"),
    "block_influence": ("peerlm.agent.fedproxy.compress", "block_influence"),
    "PROXY_MERGES": ("peerlm.agent.fedproxy.cohort", "PROXY_MERGES"),
    "encode_proxy": ("peerlm.agent.fedproxy.codec", "encode_proxy"),
    "encode_update": ("peerlm.agent.fedproxy.codec", "encode_update"),
    "text_trainer": ("peerlm.agent.fedproxy.member", "text_trainer"),
    "CompressedProxy": ("peerlm.agent.fedproxy.cohort", "CompressedProxy"),
    "ProxyMerge": ("peerlm.agent.fedproxy.cohort", "ProxyMerge"),
    "compress_by_influence": ("peerlm.agent.fedproxy.cohort", "compress_by_influence"),
    "merge_proxies": ("peerlm.agent.fedproxy.cohort", "merge_proxies"),
    "uses_pcr": ("peerlm.agent.fedproxy.cohort", "uses_pcr"),
    "blocks_to_keep": ("peerlm.agent.fedproxy.compress", "blocks_to_keep"),
    "build_proxy": ("peerlm.agent.fedproxy.proxy", "build_proxy"),
    "fuse_into": ("peerlm.agent.fedproxy.proxy", "fuse_into"),
    "kept_count": ("peerlm.agent.fedproxy.compress", "kept_count"),
    "proxy_info": ("peerlm.agent.fedproxy.proxy", "proxy_info"),
    "token_batches": ("peerlm.agent.fedproxy.compress", "token_batches"),
    "CohortAnalysis": ("peerlm.agent.fedproxy.hties", "CohortAnalysis"),
    "HTiesResult": ("peerlm.agent.fedproxy.hties", "HTiesResult"),
    "fedavg_proxies": ("peerlm.agent.fedproxy.hties", "fedavg_proxies"),
    "h_ties": ("peerlm.agent.fedproxy.hties", "h_ties"),
    "ties_merge": ("peerlm.agent.fedproxy.hties", "ties_merge"),
    "ConflictRegulariser": ("peerlm.agent.fedproxy.pcr", "ConflictRegulariser"),
    "pcr_penalty": ("peerlm.agent.fedproxy.pcr", "pcr_penalty"),
    # FedWave foundations (docs/fedwave.md)
    "CODE_CHAIN_STAGES": ("peerlm.agent.fedwave.code_chain", "CODE_CHAIN_STAGES"),
    "SHIPPED_DIR": ("peerlm.agent.models.tiny", "SHIPPED_DIR"),
    "VCCausalLM": ("peerlm.agent.fedwave.vclayer", "VCCausalLM"),
    "VCLayer": ("peerlm.agent.fedwave.vclayer", "VCLayer"),
    "Workflow": ("peerlm.agent.fedwave.workflow", "Workflow"),
    "apply_lora": ("peerlm.agent.models.lora", "apply_lora"),
    "build_code_chain": ("peerlm.agent.fedwave.code_chain", "build_code_chain"),
    "corpus_scores": ("peerlm.agent.fedwave.text_metrics", "corpus_scores"),
    "encode_stage_examples": ("peerlm.agent.fedwave.expert_step", "encode_stage_examples"),
    "expert_loss": ("peerlm.agent.fedwave.expert_step", "expert_loss"),
    "greedy_generate": ("peerlm.agent.fedwave.generation", "greedy_generate"),
    "score_chain_tasks": ("peerlm.agent.fedwave.chain_tasks", "score_chain_tasks"),
    # FedWave exchange among a workflow's agents (docs/fedwave.md, section 4)
    "FedWaveExchangeService": ("peerlm.agent.fedwave.exchange_service", "FedWaveExchangeService"),
    "serve_fedwave": ("peerlm.agent.fedwave.exchange_service", "serve_fedwave"),
    "FedWaveSettings": ("peerlm.agent.fedwave.settings", "FedWaveSettings"),
    "PartKind": ("peerlm.agent.fedwave.exchange", "PartKind"),
    "PartStore": ("peerlm.agent.fedwave.exchange", "PartStore"),
    "ShapeBounds": ("peerlm.agent.fedwave.exchange", "ShapeBounds"),
    "pull_round": ("peerlm.agent.fedwave.exchange_client", "pull_round"),
    "aggregate_round_routers": ("peerlm.agent.fedwave.exchange_client", "aggregate_round_routers"),
    "encode_router": ("peerlm.agent.fedwave.router_codec", "encode_router"),
    "router_shapes": ("peerlm.agent.fedwave.router_codec", "router_shapes"),
    "encode_vclayer": ("peerlm.agent.fedwave.vclayer", "encode_vclayer"),
    # FedWave's assembled model, DPO phase and workflow simulation (docs/fedwave.md, 3 and 5)
    "AssembledModel": ("peerlm.agent.fedwave.assembly", "AssembledModel"),
    "assembled_generate": ("peerlm.agent.fedwave.assembly", "assembled_generate"),
    "build_preference_pairs": ("peerlm.agent.fedwave.dpo_phase", "build_preference_pairs"),
    "run_dpo_phase": ("peerlm.agent.fedwave.dpo_phase", "run_dpo_phase"),
    "FEDWAVE_STRATEGIES": ("peerlm.agent.fedwave.simulation", "STRATEGIES"),
    "FEDWAVE_BASELINES": ("peerlm.agent.fedwave.simulation", "BASELINES"),
    "FEDWAVE_DEFAULT_STRATEGIES": ("peerlm.agent.fedwave.simulation", "DEFAULT_STRATEGIES"),
    "FedWaveSimulationConfig": ("peerlm.agent.fedwave.simulation", "SimulationConfig"),
    "FedWaveStrategyResult": ("peerlm.agent.fedwave.simulation", "StrategyResult"),
    "score_fedwave_strategy": ("peerlm.agent.fedwave.simulation", "score_strategy"),
    "simulate_fedwave_strategy": ("peerlm.agent.fedwave.simulation", "simulate_strategy"),
}

__all__ = [
    "ANSWER_CHECKS",
    "ARCHITECTURES",
    "CATEGORIES",
    "CODE_CHAIN_STAGES",
    "DEFAULT_HIDDEN",
    "DEFAULT_PRIVATE_CATEGORIES",
    "FEDWAVE_BASELINES",
    "FEDWAVE_DEFAULT_STRATEGIES",
    "FEDWAVE_STRATEGIES",
    "INTEGRATIONS",
    "PROXY_MERGES",
    "SHIPPED_DIR",
    "AcceptanceGate",
    "AdapterSpec",
    "AgentDaemon",
    "AgentOverlaySettings",
    "AgentSettings",
    "AgentSummary",
    "AgentTelemetry",
    "AnswerCheck",
    "AnsweredProbe",
    "AssembledModel",
    "BuildEvent",
    "Candidate",
    "CheckedAnswers",
    "ClientAdapter",
    "CohortAnalysis",
    "Competence",
    "CompressedProxy",
    "ConflictRegulariser",
    "CpmClient",
    "CpmReporter",
    "DirectiveBook",
    "ExchangeContext",
    "ExchangeProtocol",
    "FedWaveExchangeService",
    "FedWaveSettings",
    "FedWaveSimulationConfig",
    "FedWaveStrategyResult",
    "GrpcPeers",
    "Guardrail",
    "HTiesResult",
    "InputRouter",
    "Integration",
    "LoraSettings",
    "Manifest",
    "MergedAdapter",
    "ModelHost",
    "ModelInfo",
    "OneShotResult",
    "PartKind",
    "PartStore",
    "PeerExchangeError",
    "PeerExchangeService",
    "PeerSlot",
    "PeerTransport",
    "Problem",
    "ProfileInputs",
    "ProtocolRegistry",
    "ProxyError",
    "ProxyMerge",
    "ProxyTunedHost",
    "PullReport",
    "PullSettings",
    "RoundConfig",
    "ShapeBounds",
    "TeachScope",
    "TrainSettings",
    "VCCausalLM",
    "VCLayer",
    "Workflow",
    "World",
    "WorldSpec",
    "agent_guardrail",
    "agent_registry",
    "aggregate_fedavg_factors",
    "aggregate_ffa",
    "aggregate_round_routers",
    "aggregate_svd",
    "apply_lora",
    "assembled_generate",
    "block_influence",
    "blocks_to_keep",
    "build_code_chain",
    "build_federation_data",
    "build_models",
    "build_package",
    "build_preference_pairs",
    "build_proxy",
    "build_text_package",
    "category_counts",
    "category_histogram",
    "check_answers",
    "code_tokens",
    "competence_of",
    "compress_by_influence",
    "corpus_scores",
    "decode_package",
    "delta_weights",
    "encode_adapter",
    "encode_proxy",
    "encode_router",
    "encode_stage_examples",
    "encode_update",
    "encode_vclayer",
    "evaluate",
    "evaluate_pass",
    "example_verdicts",
    "expert_loss",
    "fedavg_proxies",
    "fetch_package",
    "function_key",
    "fuse_into",
    "generate_bank",
    "greedy_generate",
    "h_ties",
    "held_out_drills",
    "host_parameter_space",
    "in_slot",
    "integrate_adapters",
    "integrate_package",
    "kept_count",
    "learnt_anything",
    "local_update",
    "merge_proxies",
    "next_directive",
    "normalise_weights",
    "one_shot",
    "pcr_penalty",
    "probe_problems",
    "proxy_info",
    "public_problems",
    "pull_adapter",
    "pull_adapter_with_round",
    "pull_and_aggregate",
    "pull_round",
    "pull_settings",
    "read_jsonl",
    "read_manifest",
    "read_models_manifest",
    "reference_nll",
    "rest_of_round",
    "reward_eq3",
    "round_profile",
    "route_map",
    "router_shapes",
    "run_agent",
    "run_dpo_phase",
    "sample_completions",
    "score_chain_tasks",
    "score_completions",
    "score_fedwave_strategy",
    "self_check",
    "serve_fedwave",
    "serve_peer",
    "signature_inputs",
    "simulate_fedwave_strategy",
    "slot_learns",
    "slot_runner",
    "state_digest",
    "structural_match_rate",
    "teachable_indices",
    "teacher_completions",
    "text_trainer",
    "ties_merge",
    "token_batches",
    "transfer_set_sha256",
    "uses_pcr",
    "write_jsonl",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
