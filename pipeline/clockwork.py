"""The runner's clock: what the loop does once a second, and how a run stops.

Each pass of the loop calls ``_tick``. It begins a stop when one is due (another run took over OUT, a signal,
or the deadline tracker's stop), and once a second it measures the rate, moves the progress line, beats the
lock's heartbeat and refreshes the online predictor's buckets. Every FORECAST_S or so it forecasts the job's end
(scheduling.deadline) and lets the tracker steer auto's order and the cap on rows in flight.

A stop ends admission: rows in flight drain until ``hard_stop_at`` (the deadline, or a signal's --grace, never
past the deadline), and the loop (runner) aborts what is left then.
"""

from __future__ import annotations

import logging
import math
import time

from overnight.pipeline.report import iso

log = logging.getLogger("overnight")

TICK_S, FORECAST_S = 1.0, 2.0  # how often the loop measures, and how often it forecasts
# Seconds from the last row to `overnight run`'s return: the last writes, the engine's processes' exit (jobs/cli.py
# ENGINE_EXIT_S) and the interpreter's (about 1 s after importing vLLM). 1.8-2.3 s, median 2.0, over 12 runs on this
# 2-core machine at stop 71 (2.7-3.3 s at stop 30; docs/BENCHMARKS.md); the ETA shown counts them, the deadline's
# forecast (rows done by the stop) does not. An engine that knows its own (EchoEngine.finish_s: no vLLM to exit)
# gives it instead.
FINISH_S = 2.0


def forecast_spacing(cpu_s: float, time_left: float = math.inf, elapsed: float = math.inf) -> float:
    """Seconds until the next forecast, after one that took cpu_s of the loop's CPU time. A forecast takes a few ms
    (the drain simulation); it may take at most 0.2% of the loop's time. Its own CPU time, not the wall clock's: on
    a busy machine one forecast preempted for 40 ms would otherwise put the next 20 s off (samples 24 s apart on a
    2-core machine running the engine beside it). With a deadline, at most a tenth of the time left (never under
    FORECAST_S): on a GPU a forecast of 1,300 pending rows took 12 ms, so the next came 6 s later, when a 45 s
    budget had 14 s left and a third of the rows were done (docs/BENCHMARKS.md, "First runs on a GPU"). And at most
    a tenth of the time ``elapsed`` since the loop's first tick: the first forecasts change most (the steps of the
    first seconds ran slow while the input thread read the pool, and the lengths are still being learned), and one
    over a pool of 10k rows (10-40 ms) put the next 8-14 s off, with a tenth of a 20k-row job's rows done by then;
    but so that they take at most 2% of the loop's time (50 times their CPU time: a larger pool's costlier ones)."""
    early = max(FORECAST_S, 0.1 * elapsed, 50 * cpu_s)
    return min(max(FORECAST_S, 500 * cpu_s), max(FORECAST_S, 0.1 * time_left), early)


