"""A stepped load shape: hold each user count for a fixed time, then the next; stop after the last.

Configured by environment variables when locust builds it from a locustfile::

    LOADTEST_STEPS="1,4,16"      user count of each step
    LOADTEST_STEP_SECONDS=10     seconds per step
    LOADTEST_SPAWN_RATE=100      users started (or stopped) per second at a step change

``python -m loadtests.run`` builds it with explicit arguments instead. Every step change is
recorded in ``transitions`` (perf_counter time, step index; index None at the end), so requests
can be attributed to the step that was really running when they completed.
"""

from __future__ import annotations

import os
import time

from locust import LoadTestShape

DEFAULT_STEPS = (1, 4, 16)
DEFAULT_STEP_SECONDS = 10.0
DEFAULT_SPAWN_RATE = 100.0


def parse_steps(text: str) -> tuple[int, ...]:
    steps = tuple(int(s) for s in text.replace(" ", ",").split(",") if s.strip())
    if not steps or any(s < 1 for s in steps):
        raise ValueError(f"steps must be positive user counts, got {text!r}")
    return steps


class StepLoadShape(LoadTestShape):
    def __init__(self, steps: tuple[int, ...] | None = None, step_seconds: float | None = None,
                 spawn_rate: float | None = None) -> None:
        super().__init__()
        self.steps = tuple(steps) if steps else parse_steps(os.environ.get("LOADTEST_STEPS", ",".join(map(str, DEFAULT_STEPS))))
        self.step_seconds = float(step_seconds if step_seconds is not None
                                  else os.environ.get("LOADTEST_STEP_SECONDS", DEFAULT_STEP_SECONDS))
        self.spawn_rate = float(spawn_rate if spawn_rate is not None
                                else os.environ.get("LOADTEST_SPAWN_RATE", DEFAULT_SPAWN_RATE))
        if self.step_seconds <= 0 or self.spawn_rate <= 0:
            raise ValueError("step seconds and spawn rate must be positive")
        self.transitions: list[tuple[float, int | None]] = []

    @property
    def duration(self) -> float:
        return self.step_seconds * len(self.steps)

    @property
    def finished(self) -> bool:
        return bool(self.transitions) and self.transitions[-1][1] is None

    def current_step(self) -> int | None:
        k = int(self.get_run_time() // self.step_seconds)
        return k if k < len(self.steps) else None

    def reset_time(self) -> None:
        super().reset_time()
        self.transitions = []

    def tick(self):
        k = self.current_step()
        if not self.transitions or self.transitions[-1][1] != k:
            self.transitions.append((time.perf_counter(), k))
        if k is None:
            return None
        return self.steps[k], self.spawn_rate
