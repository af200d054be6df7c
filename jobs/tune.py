"""`overnight tune`: measure the engine's throughput over a small grid of settings."""

from __future__ import annotations

import click

from overnight.jobs.options import build_config, input_options, sampling_options, user_errors


def int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=option) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: give one or more positive integers, comma-separated (e.g. 64,128)",
                                 param_hint=option)
    return values


@click.command()
@click.argument("input_path", metavar="INPUT", required=False)
@input_options
@sampling_options
@click.option("--batched-tokens", default="2048,4096", show_default=True,
              help="max_num_batched_tokens values to try (comma-separated).")
@click.option("--seqs", default="32,64,128", show_default=True, help="max_num_seqs values to try.")
@click.option("--sample", type=click.IntRange(min=1), default=128, show_default=True,
              help="Rows of INPUT to measure with (the first ones).")
@click.option("--time-limit", default="15m", show_default=True,
              help="Stop trying settings once the next would not fit in this (e.g. 15m).")
@click.option("--save", "save_to", help="Write the best settings as a YAML preset here (use it with --config).")
@user_errors
def tune(input_path, config_file, batched_tokens, seqs, sample, time_limit, save_to, **options):
    """Find the engine settings that give the most output tokens/s on a sample of INPUT.

    Each setting starts a fresh engine and runs the same rows. The report gives
    the KV-cache capacity the engine found and warns when a setting causes
    preemption. The best is written as a YAML preset for --config. INPUT may also
    be a YAML config file, as in `overnight tune nightly.yaml`.

    \b
    Example:
        overnight tune prompts.parquet --save configs/tuned.yaml
        overnight tune prompts.parquet --seqs 64,128,256 --batched-tokens 4096,8192 --time-limit 20m
        overnight run prompts.parquet --out results/ --config configs/tuned.yaml
    """
    from overnight.pipeline.scheduling.when import parse_budget
    from overnight.pipeline.output.storage import unwritable, url_to_fs, write_atomic
    from overnight.pipeline.tools.tune import preset_yaml, tune as run_tune

    import functools
    import logging

    from overnight.pipeline.streams import filtered_stderr, reserved_stdout

    b, s = int_list(batched_tokens, "--batched-tokens"), int_list(seqs, "--seqs")
    why = save_to and unwritable(save_to)
    if why:  # said before the engines start, not after the minutes they take
        raise click.BadParameter(f"{save_to} cannot be written: {why}", param_hint="--save")
    cfg = build_config(input_path, None, config_file, options)
    if cfg.engine.kind != "vllm":
        from overnight.pipeline.config import ConfigError

        raise ConfigError(f"tune measures vLLM's own throughput; engine.kind is {cfg.engine.kind!r} (from "
                          f"$OVERNIGHT_ENGINE or the config). Unset OVERNIGHT_ENGINE, or set engine.kind: vllm.")
    verbose = logging.getLogger("overnight").isEnabledFor(logging.DEBUG)
    # stdout: only tune's own table and preset; what vLLM prints goes to stderr (without the noise unless -v)
    with filtered_stderr(verbose, getattr(logging.getLogger("overnight"), "json_lines", False)), \
            reserved_stdout() as stdout:
        echo = functools.partial(click.echo, file=stdout)
        report = run_tune(cfg, b, s, sample, parse_budget(time_limit, "--time-limit"), echo=echo)
        if not report.num_rows:
            why = "; ".join(report.errors) or "the input has no rows"
            raise click.ClickException(f"No usable rows to measure in the first {sample} rows of {cfg.input.path} "
                                       f"({why}). Fix those rows, or point tune at input that has good ones.")
        for bt, sq in report.skipped:
            echo(f"max_num_batched_tokens={bt} max_num_seqs={sq}: skipped (time limit)")
        best = report.best
        if best is None:
            raise click.ClickException("No setting ran successfully; see the messages above.")
        echo(f"best: max_num_batched_tokens={best.max_num_batched_tokens} max_num_seqs={best.max_num_seqs} "
             f"at {best.tokens_per_s:.1f} output tok/s")
        text = preset_yaml(report, cfg, cfg.input.path)
        if save_to:
            try:
                fs, path = url_to_fs(save_to)
                write_atomic(fs, path, text.encode())
            except OSError as e:
                echo(text, nl=False)  # what was measured is not lost
                raise click.ClickException(f"--save {save_to}: cannot be written ({type(e).__name__}: {e}); the "
                                           f"preset is above") from None
            echo(f"preset written to {save_to}")
        else:
            echo(text, nl=False)
