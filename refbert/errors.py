"""The one exception type of the commands' user mistakes, in a module of its own so that the library (train.py,
inference.py) and the command line (cli.py) both use it without either importing the other."""


class UserError(ValueError):
    """A problem with what the user asked for (a file, a folder, an argument): `refbert` reports it in one line and
    exits 2, without a traceback."""


__all__ = ["UserError"]
