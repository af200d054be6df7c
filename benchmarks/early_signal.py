"""SIGTERM in a run's first moments: the exit code of `overnight run` signalled T ms after it was spawned, the
console script of before (overnight.jobs.cli:main, whose handlers a run installs only once its modules have
loaded) beside today's (overnight.jobs.entry:main, which records the signal from its first line).

    python benchmarks/early_signal.py [--tries 2] [--dir /tmp/early]

Each try, at each delay, runs both sides one after the other over a 2-row input with the echo engine (its steps
200 ms, so that no run ends before the signal). A negative code is the signal's (the shell shows 128 + 15 = 143);
75 is a stop that a rerun resumes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

DELAYS_MS = (50, 100, 150, 200, 300, 400, 600, 800, 1200)


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/early")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    inp = os.path.join(args.dir, "in.parquet")
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), inp)
    bin_dir = os.path.dirname(sys.executable)
    sides = {"before": [sys.executable, "-c", "import sys; from overnight.jobs.cli import main; "
                                              "sys.argv[0] = 'overnight'; sys.exit(main())"],
             "now": [os.path.join(bin_dir, "overnight")]}
    codes: dict = {}
    for _ in range(args.tries):
        for ms in DELAYS_MS:
            for side, cmd in sides.items():
                out = os.path.join(args.dir, f"out-{side}")
                shutil.rmtree(out, ignore_errors=True)
                p = subprocess.Popen([*cmd, "run", inp, "--out", out, "--engine", "echo", "--echo-step-ms", "200"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(ms / 1000)
                p.send_signal(signal.SIGTERM)
                codes.setdefault((side, ms), []).append(p.wait(timeout=120))
    print(f"load average {os.getloadavg()[0]:.1f}")
    for ms in DELAYS_MS:
        print(f"{ms:5d} ms  before {codes[('before', ms)]}  now {codes[('now', ms)]}")


if __name__ == "__main__":
    main()
