"""CPM matchmaking benchmark on the synthetic federation (KNEXA-FL Figures 2 and 3).

    python bench/cpm.py [--quick] [--json] [--plots DIR] [--seeds N] [--rounds N]
                        [--sizes 8,16,32,64] [--jobs N] [--no-speed]

The same as ``peerlm bench cpm``; see docs/bench-cpm.md.
"""

from __future__ import annotations

import sys

from peerlm.cli_bench import app

if __name__ == "__main__":
    sys.exit(app(["cpm", *sys.argv[1:]], standalone_mode=True))