class Clockwork:
    """The Runner's tick and stops; the Runner holds the state they use (job, tracker, scheduler, signals,
    progress, reporter, stopping, hard_stop_at)."""

    def _tick(self) -> None:
        now = self.clock()
        if self.stopping is None:
            if self._lock_lost():
                self._begin_stop(f"another run took over {self.job.out.shown()}", now)
            elif self.signals.first:
                # the grace, but never past the deadline: everything is written by then
                self._begin_stop(f"interrupted by {self.signals.first}", min(now + self.job.cfg.scheduler.grace_s,
                                                                             self._deadline_stop()))
            elif self.tracker.should_stop():
                self._begin_stop("deadline reached", self._deadline_stop())
        elif self.signals.first and not self.stopping.startswith("interrupted"):
            # a signal during the deadline's drain: the drain gets --grace from now, if that ends sooner
            hard = min(self.hard_stop_at, now + self.job.cfg.scheduler.grace_s)
            self.stopping = f"interrupted by {self.signals.first} ({self.stopping})"
            if hard < self.hard_stop_at:
                self.hard_stop_at = hard
                log.warning(f"{self.stopping}: {self.scheduler.num_running} rows in flight, draining them until "
                            f"{iso(hard)} (a second signal aborts at once)")
        if now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        self.tracker.observe(self.generated_estimate)
        self.progress.generated(self.generated_estimate)
        if self.tally.num_removed or self.tally.sees_every_row:  # rows in OUT whose ids left the input are not
            self.progress.recount(self.tally.num_done_here)      # this input's done
        self.progress.skipped = self.tally.num_duplicates
        self.progress.tick()
        if self.job.lock is not None:
            self.job.lock.heartbeat()
        self.annotator.refresh(self.scheduler, now, self.tracker.drawn)
        last = self.tracker.last
        if (last is not None and last.will_miss and not self.tracker.is_warned and not self.stopping
                and self.tracker.trusts(last)):
            self._last_forecast = -1e18  # at risk, and the step cost now known enough to say so: at once
        if now - self._last_forecast >= self._forecast_every:
            self._last_forecast = now
            t0 = time.thread_time()
            self._forecast()
            self._forecast_every = forecast_spacing(time.thread_time() - t0, self.tracker.time_left(),
                                                    self.tracker.seconds_observed())

    def _lock_lost(self) -> bool:
        return self.job.lock is not None and self.job.lock.lost

    def _lost_message(self) -> str:
        unsaved = self.writer.num_unsaved + len(self.writer.buffer)
        return (f"another run took over {self.job.out.shown()} ({self.job.lock.taken_by()}): this run stopped "
                f"and wrote nothing more there ({unsaved} finished rows not saved; the other run answers them). "
                f"Let that run finish, and give each run its own --out")

    def _forecast(self) -> None:
        # Rows an earlier attempt did are left out of the unread rows; a Ray worker's units are not its folder's
        # rows, so it knows only those it has met.
        before = (self.tally.done_before_in(self.job.scan.num_done) if self.job.source.sees_every_row
                  else self.tally.num_resumed)
        f = self.tracker.forecast_job(self.scheduler, self.tally, before, self.engine.max_num_seqs)
        # The ETA shown is the command's return: the last row's, and then the job's end (FINISH_S).
        finish = getattr(self.engine, "finish_s", FINISH_S)
        shown = [None if x is None else x + finish for x in (f.eta_s, f.eta_low_s, f.eta_high_s)]
        # at risk as the warning says it (DeadlineTracker.steer): not from the engine's first seconds
        # the deadline itself, as the user gave it (new rows stop a safety margin before it)
        deadline_left = max(0.0, self.tracker.deadline - self.tracker.clock()) if self.tracker.deadline else None
        self.progress.set_forecast(shown[0], deadline_left,
                                   f.will_miss and self.tracker.trusts(f),
                                   {"remaining_tokens": round(f.remaining_tokens), "forecast_tokens_per_s":
                                    round(f.tokens_per_s, 2), "rows_expected_left": f.rows_expected_left,
                                    "eta_low_s": shown[1], "eta_high_s": shown[2], "cap": f.cap})
        if not self.stopping:
            self.tracker.steer(f, self.scheduler)
        self.reporter.on_forecast()

    def _deadline_stop(self) -> float:
        """When rows still in flight are aborted at the deadline (inf without one)."""
        if self.tracker.deadline is None:
            return math.inf
        return self.tracker.stop_at if self.job.cfg.scheduler.on_deadline == "abort" else self.tracker.deadline

    def _begin_stop(self, reason: str, hard_stop_at: float) -> None:
        self.stopping = reason
        self.hard_stop_at = hard_stop_at
        self.scheduler.is_admitting = False
        n = self.scheduler.num_running
        if not n:
            log.warning(f"{reason}: stopped admitting rows; none in flight")
            return
        if hard_stop_at <= self.clock():
            log.warning(f"{reason}: stopped admitting rows; {n} rows in flight, aborting them")
            return
        second = ("a second signal aborts at once" if self.signals.first
                  else "a signal ends the drain within --grace, a second aborts at once")
        log.warning(f"{reason}: stopped admitting rows; {n} rows in flight, draining them until {iso(hard_stop_at)} "
                    f"({second})")
