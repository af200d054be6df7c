"""SIGTERM while the `overnight` command loads its modules, before a run's own handlers (jobs/entry.py): a run
exits 75 and resumes; another command ends by the signal. Timed against the old console script:
benchmarks/early_signal.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys


EARLY_SIGNAL = """
import os, signal, sys
import overnight.pipeline.signals as signals
recorded = signals.record_from_start

def record_then_signal():  # the console script's first act; then SIGTERM, as the command's modules load
    recorded()
    os.kill(os.getpid(), signal.SIGTERM)

signals.record_from_start = record_then_signal
from overnight.jobs.entry import main
sys.argv = ["overnight", *sys.argv[1:]]
sys.exit(main())
"""


def test_sigterm_while_the_command_loads_stops_a_run_with_75_and_ends_another_command(tmp_path, write_parquet,
                                                                                    tiny_model):
    """Before, a SIGTERM in a run's first half second (Python importing the command's modules, before the run's
    handlers) met the default action: exit 143, where a run stopped later exits 75, rerun to continue."""
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    out = tmp_path / "out"
    args = ["run", str(inp), "--out", str(out), "--engine", "echo", "--model", tiny_model, "--json"]
    run = [sys.executable, "-c", EARLY_SIGNAL, *args]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["num_ok"] == 0 and "interrupted by SIGTERM before the engine started" in summary["message"]
    again = subprocess.run([sys.executable, "-m", "overnight.jobs", *args], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["num_ok"] == 2, again.stderr[-2000:]
    status = subprocess.run([sys.executable, "-c", EARLY_SIGNAL, "status", str(out)], capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == -signal.SIGTERM and not status.stdout   # ended by the signal, as it would have
