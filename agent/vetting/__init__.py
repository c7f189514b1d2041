"""What an agent shares and receives is vetted here: the Guardrail and incoming-package checks."""
