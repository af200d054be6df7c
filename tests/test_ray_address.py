"""Ray clusters that cannot be reached: the driver fails at once with exit 69 and the fix (tests/test_ray.py runs
whole jobs on a local cluster)."""

from __future__ import annotations

import time

import pytest

from test_ray import write_input

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # after the others, alone: see conftest.py

ray = pytest.importorskip("ray")

from overnight.pipeline.cluster.ray_job import run_on_ray  # noqa: E402


def test_an_address_where_nothing_listens_fails_at_once_not_after_ray_s_retries(tmp_path, cfg, monkeypatch):
    """Ray's own connect retries for minutes where nothing listens at a head node's address (over 3 minutes
    measured at 127.0.0.1:1): one TCP connection tells at once, and ray.init is not called."""
    import socket

    from overnight.pipeline.engine import EngineError

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port where nothing listens

    def init(address=None, **kw):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    inp = write_input(tmp_path / "in", 1, 10, 10)
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        t = time.monotonic()
        with pytest.raises(EngineError, match=rf"Cannot reach the Ray cluster at {address} \(nothing answers at "
                                              rf"127\.0\.0\.1:{port}: Connection refused\)\. Start it"):
            run_on_ray(cfg(inp, tmp_path / "out"), False, 2, address, is_tty=False)
        assert time.monotonic() - t < 30


def test_a_ray_cluster_that_cannot_be_reached_is_named_with_its_fix(tmp_path, cfg, monkeypatch):
    """--ray-address auto without a running cluster: exit 69 (as an engine that cannot start, which a scheduler
    retries later) with the fix, not Ray's 47-line traceback."""
    from overnight.pipeline.engine import EngineError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():  # the module's local cluster, from the tests before: Ray's answer without one
        def init(address=None, **kw):
            raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to "
                                  "by setting `--address` flag or `RAY_ADDRESS` environment variable.")

        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", init)
    inp = write_input(tmp_path / "in", 1, 10, 10)
    with pytest.raises(EngineError, match=r"Cannot reach the Ray cluster at auto \(.*\)\. Start it \(`ray start "
                                          r"--head` on its head node\)"):
        run_on_ray(cfg(inp, tmp_path / "out"), False, 2, "auto", is_tty=False)
