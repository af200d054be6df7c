"""Build a JobConfig from layered dicts: defaults < model preset < user YAML < OVERNIGHT_ENGINE < command line.

Every layer is a plain dict shaped like ``JobConfig.to_dict()``. Building is
strict: an unknown key or a value of the wrong type raises ``ConfigError``
naming the source, the dotted key and the fix.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import typing
from typing import Any, Optional, Union

from overnight.pipeline.config import ConfigError, JobConfig


def _loader():
    """YAML's safe loader without YAML 1.1's base-60 numbers: ``time_budget: 1:30`` is the text 1:30 (which
    --time-budget refuses, naming the forms it takes), not 90 seconds."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def flatten_mapping(self, node):
            """A key given twice (two ``sampling:`` sections) is refused: YAML would keep the last silently. Each
            mapping is checked once, as written: before its merge keys (<<: *defaults, whose keys it may override)
            bring theirs in, which rewrites it in place."""
            checked = self.__dict__.setdefault("_checked", set())
            if id(node) not in checked:
                checked.add(id(node))
                seen = set()
                for key_node, value_node in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node)
                    try:
                        again = key in seen
                        seen.add(key)
                    except TypeError:  # an unhashable key, which YAML's own constructor refuses
                        continue
                    if again:
                        how = ("keep one section, with the keys of both" if isinstance(value_node, yaml.MappingNode)
                               else "keep one")
                        raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice; {how}",
                                                                key_node.start_mark)
            super().flatten_mapping(node)

    numbers = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag not in numbers]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(numbers[0], re.compile(
        r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
    Loader.add_implicit_resolver(numbers[1], re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    return Loader


def load_yaml(path: str) -> dict:
    """Read a YAML config safely (``yaml.SafeLoader``, less base-60 numbers); errors name the file."""
    import yaml

    from overnight.pipeline.output.storage import open_file

    try:
        with open_file(path, "rb") as f:
            data = yaml.load(f, Loader=_loader())
    except FileNotFoundError:
        raise ConfigError(f"Config file {path} does not exist. Check the path given to --config.") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}".rstrip()) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (input, sampling, engine, ...), "
                          f"not a {type(data).__name__}.")
    return data


def merge(base: dict, over: dict, given_none: bool = False) -> dict:
    """Deep-merge ``over`` onto ``base``. A key of ``over`` whose value is None is ignored (the command line's
    options not given), unless ``given_none``: in a YAML file, ``null`` is a value (no aging, the model's own
    context length)."""
    out = dict(base)
    for key, value in over.items():
        if value is None and (not given_none or isinstance(out.get(key), dict)):
            continue  # a null over a mapping leaves the mapping (check_keys refuses it in the file itself)
        if isinstance(value, dict):
            base_value = out.get(key)
            out[key] = merge(base_value if isinstance(base_value, dict) else {}, value, given_none)
        else:
            out[key] = value
    return out


def build(data: dict, source: str = "config") -> JobConfig:
    """Build a JobConfig from a nested dict, refusing unknown keys and wrong types."""
    return _build(JobConfig, data, source, prefix="")


def check_keys(data: dict, source: str) -> None:
    """Refuse unknown keys and wrong types in one layer, without judging values against each other (the layers
    above it may change the other value)."""
    _build(JobConfig, data, source, prefix="", construct=False)


def _build(cls, data: Any, source: str, prefix: str, construct: bool = True):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"{source}: unknown key {prefix}{unknown[0]!s} in {where}. "
                          f"Valid keys: {', '.join(sorted(fields))}.")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, source, f"{prefix}{name}", construct)
    if not construct:
        return kwargs
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


# str keys whose natural YAML values (an unquoted time, a number of seconds) are read as they would be as flags
TIME_KEYS = ("scheduler.deadline", "scheduler.time_budget")


def _coerce(tp, value: Any, source: str, key: str, construct: bool = True):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, key + ".", construct)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[-1]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {value!r}.")
        return {_coerce(args[0], k, source, key): _coerce(args[1], v, source, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key} must be a list, got {value!r}.")
        return [_coerce(args[0], v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if key.endswith(TIME_KEYS):  # YAML reads an unquoted ISO time as a datetime, and 3600 as a number
            if isinstance(value, (dt.datetime, dt.date)):
                return value.isoformat()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
        raise ConfigError(f"{source}: {key} must be a string, got {value!r}. Quote it in YAML: {key.rsplit('.', 1)[-1]}"
                          f": \"...\".")
    raise ConfigError(f"{source}: {key} has an unsupported type {tp!r}.")  # pragma: no cover


def env_layer(environ=os.environ) -> dict:
    """OVERNIGHT_ENGINE=echo (or echo:step_ms=20,max_num_seqs=32): an alias for engine.kind: echo."""
    spec = environ.get("OVERNIGHT_ENGINE", "")
    if not spec:
        return {}
    kind, _, opts = spec.partition(":")
    if kind not in ("echo", "vllm"):
        raise ConfigError(f"OVERNIGHT_ENGINE is {spec!r}; use echo, echo:step_ms=20,max_num_seqs=32, or vllm.")
    engine: dict[str, Any] = {"kind": kind}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        if key not in ("step_ms", "max_num_seqs"):
            raise ConfigError(f"OVERNIGHT_ENGINE has an unknown setting {key!r}; use step_ms or max_num_seqs.")
        try:
            engine["echo_step_ms" if key == "step_ms" else key] = float(value) if key == "step_ms" else int(value)
        except ValueError:
            raise ConfigError(f"OVERNIGHT_ENGINE sets {key} to {value!r}, which is not a number.") from None
    return {"engine": engine}


# Keys of which a job takes at most one: one given on the command line drops the others a config file or preset set.
EITHER_OR = ((("scheduler", "deadline"), ("scheduler", "time_budget")),
             (("sampling", "json_schema"), ("sampling", "regex"), ("sampling", "choice")),
             (("cluster", "shard"), ("cluster", "workers")))


def resolve(cli: dict, config_file: Optional[str] = None) -> JobConfig:
    """Layer the model's preset, the user's YAML, OVERNIGHT_ENGINE and the command line into one JobConfig."""
    from overnight.configs import preset_for_model

    # A section given with nothing under it (``sampling:`` alone) is null in YAML: an empty section.
    user = {k: v for k, v in (load_yaml(config_file) if config_file else {}).items() if v is not None}
    model = (cli.get("engine") or {}).get("model") or (user.get("engine") or {}).get("model")
    if model is None:
        from overnight.pipeline.config import DEFAULT_MODEL
        model = DEFAULT_MODEL
    preset = preset_for_model(model)
    lower = merge(merge(preset, user, given_none=True), env_layer())
    for group in EITHER_OR:  # the command line overrides the config: a flag rules out its partners set below it
        if any((cli.get(s) or {}).get(k) is not None for s, k in group):
            for s, k in group:
                if (cli.get(s) or {}).get(k) is None and isinstance(lower.get(s), dict) and k in lower[s]:
                    lower[s] = {kk: v for kk, v in lower[s].items() if kk != k}
    data = merge(lower, cli)
    data.setdefault("engine", {})["model"] = model
    if config_file:  # an unknown key or a wrong type names the file; values are judged once, all layers merged
        check_keys(user, config_file)
    return build(data, source=f"configuration ({config_file} and the command line)" if config_file
                 else "configuration")
