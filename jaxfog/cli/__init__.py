"""The ``jaxfog`` command (``run``, ``exec``, ``info``, ``demo``, ``timeline``):
the parser and subcommands in :mod:`jaxfog.cli._command`, the launcher in
:mod:`jaxfog.cli._launcher`, the demo in :mod:`jaxfog.cli._demo`."""

from jaxfog.cli._command import info_lines, main, one_sided_component, parser, split_run_argv

__all__ = ["info_lines", "main", "one_sided_component", "parser", "split_run_argv"]
