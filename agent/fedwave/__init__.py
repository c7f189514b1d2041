"""FedWave (``papers/fedwave.md``): value-chain workflows of expert agents.

The foundations, as sans-IO library code (docs/fedwave.md maps each equation to its code):

* :mod:`~peerlm.agent.fedwave.workflow` — the :class:`Workflow` configuration type;
* :mod:`~peerlm.agent.fedwave.code_chain` — the generated code value chain (the data);
* :mod:`~peerlm.agent.fedwave.text_metrics` — Table 1's lexical metrics;
* :mod:`~peerlm.agent.fedwave.vclayer` — the VCLayer (Eq. 1) around a causal LM;
* :mod:`~peerlm.agent.fedwave.collab_loss` — the collaborative loss (Eq. 2-6);
* :mod:`~peerlm.agent.fedwave.router` — the MoE router, its losses and FedAvg (Eq. 7-9);
* :mod:`~peerlm.agent.fedwave.dpo` — the DPO loss (Eq. 10);
* :mod:`~peerlm.agent.fedwave.assembly` — the assembled π_SFT (the router's top-2 mixture);
* :mod:`~peerlm.agent.fedwave.dpo_phase` — the router-made preference pairs and the DPO phase;
* :mod:`~peerlm.agent.fedwave.simulation` — one workflow simulated under FedWave, FedAvg and
  the ablations (``peerlm run-workflow-experiment``);
* :mod:`~peerlm.agent.fedwave.settings` — the ``fedwave:`` section of the agent's settings;
* :mod:`~peerlm.agent.fedwave.exchange` — what a workflow's agents exchange (sans-IO), with
  its gRPC service (:mod:`~peerlm.agent.fedwave.exchange_service`) and client
  (:mod:`~peerlm.agent.fedwave.exchange_client`);
* :mod:`~peerlm.agent.fedwave.expert_round` — one expert round without I/O (training, the
  round's router aggregate), driven by :mod:`~peerlm.agent.fedwave.expert_loop` in the agent.
* :mod:`~peerlm.agent.fedwave.expert_assembly` — π_SFT in the agent after the last round
  (the stages' experts pulled, assembled, aligned by DPO, scored), driven by the same loop.
"""
