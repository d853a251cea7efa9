"""The one error type users see. The CLI turns it into exit code 2 and a single line."""


class DrafterError(Exception):
    """Bad input or a refused operation: the message names the file, field, key or tensor,
    the value found and what was expected, on one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))
