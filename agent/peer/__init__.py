"""The PeerExchange transport: package and adapter streams between agents, under a send budget."""
