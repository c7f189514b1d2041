"""The expert probe's own arithmetic: the Wilson interval and the literal normaliser."""

from __future__ import annotations

import pytest

from peerlm.app.expert_probe import normalise_literals, wilson


def test_wilson_interval() -> None:
    low, high = wilson(12, 40)
    assert low < 12 / 40 < high
    assert (round(low, 3), round(high, 3)) == (0.181, 0.454)
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("return x * 7 + 3\n", "return x * 2 + 9\n", True),  # right body, wrong constants
        ('return "|".join([s] * 4)\n', 'return ",".join([s] * 2)\n', True),
        ("return x * 7 + 3\n", "return x + 7 * 3\n", False),
        (
            "if x > 1:\n        return 'a'\n    return 'b'\n",
            "return 'a' if x > 1 else 'b'\n",
            False,
        ),
    ],
)
def test_normalise_literals(a: str, b: str, same: bool) -> None:
    assert (normalise_literals(a) == normalise_literals(b)) is same
