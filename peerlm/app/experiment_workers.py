"""The experiment's (strategy, seed) runs in worker processes (``--jobs``): which runs can
start at once, which wait for LocalOnly+'s own track, and the event queue back to the
command.

A track crosses processes as pickled bytes (:func:`pack_track`), not as a result of
tensors: multiprocessing's pickler shares each tensor through a file descriptor (torch's
reducer), and a run's track holds about ten thousand (rounds x clients x adapter tensors),
so the third seed's track exhausted the descriptor limit.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from peerlm.app.experiment_plan import Event, ExperimentPlan
from peerlm.app.experiment_run import LocalPhase, Start, Track, run_strategy, shares_track
from peerlm.app.experiment_world import World

__all__ = ["pack_track", "records_track", "run_parallel", "schedule", "unpack_track"]


def _strategy_job(
    world: World,
    strategy: str,
    seed: int,
    initial: Mapping[str, Sequence[float]],
    first: Mapping[str, LocalPhase],
    events: Any,
    threads: int,
    track: bytes | None = None,
) -> tuple[dict[str, Any], bytes | None]:
    """One (strategy, seed) in a worker process; events go back through a queue. Returns the
    run and, for LocalOnly+ when others replay it, its own track (:func:`pack_track`)."""
    import torch

    from peerlm.logs import configure_logging

    # Warnings only, to stderr: stdout is the command's (--json), and per-exchange info
    # lines (the guardrail's counts) would be thousands.
    configure_logging("experiment", "worker", level="warning")
    torch.set_num_threads(threads)
    record: Track | None = [] if records_track(world.plan, strategy) else None
    run = run_strategy(
        world,
        strategy,
        seed,
        initial,
        first,
        lambda k, d: events.put((k, dict(d))),
        track=unpack_track(track) if track is not None else None,
        record=record,
    )
    return run, pack_track(record) if record is not None else None


def pack_track(track: Track) -> bytes:
    """``track`` as bytes for another process: the standard pickler writes each tensor's
    data inline (the module docstring says why not multiprocessing's)."""
    return pickle.dumps(track, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_track(packed: bytes) -> Track:
    """The track :func:`pack_track` wrote (our own workers' bytes, never a peer's)."""
    track: Track = pickle.loads(packed)
    return track


def records_track(plan: ExperimentPlan, strategy: str) -> bool:
    """Whether ``strategy``'s run records the own track others replay (LocalOnly+'s)."""
    return strategy == "local_plus" and any(shares_track(plan, s) for s in plan.strategies)


def schedule(
    plan: ExperimentPlan, todo: Sequence[tuple[str, int]]
) -> tuple[list[tuple[str, int]], dict[tuple[str, int], tuple[str, int]]]:
    """The runs that can start at once (LocalOnly+'s first), and for each run that replays
    a track, the run it waits for."""
    producers = {seed for s, seed in todo if records_track(plan, s)}
    waits = {
        (s, seed): ("local_plus", seed)
        for s, seed in todo
        if seed in producers and shares_track(plan, s)
    }
    ready = [k for k in todo if k not in waits]
    ready.sort(key=lambda k: k[0] != "local_plus")
    return ready, waits


def run_parallel(
    world: World,
    starts: Mapping[str, Start],
    todo: Sequence[tuple[str, int]],
    jobs: int,
    emit: Event,
    finished: Callable[[tuple[str, int], dict[str, Any]], None],
) -> None:
    """(strategy, seed) runs in ``jobs`` worker processes (spawned: no forked torch state);
    ``finished`` gets each run as it completes, in this process."""
    import multiprocessing
    import os
    import queue
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing.managers import SyncManager

    import torch

    from peerlm.process import exit_with_parent

    ctx = multiprocessing.get_context("spawn")
    manager = SyncManager(ctx=ctx)  # the events' queue server: also a process to end
    manager.start(exit_with_parent, (os.getpid(),))
    with (
        manager,
        ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=exit_with_parent, initargs=(os.getpid(),)
        ) as pool,
    ):
        events = manager.Queue()
        ready, waits = schedule(world.plan, todo)

        def submit(name: str, seed: int, track: bytes | None = None) -> Any:
            return pool.submit(
                _strategy_job,
                world,
                name,
                seed,
                starts[name].initial,
                starts[name].firsts[seed],
                events,
                torch.get_num_threads(),
                track,
            )

        pending = {key: submit(*key) for key in ready}

        def drain(block: bool) -> None:
            while True:
                try:
                    kind, data = events.get(timeout=0.5) if block else events.get_nowait()
                except queue.Empty:
                    return
                emit(kind, data)
                block = False

        while pending:
            drain(block=True)
            for key, future in list(pending.items()):
                if future.done():
                    del pending[key]
                    drain(block=False)  # its last events before its result
                    run, track = future.result()
                    finished(key, run)
                    for waiting, on in list(waits.items()):
                        if on == key:
                            del waits[waiting]
                            pending[waiting] = submit(*waiting, track)
        drain(block=False)
