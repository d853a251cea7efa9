"""Hypothesis strategies for random valid drafter specs (tiny dims, every variant)."""

from hypothesis import strategies as st

from woodcock.ir import (
    DecoderLayer,
    DFlash,
    DrafterSpec,
    DSpark,
    Eagle3,
    Fusion,
    Head,
    Taps,
    Target,
)


@st.composite
def algorithms(draw, vocab_size):
    kind = draw(st.sampled_from(["eagle3", "dflash", "dspark"]))
    if kind == "eagle3":
        return Eagle3(
            norm_before_residual=draw(st.booleans()),
            norm_output=draw(st.booleans()),
            speculative_tokens=draw(st.integers(1, 8)),
        )
    block = dict(
        block_size=draw(st.integers(2, 16)),
        mask_token_id=draw(st.integers(0, vocab_size - 1)),
        sample_from_anchor=draw(st.booleans()),
    )
    if kind == "dflash":
        return DFlash(**block)
    rank = draw(st.sampled_from([0, 2, 4]))
    confidence = draw(st.booleans())
    return DSpark(
        **block,
        markov_head_type=draw(st.sampled_from(["vanilla", "gated", "rnn"])),
        markov_rank=rank,
        confidence_head=confidence,
        confidence_head_with_markov=(rank > 0 or not confidence) and draw(st.booleans()),
    )


@st.composite
def layers(draw, index, hidden_size, eagle3):
    kv_heads = draw(st.sampled_from([1, 2]))
    rope_scaling = draw(
        st.sampled_from(
            [
                None,
                {"rope_type": "linear", "factor": 2.0},
                {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ]
        )
    )
    return DecoderLayer(
        style=draw(st.sampled_from(["llama", "qwen3"])),
        input="embed_and_hidden" if eagle3 and index == 0 else "hidden",
        attention="causal"
        if eagle3
        else draw(st.sampled_from(["block_bidirectional", "block_causal"])),
        sliding_window=draw(st.none() | st.integers(1, 64)),
        hidden_size=hidden_size,
        intermediate_size=draw(st.integers(1, 24)),
        num_attention_heads=kv_heads * draw(st.sampled_from([1, 2])),
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 6])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5, 3.3e-7])),
        rope_theta=draw(st.sampled_from([10000.0, 1e6, 500000.0])),
        rope_scaling=rope_scaling,
        max_position_embeddings=draw(st.integers(16, 4096)),
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
    )


@st.composite
def specs(draw):
    vocab_size = draw(st.integers(2, 40))
    algorithm = draw(algorithms(vocab_size))
    eagle3 = isinstance(algorithm, Eagle3)
    num_target_layers = draw(st.integers(1, 8))
    head = Head(
        lm_head=draw(st.sampled_from(["own", "shared"])),
        embedding=draw(st.sampled_from(["own", "shared"])),
    )
    hidden = draw(st.sampled_from([4, 8, 12]))
    any_shared = "shared" in (head.lm_head, head.embedding)
    target_hidden = hidden if any_shared else draw(st.sampled_from([4, 8, 12]))
    tap_ids = draw(st.lists(st.integers(0, num_target_layers), min_size=1, max_size=4, unique=True))
    num_layers = draw(st.integers(1, 3))
    return DrafterSpec(
        algorithm=algorithm,
        target=Target(
            num_hidden_layers=draw(st.sampled_from([num_target_layers, None])),
            hidden_size=target_hidden,
            vocab_size=vocab_size,
            name_or_path=draw(st.none() | st.text(min_size=1, max_size=12)),
            architectures=tuple(
                draw(
                    st.lists(st.sampled_from(["Qwen3ForCausalLM", "LlamaForCausalLM"]), max_size=1)
                )
            ),
        ),
        taps=Taps(tuple(sorted(tap_ids))),
        fusion=Fusion(
            tap_norm=draw(st.sampled_from(["none", "per_tap", "concat"])),
            fc_bias=draw(st.booleans()),
            hidden_norm=False if eagle3 else draw(st.booleans()),
        ),
        layers=tuple(draw(layers(i, hidden, eagle3)) for i in range(num_layers)),
        head=head,
        draft_vocab_size=draw(st.integers(1, vocab_size)),
    )


def speculators_representable(spec: DrafterSpec) -> DrafterSpec:
    """The nearest spec the speculators format can hold: one layer config for all layers, one
    sliding window and one in-block causality for all sliding layers, no fc bias, qwen3 layers
    and hidden_norm(fc(concat)) fusion for block drafters, an own lm_head for a reduced draft
    vocabulary (what vLLM needs)."""
    import dataclasses

    block = spec.is_block
    first = spec.layers[0]
    style = "qwen3" if block else first.style
    window = next((layer.sliding_window for layer in spec.layers if layer.sliding_window), None)
    sliding_kind = next(
        (layer.attention for layer in spec.layers if layer.sliding_window), "block_causal"
    )
    layers = tuple(
        dataclasses.replace(
            first,
            style=style,
            mlp_bias=first.mlp_bias and style == "llama",
            input=layer.input,
            attention="causal"
            if not block
            else ("block_bidirectional" if layer.sliding_window is None else sliding_kind),
            sliding_window=window if layer.sliding_window else None,
        )
        for layer in spec.layers
    )
    fusion = dataclasses.replace(spec.fusion, fc_bias=False)
    if block:
        fusion = Fusion(tap_norm="none", fc_bias=False, hidden_norm=True)
    head = spec.head
    if spec.draft_vocab_size < spec.target.vocab_size:
        head = dataclasses.replace(head, lm_head="own")
    return dataclasses.replace(spec, layers=layers, fusion=fusion, head=head)


def _paths(node, prefix=()):
    """Every (path, value) of a JSON tree, the root included."""
    yield prefix, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


# values of every JSON type, including ones no reader should take for a count or a size
OTHER_VALUES = [None, True, False, 0, -1, 1.5, 10**30, "", "x", [], {}, [1], {"a": 1}]


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


@st.composite
def json_mutations(draw, text: str):
    """(damaged text, the key deleted or None): a JSON document cut short, made invalid, or
    with one value replaced by one of another type or one key deleted."""
    import copy
    import json

    kind = draw(st.sampled_from(["truncate", "garbage", "replace", "replace", "delete"]))
    if kind == "truncate":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))], None
    if kind == "garbage":
        at = draw(st.integers(0, len(text)))
        junk = draw(st.sampled_from(["{", "]", ",", '"', "\x00", "NaN", "\ufffd"]))
        return text[:at] + junk + text[at:], None
    document = json.loads(text)
    paths = [path for path, _ in _paths(document)]
    if kind == "delete":
        paths = [p for p in paths if p and isinstance(p[-1], str)]
        if not paths:
            return text[:-1], None
    path = draw(st.sampled_from(paths))
    mutated = copy.deepcopy(document)
    if not path:
        return json.dumps(draw(st.sampled_from(OTHER_VALUES))), None
    parent = mutated
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
        return json.dumps(mutated, indent=2), path[-1]
    else:
        # another kind of value (a valid value of the same kind may just be another setting)
        kind_of_old = _json_kind(parent[path[-1]])
        choices = [v for v in OTHER_VALUES if _json_kind(v) != kind_of_old]
        if kind_of_old == "number":
            choices.append(float("nan"))
        parent[path[-1]] = draw(st.sampled_from(choices))
    return json.dumps(mutated, indent=2), None
