import re

import pytest

from overnight.pipeline.config import ConfigError, EngineConfig, JobConfig, SamplingConfig
from overnight.pipeline.configio import build, load_yaml, merge, resolve


def test_defaults_build():
    cfg = build({})
    assert cfg == JobConfig()


def test_unknown_key_is_refused_with_valid_keys():
    with pytest.raises(ConfigError) as e:
        build({"sampling": {"temprature": 0.5}}, source="job.yaml")
    assert str(e.value).startswith("job.yaml: unknown key sampling.temprature in sampling. Valid keys: ")
    assert "temperature" in str(e.value)


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match="unknown key engin in the top level"):
        build({"engin": {}})


@pytest.mark.parametrize("data,message", [
    ({"engine": {"max_num_seqs": "64"}}, "engine.max_num_seqs must be an integer, got '64'"),
    ({"sampling": {"temperature": "hot"}}, "sampling.temperature must be a number, got 'hot'"),
    ({"engine": {"enforce_eager": "yes"}}, "engine.enforce_eager must be true or false, got 'yes'"),
    ({"sampling": {"stop": "###"}}, "sampling.stop must be a list, got '###'"),
    ({"engine": {"max_num_seqs": True}}, "engine.max_num_seqs must be an integer, got True"),
    ({"scheduler": {"sample_every": "eight"}}, "scheduler.sample_every must be an integer, got 'eight'"),
])
def test_wrong_types_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        build(data)
    assert message in str(e.value)


def test_values_are_checked_at_construction():
    with pytest.raises(ConfigError, match=r"sampling.top_p is 1.5; it must be in \(0, 1\]"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ConfigError, match="Increase max_num_batched_tokens or decrease max_num_seqs"):
        EngineConfig(max_num_seqs=256, max_num_batched_tokens=128)
    with pytest.raises(ConfigError, match=r"scheduler.sample_every is -3; it must be 0 \(no row drawn at random\)"):
        build({"scheduler": {"sample_every": -3}})


def test_passthrough_accepts_all_none_or_list():
    assert build({"input": {"passthrough": ["a", "b"]}}).input.passthrough == ["a", "b"]
    with pytest.raises(ConfigError, match="input.passthrough is 'some'"):
        build({"input": {"passthrough": "some"}})


def test_merge_skips_none_and_merges_deep():
    assert merge({"a": {"x": 1, "y": 2}}, {"a": {"x": None, "y": 3}, "b": None}) == {"a": {"x": 1, "y": 3}}
    # a YAML file's null is a value; a mapping's null is an empty one
    assert merge({"a": {"x": 1, "m": {"k": 1}}}, {"a": {"x": None, "m": None}}, given_none=True) == {
        "a": {"x": None, "m": {"k": 1}}}


