"""SemanticDFL's client side: the agent as an overlay node and its pull step."""
