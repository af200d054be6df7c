"""SIGKILL at any moment, twenty times over one job: nothing lost, nothing duplicated.

CI runs the harness on the echo engine (a real `overnight run` process each
time; only generation is simulated). `pytest --long` runs more kills, and a
round on the real vLLM engine.
"""

import pytest

import killharness


def test_twenty_kills_lose_and_duplicate_nothing(tmp_path, tiny_model, request):
    kills = 60 if request.config.getoption("--long") else 20
    r = killharness.run(tmp_path / "in.parquet", tmp_path / "out", "echo", rows=200 * kills, kills=kills, seed=1,
                        model=tiny_model)
    assert r.kills >= 20
    assert set(r.kills_by_point) == {name for name, _ in killharness.KILL_POINTS}
    assert (r.rows_lost, r.duplicates, r.unreadable_files) == (0, 0, 0)
    assert r.manifest_matches


@pytest.mark.engine
def test_kills_on_the_real_engine(tmp_path, model_path, request):
    if not request.config.getoption("--long"):
        pytest.skip("--long: each restart of the real engine takes ~40 s on a CPU")
    r = killharness.run(tmp_path / "in.parquet", tmp_path / "out", "vllm", rows=150, kills=6, seed=2)
    assert r.kills >= 6 and (r.rows_lost, r.duplicates, r.unreadable_files) == (0, 0, 0) and r.manifest_matches
