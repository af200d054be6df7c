"""The command-line options: each declared once in jobs/options.py, with the config key it sets."""

import dataclasses
import typing

import click
import pytest
from click.testing import CliRunner

from overnight.jobs import options as opts
from overnight.jobs.cli import cli
from overnight.jobs.plan import plan
from overnight.jobs.run import run
from overnight.jobs.tune import tune
from overnight.pipeline.config import ENGINE_KINDS, JobConfig, Policy
from overnight.pipeline.configio import resolve

# A value for each option as typed on the command line, and what it becomes in the config.
SAMPLES = {
    "--model": ("org/some-model", "org/some-model"),
    "--prompt-column": ("question", "question"),
    "--messages-column": ("chat", "chat"),
    "--id-column": ("key", "key"),
    "--limit": ("7", 7),
    "--system-prompt": ("Be brief.", "Be brief."),
    "--chat/--no-chat": ("--no-chat", False),
    "--max-tokens": ("33", 33),
    "--temperature": ("0.7", 0.7),
    "--top-p": ("0.8", 0.8),
    "--top-k": ("5", 5),
    "--min-p": ("0.05", 0.05),
    "--repetition-penalty": ("1.3", 1.3),
    "--seed": ("11", 11),
    "--stop": ("###", ["###"]),
    "--engine": ("echo", "echo"),
    "--echo-step-ms": ("12.5", 12.5),
    "--max-model-len": ("1024", 1024),
    "--max-num-seqs": ("16", 16),
    "--max-num-batched-tokens": ("4096", 4096),
    "--gpu-memory-utilization": ("0.5", 0.5),
    "--kv-cache-space": ("3", 3),
    "--enforce-eager/--no-enforce-eager": ("--no-enforce-eager", False),
    "--tensor-parallel-size": ("2", 2),
    "--prefix-caching/--no-prefix-caching": ("--no-prefix-caching", False),
    "--chunked-prefill/--no-chunked-prefill": ("--chunked-prefill", True),
    "--max-engine-restarts": ("3", 3),
    "--trust-remote-code": ("--trust-remote-code", True),
    "--policy": ("shortest-first", "shortest-first"),
    "--predictor": ("heuristic", "heuristic"),
    "--buckets": ("quantile", "quantile"),
    "--deadline": ("2099-01-01T06:00", "2099-01-01T06:00"),
    "--time-budget": ("90m", "90m"),
    "--on-deadline": ("abort", "abort"),
    "--grace": ("2m", 120.0),
    "--safety-margin": ("12", 12.0),
    "--lookahead": ("500", 500),
    "--max-wait": ("60", 60.0),
    "--sample-every": ("4", 4),
    "--throughput": ("2500", 2500.0),
    "--passthrough": ("a, b", ["a", "b"]),
    "--flush-rows": ("50", 50),
    "--flush-seconds": ("5", 5.0),
    "--log-every": ("9", 9.0),
    "--metrics-file": ("m.prom", "m.prom"),
    "--metrics-port": ("9300", 9300),
    "--stop-token-id": ("--stop-token-id=7", [7]),
    "--presence-penalty": ("0.5", 0.5),
    "--frequency-penalty": ("-0.5", -0.5),
    "--min-tokens": ("3", 3),
    "--json-schema": ("schema.json", "schema.json"),
    "--regex": ("[0-9]+", "[0-9]+"),
    "--choice": ("yes,no", ["yes", "no"]),
    "--n": ("3", 3),
    "--logprobs": ("5", 5),
    "--lora": ("--lora=sql=adapters/sql", {"sql": "adapters/sql"}),
    "--max-loras": ("2", 2),
    "--max-lora-rank": ("16", 16),
    "--price-per-hour": ("2.5", 2.5),
    "--shard": ("1/4", "1/4"),
    "--shards": ("4", 4),
    "--workers": ("3", 3),
    "--ray-address": ("ray://head:10001", "ray://head:10001"),
}


