"""One module per ``kvspec`` subcommand.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code). ``kvspec.cli`` discovers them, so adding a
command is adding a module here.
"""
