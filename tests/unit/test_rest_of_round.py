"""``rest_of_round``: the further directives of a round's matchmaking round, for the
daemon and the simulated agent (several under the CPM's ``pairing: per_student``)."""

from __future__ import annotations

import asyncio

from peerlm.agent.cpm.client import rest_of_round

from peerlm.wire.v1 import cpm_pb2


def directive(i: str, round_: int, role: int = cpm_pb2.EXCHANGE_ROLE_TEACHER) -> cpm_pb2.Directive:
    return cpm_pb2.Directive(directive_id=i, matchmaking_round=round_, role=role)


def test_it_takes_the_rounds_directives_and_leaves_the_next_rounds() -> None:
    async def run() -> tuple[list[str], list[str]]:
        inbox: asyncio.Queue[cpm_pb2.Directive] = asyncio.Queue()
        for d in (
            directive("b", 3),
            directive("notice", 3, cpm_pb2.EXCHANGE_ROLE_UNMATCHED),
            directive("c", 3, cpm_pb2.EXCHANGE_ROLE_STUDENT),
            directive("next", 4),
            directive("after", 4),
        ):
            inbox.put_nowait(d)
        rest = await rest_of_round(inbox, directive("a", 3), settle_s=0.0)
        left = [inbox.get_nowait().directive_id for _ in range(inbox.qsize())]
        return [d.directive_id for d in rest], left

    rest, left = asyncio.run(run())
    assert rest == ["b", "c"]  # the notice is dropped: the round has its pairing
    assert sorted(left) == ["after", "next"]  # the next round's stay queued


def test_it_waits_the_settle_time_for_late_ones_and_stops_at_the_limit() -> None:
    async def run() -> tuple[list[str], list[str]]:
        inbox: asyncio.Queue[cpm_pb2.Directive] = asyncio.Queue()
        first = directive("a", 1)

        async def late() -> None:
            await asyncio.sleep(0.05)
            inbox.put_nowait(directive("late", 1))

        task = asyncio.create_task(late())
        waited = await rest_of_round(inbox, first, settle_s=2.0, limit=2)
        await task
        for k in range(10):
            inbox.put_nowait(directive(f"flood-{k}", 1))
        capped = await rest_of_round(inbox, first, settle_s=0.0, limit=4)
        return [d.directive_id for d in waited], [d.directive_id for d in capped]

    waited, capped = asyncio.run(run())
    assert waited == ["late"]
    assert capped == ["flood-0", "flood-1", "flood-2"]