def lookup(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_config_path_exists_in_jobconfig():
    for opt in opts.OPTIONS:
        cls = JobConfig
        *sections, name = opt.path.split(".")
        for s in sections:
            cls = typing.get_type_hints(cls)[s]
            assert dataclasses.is_dataclass(cls), opt.path
        assert name in {f.name for f in dataclasses.fields(cls)}, f"{opt.flags}: no config key {opt.path}"


def test_names_and_paths_are_declared_once():
    assert len({o.name for o in opts.OPTIONS}) == len(opts.OPTIONS)
    assert len({o.path for o in opts.OPTIONS}) == len(opts.OPTIONS)


def test_every_option_has_a_sample():
    assert set(SAMPLES) == {o.flags for o in opts.OPTIONS}


def test_no_options_change_nothing():
    layer = opts.config_layer()
    assert resolve(layer) == resolve({})
    assert all(v is None for section in layer.values() for v in section.values())


def test_options_not_given_on_the_command_line_are_none():
    """What Click passes when nothing is given (e.g. () for --stop) overrides nothing."""
    seen = {}

    @click.command()
    @opts.input_options
    @opts.sampling_options
    @opts.engine_options
    @opts.schedule_options
    @opts.output_options
    @opts.cluster_options
    def cmd(config_file, **options):
        seen.update(options)

    assert CliRunner().invoke(cmd, [], catch_exceptions=False).exit_code == 0
    assert set(seen) == {o.name for o in opts.OPTIONS}
    assert resolve(opts.config_layer(**seen)) == resolve({})


@pytest.mark.parametrize("opt", opts.OPTIONS, ids=lambda o: o.flags)
def test_each_option_lands_at_its_config_path(opt, monkeypatch):
    monkeypatch.delenv("OVERNIGHT_ENGINE", raising=False)
    given, expected = SAMPLES[opt.flags]
    argv = [given] if given.startswith("--") else [opt.flags, given]
    partner = {"--shards": ("--shard", "auto", ("cluster", "shard"))}.get(opt.flags)  # an option that needs another
    if partner:
        argv += partner[:2]
    captured = {}

    def fake_resolve(layer, config_file=None):
        captured["layer"] = layer
        return resolve(layer, config_file)

    monkeypatch.setattr("overnight.pipeline.configio.resolve", fake_resolve)

    @click.command()
    @click.argument("input_path", required=False)
    @opts.input_options
    @opts.sampling_options
    @opts.engine_options
    @opts.schedule_options
    @opts.output_options
    @opts.cluster_options
    def cmd(input_path, config_file, **options):
        captured["cfg"] = opts.build_config(input_path, "out/", config_file, options)

    result = CliRunner().invoke(cmd, ["in.parquet", *argv], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    cfg = captured["cfg"]
    assert lookup(cfg, opt.path) == expected
    assert cfg.input.path == "in.parquet" and cfg.output.path == "out/"
    # Nothing else moved: the layer holds this one value (and the two paths).
    section, key = opt.path.split(".")
    others = {(s, k): v for s, d in captured["layer"].items() for k, v in d.items()
              if v is not None and (s, k) not in {(section, key), ("input", "path"), ("output", "path"),
                                                  partner and partner[2]}}
    assert others == {}


def help_of(command, flags):
    with click.Context(command, info_name=command.name) as ctx:
        for p in command.params:
            if isinstance(p, click.Option) and flags.split("/")[0] in p.opts:
                return p.get_help_record(ctx)[1]
    raise KeyError(flags)


@pytest.mark.parametrize("flags,path", [("--max-wait", "scheduler.max_wait_s"),
                                        ("--sample-every", "scheduler.sample_every"),
                                        ("--lookahead", "scheduler.lookahead_rows"),
                                        ("--flush-rows", "output.flush_rows"),
                                        ("--policy", "scheduler.policy"),
                                        ("--model", "engine.model")])
def test_shown_default_is_the_dataclass_default(flags, path):
    default = opts.config_default(path)
    shown = int(default) if isinstance(default, float) and default.is_integer() else default
    assert f"[default: {shown}]" in help_of(run, flags)


def test_shown_defaults_read_the_dataclasses():
    assert "[default: 1800]" in help_of(run, "--max-wait")
    assert "[default: 10000]" in help_of(run, "--lookahead")
    assert "[default: 30s]" in help_of(run, "--grace")
    assert "[default: on]" in help_of(run, "--prefix-caching")
    assert "[default: on for CPU, off on GPU]" in help_of(run, "--enforce-eager")
    assert "[default: from the model's preset, else 256]" in help_of(run, "--max-tokens")


def test_options_the_presets_set_say_so():
    """A default the model's preset overrides is not shown as the dataclass's alone."""
    from overnight.configs import list_presets, preset_path
    from overnight.pipeline.configio import load_yaml

    for name in list_presets():
        for section, values in load_yaml(preset_path(name)).items():
            for key in values:
                opt = opts.BY_PATH.get(f"{section}.{key}")
                if opt is not None:
                    assert opt.preset, f"{name}.yaml sets {section}.{key}; {opt.flags} should say so"


def test_policy_choices_are_the_policy_enum():
    param = next(p for p in run.params if p.name == opts.BY_PATH["scheduler.policy"].name)
    assert list(param.type.choices) == [p.value for p in Policy]


def test_engine_choices_are_the_engine_kinds():
    param = next(p for p in run.params if p.name == opts.BY_PATH["engine.kind"].name)
    assert tuple(param.type.choices) == ENGINE_KINDS


def test_option_groups_per_command():
    def flags(cmd):
        return {o for p in cmd.params for o in p.opts}
    assert {"--engine", "--echo-step-ms", "--passthrough", "--flush-rows", "--log-every"} <= flags(run)
    assert "--engine" not in flags(plan) and "--engine" not in flags(tune)
    assert {"--policy", "--throughput", "--deadline", "--safety-margin"} <= flags(plan)
    # a dry run does not stop, drain, hold or age rows: it does not take what would do nothing there
    assert not {"--on-deadline", "--grace", "--lookahead", "--max-wait"} & flags(plan)


@pytest.mark.parametrize("command", ["run", "plan", "tune"])
def test_yaml_input_is_read_as_the_config(command, tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("engine:\n  max_num_seq: 8\n")
    argv = [command, str(bad)] + (["--out", str(tmp_path / "o")] if command == "run" else [])
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output   # bad usage, in every command
    assert f"Error: {bad}: unknown key engine.max_num_seq" in result.output


def test_tune_refuses_the_echo_engine_and_empty_lists(write_parquet, tiny_model, monkeypatch):
    """tune measures vLLM: with the echo engine named ($OVERNIGHT_ENGINE) it would start vLLM anyway, and lists of
    no setting measured nothing. Both are bad usage (2), before any engine starts."""
    import overnight.pipeline.engine.vllm as vllm_engine

    monkeypatch.setattr(vllm_engine.VllmEngine, "from_config", classmethod(lambda *a, **k: pytest.fail("started")))
    inp = write_parquet({"id": ["a"], "prompt": ["hi"]})
    monkeypatch.setenv("OVERNIGHT_ENGINE", "echo")
    r = CliRunner().invoke(cli, ["tune", inp, "--model", tiny_model])
    assert r.exit_code == 2 and "tune measures vLLM's own throughput; engine.kind is 'echo'" in r.output, r.output
    monkeypatch.delenv("OVERNIGHT_ENGINE")
    for option, value in (("--seqs", ","), ("--batched-tokens", "0,2048")):
        r = CliRunner().invoke(cli, ["tune", inp, "--model", tiny_model, option, value])
        assert r.exit_code == 2 and f"Invalid value for {option}: {value!r}: give one or more positive" in r.output


def test_tune_says_a_refused_pair_and_an_unwritable_preset_before_any_engine(write_parquet, tiny_model, tmp_path,
                                                                              monkeypatch):
    """A pair the config refuses is a result of its own (it aborted the grid after the engines before it ran), a
    --save that cannot be written is said before the engines start, and --limit below --sample takes the fewer."""
    import overnight.pipeline.tools.tune as tune_mod

    started = []

    class Engine:   # vLLM's stand-in: ten tokens a step, one row finished per step
        startup_seconds, kv_cache_tokens, num_preemptions = 0.1, 1000, 0

        def __init__(self, ecfg):
            started.append((ecfg.max_num_batched_tokens, ecfg.max_num_seqs))
            self.rows = []

        def add(self, rid, ids, sampling):
            self.rows.append(rid)

        def has_unfinished(self):
            return bool(self.rows)

        def step(self):
            self.rows.pop()
            return [type("F", (), {"num_output_tokens": 10})()]

        def shutdown(self):
            pass

    monkeypatch.setattr(tune_mod.VllmEngine, "from_config", classmethod(lambda cls, ecfg, path: Engine(ecfg)))
    monkeypatch.setattr(tune_mod, "shutdown_engines", lambda: None)
    inp = write_parquet({"id": list("abcdef"), "prompt": ["hi"] * 6})
    (tmp_path / "a-file").write_text("")
    r = CliRunner().invoke(cli, ["tune", inp, "--model", tiny_model, "--seqs", "4", "--batched-tokens", "2048",
                                 "--save", str(tmp_path / "a-file" / "tuned.yaml")])
    assert r.exit_code == 2 and f"{tmp_path / 'a-file'} is a file, not a folder" in r.output and not started
    preset = tmp_path / "tuned.yaml"
    r = CliRunner().invoke(cli, ["tune", inp, "--model", tiny_model, "--seqs", "4,128", "--batched-tokens", "64,2048",
                                 "--limit", "2", "--save", str(preset)])
    assert r.exit_code == 0, r.output
    assert "max_num_batched_tokens=64 max_num_seqs=128: refused: " in r.output.splitlines()[0]
    assert started == [(64, 4), (2048, 4), (2048, 128)]
    assert "best of 3 settings measured on\n# 2 rows of" in preset.read_text()


def test_unknown_option_names_are_refused():
    with pytest.raises(TypeError, match="kv_cache_space_gib"):
        opts.config_layer(kv_cache_space_gib=2.0)


def test_plan_names_the_throughput_given_on_the_command_line(write_parquet, tiny_model):
    import json

    inp = write_parquet({"id": ["a", "b"], "prompt": ["What is 2 + 2?", "Name a colour."]})
    result = CliRunner().invoke(cli, ["plan", inp, "--model", tiny_model, "--throughput", "2500", "--json"])
    assert result.exit_code == 0, result.output
    p = json.loads(result.output)
    assert p["throughput_source"] == "--throughput" and p["tokens_per_s"] == 2500


def test_plan_counts_every_completion_of_a_row(write_parquet, tiny_model):
    import json

    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["What is 2 + 2?", "Name a colour.", "Say hi."],
                         "n": [None, 2, None]})
    got = {}
    for n in ("1", "4"):
        result = CliRunner().invoke(cli, ["plan", inp, "--model", tiny_model, "--throughput", "100", "--json",
                                          "--n", n, "--temperature", "0.8"])
        assert result.exit_code == 0, result.output
        got[n] = json.loads(result.output)
    one = got["1"]["predicted_tokens"]
    # row b asks for 2 completions of its own; with --n 4 rows a and c ask for 4
    per_row = [b["predicted_tokens"] for b in got["1"]["buckets"]]
    assert one > 0 and sum(per_row) == one
    assert got["4"]["predicted_tokens"] > 1.8 * one
    assert got["4"]["eta_s"] == pytest.approx(got["4"]["predicted_tokens"] / 100, rel=1e-3)
