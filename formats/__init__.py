"""On-disk drafter formats, one module each: `NAME`, `LAYER_CONVENTION`, `SIGNATURE`,
`matches(path)`, `read(path) -> Drafter`, `write(drafter, path, force=False)`.

Installed as `woodcock.formats`; importing it under any other name is refused, so this folder
never shadows PyPI's unrelated `formats` package from a source checkout either.
"""

if __name__ != "woodcock.formats":
    raise ImportError(f"import woodcock.formats, not {__name__} (this folder belongs to woodcock)")
