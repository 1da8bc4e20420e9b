"""The error raised for malformed raw or converted data."""


class DataError(ValueError):
    """Raw or converted data is malformed; the message names file, row and column."""
