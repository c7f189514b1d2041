"""Semantic overlay benchmark in the simulator (SemanticDFL Sec. 5.3-5.5).

    python bench/overlay.py [--peers 100,400,1000] [--k 10%] [--zone-cap 5%] [--churn 0.4]
                            [--loss P] [--seed S] [--rounds R] [--queries Q] [--no-hnsw]
                            [--json] [--plots DIR]

The same as ``peerlm bench overlay``; see docs/bench-overlay.md.
"""

from __future__ import annotations

import sys

from peerlm.cli_bench import app

if __name__ == "__main__":
    sys.exit(app(["overlay", *sys.argv[1:]], standalone_mode=True))
