"""Functional-correctness evaluation (pass@k) and the sandbox that runs model code."""
