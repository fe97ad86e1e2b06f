"""A shard's step protocol. Workers join with a mode (sync, async, bounded staleness) and push
their steps in order; the clock says when a pull may read a step, queues a sync step's pushes
until every worker pushed it and then has it applied in worker order (the same sums on every
replica), holds steps back while a save writes, and hands its state to another replica or
range. The clock is C++ (`_core.StepClock`, csrc/step_clock.h), so that the data plane's
threads and the servicer's Python share one clock; each `Shard` has one in its
`_core.ShardCore`. Its refusals raise `RequestError`."""

from __future__ import annotations

from elastic_emb import _core

__all__ = ["ASYNC", "MAX_PUSHES_IN_FLIGHT", "SYNC", "StepClock"]

# Training modes (the wire's Mode values).
ASYNC, SYNC = 0, 1
# A worker's pushes leave in the background: its pull may overtake this many.
MAX_PUSHES_IN_FLIGHT: int = _core.MAX_PUSHES_IN_FLIGHT

StepClock = _core.StepClock
