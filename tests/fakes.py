"""Test doubles: the echo engine with a fake clock and failure hooks."""

from __future__ import annotations

from overnight.pipeline.engine.echo import EchoEngine


class FakeClock:
    def __init__(self, t: float = 1_900_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeEngine(EchoEngine):
    """EchoEngine whose steps can advance a fake clock and which can die after N steps."""

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 2048, length_of=None, fail_after_steps=None,
                 clock=None, step_seconds: float = 0.0, step_sleep: float = 0.0):
        super().__init__(max_num_seqs, max_model_len, length_of or (lambda ids: 3 + len(ids) % 5), step_sleep)
        self.fail_after_steps = fail_after_steps
        self.clock = clock
        self.step_seconds = step_seconds

    def _step(self):
        if self.fail_after_steps is not None and self.num_steps >= self.fail_after_steps:
            raise RuntimeError("engine died")
        if self.clock is not None:
            self.clock.t += self.step_seconds
        return super()._step()


def given(engine):
    """An engine factory for run_job that hands over this one engine (restarts get the same object)."""
    return lambda job: engine
