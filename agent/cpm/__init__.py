"""The agent's side of the CPM: the client, the directives it delivered, the profile sent."""
