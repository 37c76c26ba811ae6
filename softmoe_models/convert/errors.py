"""The one error type every converter raises: a message a user can act on, never a traceback."""


class ConversionError(Exception):
    """A checkpoint could not be read or does not describe a model we can build.

    The message names the file, key or shape at fault.
    """
