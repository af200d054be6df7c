"""The `overnight` console script (pyproject.toml): SIGTERM and SIGINT are recorded from the process's first
moment, before the command's modules load (a third of a second and more), then the command runs. A run stopped
then exits 75 and resumes, as one stopped later does; any other command ends as the signal would have ended it."""


def main():
    from overnight.pipeline.signals import record_from_start

    record_from_start()
    from overnight.jobs.cli import main as command

    return command()
