"""Owns the job's engine: starts it through the factory and restarts it when it dies mid-run.

The factory is called once to start the engine and once per restart; each call must return a new engine
(the failed one is shut down first), or the restart fails with a message that says so.

A restart puts the rows that were in flight back in the queue (the runner does that); the supervisor only
decides whether another engine may be started, and starts it. With ``engine.max_restarts`` at 0 (the
default) an engine death stops the job with exit 69 and a message that says how to allow restarts.
"""

from __future__ import annotations

import logging
from typing import Optional

from overnight.pipeline.engine import EngineError, EngineFactory

log = logging.getLogger("overnight")


class EngineSupervisor:
    def __init__(self, factory: EngineFactory, job, announce: Optional[str] = None):
        self.factory = factory
        self.announce = announce  # logged as the engine starts
        self.job = job
        self.max_restarts = job.cfg.engine.max_restarts
        self.num_restarts = 0
        self.engine = None

    def start(self):
        if self.announce:
            log.info(self.announce)
        try:
            self.engine = self.factory(self.job)
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"The engine failed to start ({type(e).__name__}: {e}).") from e
        return self.engine

    def restart(self, error: Exception, num_in_flight: int):
        """A new engine after ``error``; raises EngineError when no restart is left or the new one fails."""
        where = self.job.out.url
        what = f"{type(error).__name__}: {error}"
        if self.num_restarts >= self.max_restarts:
            try:  # nor is it handed out again (an engine cached for the next job in this process)
                self.engine.shutdown()
            except Exception as e:
                log.debug("shutting down the failed engine: %s", e)
            hint = (" Pass --max-engine-restarts N to restart it in-process." if not self.max_restarts else
                    f" It was restarted {self.num_restarts} time{'s' if self.num_restarts != 1 else ''} already "
                    f"(--max-engine-restarts {self.max_restarts}).")
            raise EngineError(f"The vLLM engine failed mid-run ({what}). The rows it finished are saved in "
                              f"{where}; rerun the same command to continue.{hint}") from error
        self.num_restarts += 1
        log.error(f"the vLLM engine failed mid-run ({what}); restarting it ({self.num_restarts} of "
                  f"{self.max_restarts}); {num_in_flight} rows in flight go back to the queue")
        try:
            self.engine.shutdown()
        except Exception as e:  # a dead engine may not shut down cleanly; its processes are reaped anyway
            log.debug("shutting down the failed engine: %s", e)
        failed = self.engine
        try:
            self.engine = self.factory(self.job)
            if self.engine is failed:
                raise RuntimeError("the engine factory handed back the engine that failed; it must start a new one")
        except Exception as e2:
            raise EngineError(f"The vLLM engine failed mid-run and could not be restarted ({e2}). The rows it "
                              f"finished are saved in {where}; rerun the same command to continue.") from e2
        return self.engine
