"""The coordinator for a fleet of gateways: the lease rules, with their state in Redis.

One refresh is one optimistic transaction on one key::

    WATCH key; GET key; TIME           -- the state, and Redis's clock
    (in Python) load_state -> InProcessCoordinator.refresh(report, redis_now) -> dump
    MULTI; SET key state PX ttl; EXEC  -- fails if another gateway wrote in between

A conflict (another gateway's refresh committed first) re-runs the whole step on the
new state, so every grant is computed from the state every earlier grant left: the
sum of in-flight stays <= C exactly as with one in-process coordinator, whose code
this runs (``core/admission/coordinator.py``; nothing of the rules is written twice).
All gateways read one clock, Redis's ``TIME``, for record expiry and learning windows.

Lost state (Redis restarted, or the key expired after every gateway left for
``state_ttl_s``) is a missing key: the next refresh starts a new epoch in learning
mode (the coordinator's ``learn_on_start``: a TTL, and a TTL plus the reuse window
once a gateway reports the old epoch), since gateways may still hold credits granted
under the old one.

A gateway's record is named by its ``gateway_id`` plus a suffix of this process
(``gw-a#1f2e3d4c``): two gateways started under one id (one template for the fleet)
overwrote one record, and together admitted twice its share.

Redis errors become :class:`CoordinatorUnavailable`; the gateway then reuses its last
lease and, past ``reuse_s``, runs in SAFE mode (``core/admission/quota_book.py``).
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvgate.core.admission import AdmissionConfig, CoordinatorUnavailable, InProcessCoordinator
from kvgate.core.admission.coordinator_state import dump_state, load_state
from kvgate.core.admission.types import LeaseGrant, RefreshRequest
from kvgate.core.errors import ConfigError
from kvgate.gateway.redact import redact_url

T = TypeVar("T")

DEFAULT_KEY = "kvgate:coordinator"
# Optimistic retries of one refresh before it counts as a failed refresh: with a
# handful of gateways refreshing every 0.5 s a conflict is rare, so this many in a
# row means the store is unusable, not busy.
MAX_ATTEMPTS = 16


class RedisCoordinator:
    """An ``AsyncCoordinator`` (``gateway/driver.py``) backed by one Redis key."""

    def __init__(
        self,
        config: AdmissionConfig,
        url: str,
        *,
        key: str = DEFAULT_KEY,
        state_ttl_s: float | None = None,
        socket_timeout_s: float = 1.0,
    ) -> None:
        self.config = config
        self.url = url
        self.shown_url = redact_url(url)  # in error messages and logs: no password
        self.key = key
        # long enough that a fleet restart keeps its state, short enough that a store
        # shared by test runs or abandoned fleets does not keep it forever
        self.state_ttl_s = state_ttl_s if state_ttl_s is not None else max(
            60.0, 30 * config.lease.ttl_s
        )
        self.conflicts = 0  # optimistic retries: how contended the key is
        self.instance = uuid.uuid4().hex[:8]  # this process's part of its record's name
        self._rng = random.Random()
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            decode_responses=False,
        )

    async def refresh(self, req: RefreshRequest, now: float) -> LeaseGrant:
        """One gateway's report in, its lease out (``now``, the gateway's clock, is not
        used: the fleet's records run on Redis's)."""
        own = replace(req, gateway_id=self.record_id(req.gateway_id))
        grant = await self._transact(lambda coord, t: coord.refresh(own, t))
        assert grant is not None  # created when missing
        return replace(grant, gateway_id=req.gateway_id)

    async def release_gateway(self, gateway_id: str) -> None:
        record = self.record_id(gateway_id)
        await self._transact(lambda coord, t: coord.release_gateway(record), create=False)

    def record_id(self, gateway_id: str) -> str:
        """The name of this process's record in the fleet's state."""
        return f"{gateway_id}#{self.instance}"

    async def close(self) -> None:
        await self._redis.aclose()

    async def _transact(
        self, step: Callable[[InProcessCoordinator, float], T], *, create: bool = True
    ) -> T | None:
        """``step`` on the stored state at Redis's clock, written back atomically; None
        (nothing run, nothing written) when there is no state and ``create`` is off."""
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                async with self._redis.pipeline(transaction=True) as pipe:
                    try:
                        await pipe.watch(self.key)
                        raw = await pipe.get(self.key)
                        if raw is None and not create:
                            return None
                        seconds, micros = await pipe.time()
                        now = seconds + micros / 1e6
                        coord = self._load(raw)
                        out = step(coord, now)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.set(self.key, _encode(dump_state(coord)),
                                 px=int(self.state_ttl_s * 1000))
                        await pipe.execute()
                        return out
                    except WatchError as exc:
                        # redis-py reports a connection lost while watching as a
                        # WatchError too: that is an outage, not a conflict
                        lost = _lost_connection(exc)
                        if lost is not None:
                            raise CoordinatorUnavailable(
                                f"redis coordinator at {self.shown_url}: {lost}"
                            ) from exc
                        self.conflicts += 1
                if attempt < MAX_ATTEMPTS:
                    # back off a random few ms, growing: refreshes that collided do not
                    # collide again in lock step
                    await asyncio.sleep(self._rng.uniform(0.0, 0.002 * attempt))
        except RedisError as exc:
            raise CoordinatorUnavailable(f"redis coordinator at {self.shown_url}: {exc}") from exc
        raise CoordinatorUnavailable(
            f"redis coordinator at {self.shown_url}: {MAX_ATTEMPTS} conflicting refreshes in a row"
        )

    def _load(self, raw: Any) -> InProcessCoordinator:
        if raw is None:  # a new fleet, or Redis lost the state: a new epoch, learning
            return InProcessCoordinator(
                self.config, epoch=uuid.uuid4().hex, learn_on_start=True
            )
        try:
            return load_state(self.config, json.loads(raw))
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            # never overwrite what we cannot read (another version's state, say)
            raise CoordinatorUnavailable(
                f"redis coordinator at {self.shown_url}: unreadable state under {self.key!r}: {exc}"
            ) from exc


def _lost_connection(exc: WatchError) -> BaseException | None:
    """The connection error behind a WatchError, if any. redis-py raises it inside its
    retry handler without ``from``, so the error is the implicit ``__context__``."""
    for cause in (exc.__cause__, exc.__context__):
        if isinstance(cause, (RedisConnectionError, RedisTimeoutError, TimeoutError)):
            return cause
    return None


def _encode(state: dict[str, Any]) -> bytes:
    return json.dumps(state, separators=(",", ":")).encode()
