"""Errors of the export path: printed by the CLI as one line, exit status 2."""


class ExportError(Exception):
    """An export could not be produced, or the produced artifact failed verification."""


class MissingExtraError(ExportError):
    """An optional dependency is not installed; the message names the extra to install."""
