"""The ``jaxfog`` command (``run``, ``exec``, ``info``, ``demo``, ``timeline``):
the parser and subcommands in :mod:`jaxfog.cli.command`, the launcher in
:mod:`jaxfog.cli.launcher`, the demo in :mod:`jaxfog.cli.demo`."""

from jaxfog.cli.command import info_lines, main, one_sided_component, parser, split_run_argv

__all__ = ["info_lines", "main", "one_sided_component", "parser", "split_run_argv"]
