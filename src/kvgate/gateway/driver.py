"""The asyncio driver of the core: one place where decisions are carried out.

Rules:

* The :class:`~kvgate.core.controller.Controller` is called only from the event
  loop's thread, and every call is one synchronous statement: nothing awaits in the
  middle of a core call, so each is atomic without locks.
* A request the core holds (``Hold``) awaits a future in ``_waiters``. Decisions for
  held requests come out of *other* calls (``on_finished``, ``on_cancelled``,
  ``tick``, ``on_lease``) and all go through :meth:`Driver.apply`, which resolves
  the waiter, or, when its client is already gone, hands the credit straight back
  (``on_cancelled``).
* An attempt waiting for its node's first byte registers an abort handle
  (:meth:`Driver.guard`, an :func:`asyncio.timeout` with no deadline). When the core
  says its node went down (``take_aborts``, after a health mark or an ejection), the
  driver expires that handle: the attempt ends at once with ``TimeoutError`` and the
  relay reports it as ``NODE_DOWN``, which the core retries elsewhere or fails.
* A P2 attempt runs inside a second handle (:meth:`Driver.preemptible`), from its
  send to the end of its answer. When the core ends the request to give its credit
  back (``Preempt``, from ``tick`` or ``on_lease``) the driver expires that handle;
  the relay aborts the upstream request and answers the client 503 ``preempted`` or,
  mid-stream, with an error event (:meth:`Driver.take_preempted` says why).
* The lease loop (:meth:`Driver.run`) ticks the controller every
  ``admission.tick_interval_s`` (queue deadlines, lease transitions, ejection
  expiry) and refreshes the lease when ``refresh_due`` says so, through a
  :class:`LeaseClient`: in process, a synchronous ``refresh_with``; a remote store
  (Redis) is awaited between ``make_refresh`` and ``on_lease`` in a background
  task (at most one in flight), so the ticks go on while the coordinator stalls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from kvgate.core.admission import (
    Coordinator,
    FailureKind,
    LeaseGrant,
    RefreshRequest,
    Rejected,
    RejectReason,
    make_rejection,
    shutting_down_rejection,
)
from kvgate.core.controller import Controller
from kvgate.core.decisions import Decision, Dispatch, Hold, Preempt, Reject
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.gateway.metrics_text import GatewayMetrics

log = logging.getLogger("kvgate.gateway")

HOLD_GRACE_S = 1.0  # a held request gives up this long after its deadline if no tick did


class AsyncCoordinator(Protocol):
    """A remote lease store (e.g. Redis): the same contract as the core's, awaited."""

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant: ...

    async def release_gateway(self, gateway_id: str) -> None: ...


class LeaseClient(Protocol):
    in_process: bool

    async def refresh(self, controller: Controller, clock: Callable[[], float]) -> list[Decision]:
        ...

    async def close(self, gateway_id: str) -> None: ...


class InProcessLeaseClient:
    """The default: the coordinator lives in this process (one gateway)."""

    in_process = True

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def refresh(self, controller: Controller, clock: Callable[[], float]) -> list[Decision]:
        return controller.refresh_with(self.coordinator, clock())

    async def close(self, gateway_id: str) -> None:
        self.coordinator.release_gateway(gateway_id)


class RemoteLeaseClient:
    """A coordinator behind the network: report, await the grant, apply it.

    Any error of the call (a timeout, a refused or dropped connection, whatever the
    client library raises: aiohttp's and redis-py's connection errors are not
    ``OSError``) is a failed refresh: the lease ages toward SAFE and the failure is
    counted. It is logged as one line, at most every ``warn_every_s`` while the
    coordinator stays down, since a dead coordinator fails every refresh.
    """

    in_process = False

    def __init__(
        self, coordinator: AsyncCoordinator, timeout_s: float = 1.0, *, warn_every_s: float = 10.0
    ) -> None:
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.warn_every_s = warn_every_s
        self.failing = 0  # failed refreshes in a row
        self._warned_at = -math.inf

    async def refresh(self, controller: Controller, clock: Callable[[], float]) -> list[Decision]:
        req = controller.make_refresh(clock())
        try:
            async with asyncio.timeout(self.timeout_s):
                grant = await self.coordinator.refresh(req, clock())
        except Exception as exc:  # not CancelledError (a BaseException): shutdown goes on
            self._refresh_failed(exc)
            return controller.on_refresh_failed(clock())
        if self.failing:
            log.info("coordinator reachable again after %d failed refreshes", self.failing)
            self.failing = 0
        return controller.on_lease(grant, clock())

    def _refresh_failed(self, exc: Exception) -> None:
        self.failing += 1
        now = time.monotonic()
        if now - self._warned_at >= self.warn_every_s:
            self._warned_at = now
            log.warning("lease refresh failed (%d in a row): %s", self.failing,
                        _describe(exc, self.timeout_s))

    async def close(self, gateway_id: str) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.coordinator.release_gateway(gateway_id)
        except Exception as exc:  # its lease expires on the coordinator after ttl anyway
            log.warning("could not release the lease of %s: %s", gateway_id,
                        _describe(exc, self.timeout_s))


