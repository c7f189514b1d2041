"""Benchmarks and the synthetic environments they run in (``peerlm bench``, ``python bench/X.py``).

Nothing in the services, the agent or the overlay imports this package: it sits beside the
application layer and drives the subsystems' public faces.
"""
