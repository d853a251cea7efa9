"""IR -> IR transforms (layer-id conventions, vocabulary truncation, dtype casts).

Installed as `woodcock.converters`; importing it under any other name is refused.
"""

if __name__ != "woodcock.converters":
    raise ImportError(
        f"import woodcock.converters, not {__name__} (this folder belongs to woodcock)"
    )