def _describe(exc: Exception, timeout_s: float) -> str:
    """One line for the log (no traceback: the cause is the coordinator, not us)."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"no answer within {timeout_s:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Driver:
    def __init__(
        self,
        controller: Controller,
        lease: LeaseClient,
        metrics: GatewayMetrics,
        *,
        tick_interval_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.lease = lease
        self.metrics = metrics
        self.clock = clock
        self.tick_interval_s = tick_interval_s
        self._waiters: dict[RequestId, asyncio.Future[Decision]] = {}
        # the gateway is stopping: nothing is held any more (read by the proxy too)
        self.draining = False
        self._guards: dict[RequestId, asyncio.Timeout] = {}
        # P2 attempts the core may preempt, and those it did (until the relay takes them)
        self._preemptible: dict[RequestId, asyncio.Timeout] = {}
        self._preempted: dict[RequestId, Rejected] = {}
        self._refreshing: asyncio.Task[None] | None = None  # a remote refresh in flight
        # The index insert of a dispatched chain runs after the request went out (a
        # loop callback), not inside the decision; the core flushes it first whenever
        # the index is used, so the next decision sees the chain all the same.
        controller.defer_index_inserts = True
        self._flush_scheduled = False

    # ------------------------------------------------------------------ requests
    async def admit(self, req: RequestArrived) -> Decision:
        """Stage 1 and routing; a held request waits here for its Dispatch or Reject."""
        t0 = time.perf_counter()
        decision = self.controller.on_arrival(req, self.clock())
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        if not isinstance(decision, Hold):
            if isinstance(decision, Dispatch):
                self._schedule_flush()
            return decision
        rid = req.request_id
        if self.draining:  # stopping: the queue would outlive the gateway
            self.apply(self.controller.on_cancelled(rid, self.clock()))
            return Reject(request_id=rid, rejected=shutting_down_rejection(rid))
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        held_at = self.clock()
        try:
            async with asyncio.timeout(max(0.0, decision.deadline - held_at) + HOLD_GRACE_S):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return fut.result()
            # The core never answered (cannot happen while the tick loop runs): give up.
            self.cancel(rid)
            rejected = make_rejection(
                RejectReason.QUEUE_TIMEOUT, "Timed out waiting for capacity.", request_id=rid
            )
            return Reject(request_id=rid, rejected=rejected)
        finally:
            self._waiters.pop(rid, None)
            self.metrics.queue_wait.observe(self.clock() - held_at)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the loop: no later, do it now
                self.controller.flush_index()
                return
            self._flush_scheduled = True
            loop.call_soon(self._flush_index)

    def _flush_index(self) -> None:
        self._flush_scheduled = False
        self.controller.flush_index()

    def apply(self, decisions: Iterable[Decision]) -> None:
        """Carry out decisions about held requests (the only place waiters resolve)."""
        pending = deque(decisions)
        if pending:
            self._schedule_flush()
        while pending:
            d = pending.popleft()
            if isinstance(d, Preempt):
                self._preempt(d)
                continue
            fut = self._waiters.pop(d.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif isinstance(d, Dispatch):
                # Its client is gone: hand the credit back at once (may admit others).
                pending.extend(self.controller.on_cancelled(d.request_id, self.clock()))

    def first_byte(self, rid: RequestId) -> None:
        self.controller.on_first_byte(rid, self.clock())

    def finish(self, rid: RequestId, cached_tokens: int | None, *, usage_seen: bool = False
               ) -> None:
        """The answer ended; ``usage_seen``: it carried a usage (``cached_tokens`` None
        there: its prompt_tokens_details were left out)."""
        self.apply(self.controller.on_finished(
            rid, self.clock(), cached_tokens=cached_tokens, usage_reported=usage_seen))

    def failed(
        self, rid: RequestId, kind: FailureKind, *, before_first_byte: bool
    ) -> Decision | None:
        """An attempt failed; returns this request's next decision (retry Dispatch, Fail or
        Reject) and applies the rest (requests admitted with a freed credit)."""
        decisions = self.controller.on_failed(
            rid, kind, self.clock(), before_first_byte=before_first_byte
        )
        if decisions:
            self._schedule_flush()
        mine = next((d for d in decisions if d.request_id == rid), None)
        self.apply(d for d in decisions if d is not mine)
        self.abort_unanswered()  # the failure may have ejected the node
        self._log_ejections()
        return mine

    def _log_ejections(self) -> None:
        """Say when the controller ejects a node for failed attempts, and when it takes
        it back: the health watcher logs only its own verdicts."""
        cfg = self.controller.config
        for node_id, out in self.controller.take_ejections():
            if out:
                log.warning("node %s is out for %g s after %d failed attempt(s) in a row",
                            node_id, cfg.eject_s, cfg.eject_after_failures)
            else:
                log.warning("node %s is back (its %g s out after failed attempts ended)",
                            node_id, cfg.eject_s)

    # ------------------------------------------------------------------ aborts
    def guard(self, rid: RequestId, node_id: NodeId, handle: asyncio.Timeout) -> None:
        """The attempt ``rid`` waits for ``node_id``'s first byte inside ``handle``
        (entered); it stays abortable until :meth:`unguard`."""
        self._guards[rid] = handle
        state = self.controller.nodes.get(node_id)
        if state is None or not state.healthy:  # marked down since the Dispatch
            self._abort(rid)

    def unguard(self, rid: RequestId) -> None:
        self._guards.pop(rid, None)

    def abort_unanswered(self) -> None:
        """Carry out the core's aborts: attempts whose node went down before answering."""
        for rid in self.controller.take_aborts():
            self._abort(rid)

    def abort_all_unanswered(self) -> int:
        """Stopping: every attempt still waiting for its node's first byte ends now (the
        relay answers it 503 shutting_down); returns how many."""
        rids = list(self._guards)
        for rid in rids:
            self._abort(rid)
        return len(rids)

    def _abort(self, rid: RequestId) -> None:
        handle = self._guards.pop(rid, None)
        if handle is not None:  # None: its answer is already coming in, let it be
            handle.reschedule(asyncio.get_running_loop().time())

    # ------------------------------------------------------------------ preemption
    def preemptible(self, rid: RequestId, handle: asyncio.Timeout) -> None:
        """The attempt ``rid`` runs inside ``handle`` (entered) until :meth:`unpreemptible`
        (the relay asks :meth:`take_preempted` first: a request preempted before its
        attempt began is never sent)."""
        self._preemptible[rid] = handle

    def unpreemptible(self, rid: RequestId) -> None:
        self._preemptible.pop(rid, None)

    def take_preempted(self, rid: RequestId) -> Rejected | None:
        """Why ``rid`` was preempted (None: it was not); forgets it."""
        return self._preempted.pop(rid, None)

    def _preempt(self, d: Preempt) -> None:
        self._preempted[d.request_id] = d.rejected
        handle = self._preemptible.pop(d.request_id, None)
        if handle is not None:  # None: its attempt has not begun; preemptible() ends it
            handle.reschedule(asyncio.get_running_loop().time())

    def cancel(self, rid: RequestId) -> None:
        """The client went away (or gave up waiting): forget it, free its credit."""
        self._preempted.pop(rid, None)
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.cancel()
        self.apply(self.controller.on_cancelled(rid, self.clock()))

    def begin_drain(self) -> int:
        """Stopping: from now on nothing is held, and every held request is answered 503
        ``shutting_down`` now, which its client may retry at once elsewhere (the queue
        would outlive the gateway); returns how many were held."""
        self.draining = True
        shed = 0
        for rid in list(self._waiters):
            fut = self._waiters.pop(rid)
            self.apply(self.controller.on_cancelled(rid, self.clock()))
            if not fut.done():
                fut.set_result(Reject(request_id=rid, rejected=shutting_down_rejection(rid)))
                shed += 1
        return shed

    @property
    def held(self) -> int:
        return len(self._waiters)

    # ------------------------------------------------------------------ time
    async def run(self) -> None:
        """The lease loop; runs until cancelled, never dies on an error."""
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.lease_loop_errors += 1
                log.exception("lease loop step failed")
            await asyncio.sleep(self.tick_interval_s)

    async def step(self) -> None:
        """One tick; a due refresh runs in process, or in the background when remote."""
        now = self.clock()
        self.apply(self.controller.tick(now))
        self.abort_unanswered()
        self._log_ejections()
        if self._refreshing is not None or not self.controller.refresh_due(now):
            return
        if self.lease.in_process:
            await self._refresh()
        else:
            # A remote refresh may take up to the client's timeout: the ticks (queue
            # deadlines, lease transitions, node-down aborts) must not wait for it.
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refresh_done)

    async def _refresh(self) -> None:
        t0 = time.perf_counter()
        try:
            decisions = await self.lease.refresh(self.controller, self.clock)
        except Exception:  # the client's own bug, not the coordinator's: keep ticking
            self.metrics.lease_loop_errors += 1
            log.exception("lease refresh failed")
            return
        self.metrics.refresh_latency.observe(time.perf_counter() - t0)
        self.apply(decisions)

    def _refresh_done(self, task: asyncio.Task[None]) -> None:
        if self._refreshing is task:
            self._refreshing = None

    async def wait_refresh(self) -> None:
        """Wait for the refresh in flight, if any (start-up: serve with a first lease)."""
        task = self._refreshing
        if task is not None:
            await asyncio.wait({task})

    async def stop(self) -> None:
        """Cancel the refresh in flight, if any, and wait for it to end."""
        task, self._refreshing = self._refreshing, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

