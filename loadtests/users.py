"""Locust users: each one loops over its endpoints round-robin (from a random start), closed-loop.

Every request is named after its endpoint (``classify``, ``zero-shot``, ``embed``, ``oip``) and
carries ``context={"images": n, "group": ...}`` so listeners can count images, not just requests.
A response counts as a failure unless it is 200 *and* has the expected shape (one result per
image, one score per label, ...).
"""

from __future__ import annotations

import itertools
import logging
import os
import random

from gevent.lock import Semaphore
from locust import HttpUser, constant, events, task

from .common import ENDPOINTS, Config, Plan, discover

_plans: dict[str, Plan] = {}
_lock = Semaphore()
_ids = itertools.count()


def set_plan(host: str, plan: Plan) -> None:
    """Used by ``loadtests.run``, which discovers the models once before starting locust."""
    _plans[host.rstrip("/")] = plan


def get_plan(host: str, cfg: Config | None = None) -> Plan:
    key = host.rstrip("/")
    with _lock:
        if key not in _plans:
            plan = Plan(cfg or Config.from_env(), discover(key))
            problems = plan.problems()
            if problems:
                raise RuntimeError("; ".join(problems))
            _plans[key] = plan
        return _plans[key]


@events.init.add_listener
def _prepare(environment, **_) -> None:
    """Locust CLI: discover the models and build the images once, before the first step's clock starts
    (done lazily in the first user instead, the first step would lose a few seconds to it)."""
    if environment.host and getattr(environment, "parsed_options", None) is not None:
        try:
            get_plan(environment.host)
        except Exception as e:
            logging.getLogger("loadtests").error("cannot prepare the load test against %s: %s", environment.host, e)
            raise SystemExit(2) from None


class SoftMoEUser(HttpUser):
    abstract = True
    endpoints: tuple[str, ...] = ENDPOINTS
    wait_time = constant(float(os.environ.get("LOADTEST_WAIT", "0")))

    def on_start(self) -> None:
        self.plan = get_plan(self.host)
        uid = next(_ids)
        self.rng = random.Random(self.plan.cfg.seed * 1_000_003 + uid)
        self.turn = self.rng.randrange(len(self.endpoints))

    @task
    def call(self) -> None:
        endpoint = self.endpoints[self.turn % len(self.endpoints)]
        self.turn += 1
        c = self.plan.call(endpoint, self.rng)
        with self.client.post(c.path, data=c.body, headers=c.headers, name=c.endpoint, catch_response=True,
                              timeout=self.plan.cfg.timeout_s,
                              context={"images": c.images, "group": c.group, "endpoint": c.endpoint}) as resp:
            error = c.check(resp.status_code or 0, dict(resp.headers or {}), resp.content or b"")
            if error:
                resp.failure(error)
            else:
                resp.success()


def user_class(endpoints: tuple[str, ...], wait_s: float | None = None, name: str = "SoftMoEUser") -> type[SoftMoEUser]:
    """A concrete user class looping over ``endpoints``."""
    attrs = {"endpoints": tuple(endpoints), "abstract": False, "__module__": __name__}
    if wait_s is not None:
        attrs["wait_time"] = constant(wait_s)
    return type(name, (SoftMoEUser,), attrs)


def _env_endpoints() -> tuple[str, ...]:
    from .common import parse_endpoints

    text = os.environ.get("LOADTEST_ENDPOINTS", "")
    return parse_endpoints(text) if text else ENDPOINTS


class MixedUser(SoftMoEUser):
    """Every endpoint of ``LOADTEST_ENDPOINTS`` (default: all four), round-robin per user."""

    endpoints = _env_endpoints()


class ClassifyUser(SoftMoEUser):
    endpoints = ("classify",)


class ZeroShotUser(SoftMoEUser):
    endpoints = ("zero-shot",)


class EmbedUser(SoftMoEUser):
    endpoints = ("embed",)


class OIPUser(SoftMoEUser):
    endpoints = ("oip",)
