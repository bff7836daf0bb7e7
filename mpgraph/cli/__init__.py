"""The ``mpgraph`` command line: the only part of mpgraph that prints.

Each command is a plain function in its own ``<name>_cmd.py`` that checks its flags, calls
the library, and prints the result (``console.console``; errors, notes and progress on
``console.err_console``). ``main.COMMANDS`` is the one table that registers them, behind the
error boundary ``main.handle_errors``. Library logic does not live here.
"""
