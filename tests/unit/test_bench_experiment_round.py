"""``peerlm bench experiment-round``: the two plans it times can be built from today's."""

from __future__ import annotations

import pytest
from peerlm.bench.experiment_round import BEFORE, compared_plans


@pytest.mark.parametrize("micro", [True, False])
def test_the_plan_before_is_todays_with_the_old_fields(micro: bool) -> None:
    # Today's default has several teachers a student and a bank per lacked category, which
    # the old plan's disjoint pairs and one shared adapter refuse: the old fields set both.
    before, after = compared_plans(micro)
    assert after.teachers_per_student == 2 and after.slot_banks == "category"
    assert before.size == after.size == ("micro" if micro else "tiny")
    for field, value in BEFORE.items():
        assert getattr(before, field) == value
    assert before.teachers_per_student == 1 and before.slot_banks == "one"
