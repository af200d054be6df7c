"""Every command has help with an Example: block, and --help starts without importing vllm or torch."""

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from overnight.jobs.cli import cli


def all_commands(group=cli, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, prefix + (name,))


@pytest.mark.parametrize("path,cmd", list(all_commands()), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_command_has_help_with_an_example(path, cmd):
    result = CliRunner().invoke(cli, [*path, "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "Example:" in result.output, f"`overnight {' '.join(path)} --help` has no Example: block"


def test_help_imports_no_engine_torch_or_transformers():
    # `overnight run --help` starts at once because vllm, torch and transformers (seconds to import) stay unloaded.
    code = ("import sys\n"
            "from overnight.jobs.cli import cli\n"
            "try:\n    cli(['run', '--help'], prog_name='overnight')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'transformers'})\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