def test_null_in_the_yaml_file_sets_none(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("sampling:\nscheduler:\n  max_wait_s: null\nengine:\n  max_model_len: null\n")
    cfg = resolve({}, str(p))
    assert cfg.scheduler.max_wait_s is None                      # no aging (the default is 1800 s)
    assert cfg.engine.max_model_len is None                      # the model's own, over the preset's 2048
    assert cfg.sampling.max_tokens == 512                        # an empty section changes nothing
    assert resolve({"engine": {"max_model_len": 1024}}, str(p)).engine.max_model_len == 1024


def test_the_file_is_judged_with_the_layers_over_it(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("engine:\n  max_num_batched_tokens: 100\n")
    # alone against the defaults (128 sequences) it would be refused; with the preset's 64 and the CLI's 32 it is fine
    assert resolve({"engine": {"max_num_seqs": 32}}, str(p)).engine.max_num_batched_tokens == 100
    with pytest.raises(ConfigError, match=r"^configuration \(.*job.yaml and the command line\): .*"
                                          r"max_num_batched_tokens \(100\) is smaller than engine.max_num_seqs "
                                          r"\(200\)"):
        resolve({"engine": {"max_num_seqs": 200}}, str(p))


@pytest.mark.parametrize("sampling,message", [
    ({"temperature": 2.5}, "sampling.temperature is 2.5; it must be 0 (greedy) to 2."),
    ({"min_tokens": 600, "max_tokens": 512}, "sampling.min_tokens (600) is above max_tokens (512)"),
    ({"stop": ["###", ""]}, "sampling.stop has an empty string"),
    ({"choice": []}, "sampling.choice (--choice) is empty"),
    ({"seed": 2 ** 63}, "sampling.seed is 9223372036854775808; it must be within ±2**62"),
])
def test_sampling_values_vllm_refuses_are_config_errors(sampling, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build({"sampling": sampling})


def test_shards_without_shard_is_refused():
    # a Kubernetes Job given --shards 4 but not --shard auto: every pod would run the whole job
    with pytest.raises(ConfigError, match=r"cluster.shards \(--shards 4\) is the number of shards for --shard auto"):
        build({"cluster": {"shards": 4}})
    assert build({"cluster": {"shards": 4, "shard": "auto"}}).cluster.shards == 4


def test_invalid_yaml_names_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("sampling: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{p} is not valid YAML"):
        load_yaml(str(p))


def test_yaml_top_level_must_be_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_yaml(str(p))


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("sampling: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_yaml(str(p))


def test_yaml_has_no_base_60_numbers(tmp_path):
    """YAML 1.1 read an unquoted 1:30 as 90, so `time_budget: 1:30` ran 90 seconds where --time-budget 1:30 is
    refused; `deadline: 06:00` was 360."""
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  time_budget: 1:30\n  deadline: 06:00\nsampling:\n  max_tokens: 1_000\n"
                    "  temperature: 0.5\n")
    data = load_yaml(str(path))
    assert data["scheduler"] == {"time_budget": "1:30", "deadline": "06:00"}
    assert data["sampling"] == {"max_tokens": 1000, "temperature": 0.5}


def test_precedence_preset_then_yaml_then_cli(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("sampling:\n  max_tokens: 99\n  temperature: 0.5\nengine:\n  max_num_seqs: 8\n")
    cfg = resolve({"sampling": {"temperature": 0.9}}, str(p))
    assert cfg.engine.model == "smollm2-135m"
    assert cfg.sampling.max_tokens == 99          # YAML over the preset's 512
    assert cfg.sampling.temperature == 0.9        # command line over YAML
    assert cfg.engine.max_model_len == 2048       # from the smollm2-135m preset
    assert cfg.engine.max_num_seqs == 8


def test_unknown_key_in_user_yaml_names_that_file(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("engine:\n  max_num_seq: 8\n")
    with pytest.raises(ConfigError, match=f"^{p}: unknown key engine.max_num_seq"):
        resolve({}, str(p))


def test_presets_are_valid_configs():
    from overnight.configs import list_presets, preset_path

    assert "smollm2-135m" in list_presets()
    for name in list_presets():
        build(load_yaml(preset_path(name)), source=name)


def test_a_section_or_key_given_twice_is_refused(tmp_path):
    """YAML keeps the last of two equal keys: a second `sampling:` section dropped the first's max_tokens silently."""
    p = tmp_path / "dup.yaml"
    p.write_text("sampling:\n  max_tokens: 5\nengine:\n  max_num_seqs: 4\nsampling:\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match=r"dup.yaml is not valid YAML: 'sampling' is given twice; keep one section, "
                                          r"with the keys of both(?s:.*)line 5"):
        load_yaml(str(p))
    p.write_text("sampling:\n  max_tokens: 5\n  max_tokens: 6\n")
    with pytest.raises(ConfigError, match="'max_tokens' is given twice; keep one\n"):
        load_yaml(str(p))
    p.write_text("sampling: {<<: {max_tokens: 16, temperature: 0.2}, temperature: 0.7}\n")  # a merge key's are
    assert load_yaml(str(p)) == {"sampling": {"max_tokens": 16, "temperature": 0.7}}         # overridden, not twice
    # an anchored mapping whose own merge was brought in where it was first used, aliased again (it was refused)
    p.write_text("d: &d {max_tokens: 4}\nx: {<<: &f {<<: *d, max_tokens: 8}}\nsampling: *f\n")
    assert load_yaml(str(p))["sampling"] == {"max_tokens": 8}
    p.write_text("sampling: {<<: {max_tokens: 4, max_tokens: 5}}\n")   # a repeat inside a merged mapping too
    with pytest.raises(ConfigError, match="'max_tokens' is given twice"):
        load_yaml(str(p))
    p.write_text("sampling:\n  max_tokens: 5\nengine:\n  max_tokens: 5\n")   # the same key in two sections is fine
    assert load_yaml(str(p)) == {"sampling": {"max_tokens": 5}, "engine": {"max_tokens": 5}}


@pytest.mark.parametrize("output,message", [
    ({"metrics_port": 99999}, "output.metrics_port is 99999; it must be a port, 1 to 65535."),
    ({"metrics_port": 0}, "output.metrics_port is 0; it must be a port, 1 to 65535."),
    ({"price_per_hour": -5.0}, "output.price_per_hour is -5.0; it must be a finite number, 0 or more."),
    ({"price_per_hour": float("inf")}, "output.price_per_hour is inf; it must be a finite number, 0 or more."),
])
def test_output_values_the_cli_checks_are_checked_in_the_config_too(output, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve({"output": output})
