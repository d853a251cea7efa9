"""The benchmark prompt sets (<domain>.jsonl), installed as `woodcock.benchmark_prompts`;
`woodcock.prompts` reads them. build_prompts.py rebuilds them from the wheels named in
README.md."""

if __name__ != "woodcock.benchmark_prompts":
    raise ImportError(
        f"import woodcock.benchmark_prompts, not {__name__} (this folder belongs to woodcock)"
    )
