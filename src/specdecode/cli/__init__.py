"""The specdecode command, one module per command group: app.py (the parser, generate and the
smaller commands), train.py, serve.py."""

from specdecode.cli.app import EXIT_USER_ERROR, main

__all__ = ["EXIT_USER_ERROR", "main"]
