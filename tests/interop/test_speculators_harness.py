"""Slow interop tests: the speculators 0.9.0 harness builds, reloads and runs every variant.

Run: `.venv/bin/python -m pytest -q tests/interop -m slow`. Skipped when torch, transformers or
speculators is not installed. The harness module is imported inside a fixture so that runs which
deselect `slow` do not pay for importing torch/speculators at collection time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from speculators_variants import REDUCED_VOCAB, SEQ, VARIANT_NAMES, VARIANTS, VERIFIERS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning"),
]

V, HID, N_LAYERS = 128, 64, 6
ANCHORS = (0, 3, 7, SEQ - 8, SEQ - 4)  # 4 <= block sizes; SEQ-4 = last allowed anchor for Bk=4


def _eagle3_inputs(H, inputs, v, seq_len=SEQ):  # noqa: N803
    """A T+1 sequence shifted with speculators' own shift_batch -> T rows."""
    raw = inputs(v.verifier, v.aux_layer_ids, seq_len + 1)
    return H.shift_for_eagle3(raw["input_ids"], raw["features"])


def _rms(torch, x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# ------------------------------------------------------------------------ expected structures


def _expected_eagle3_mask(torch, t, k, window):
    q = torch.arange(t)[:, None]
    kv = torch.arange(t * (k + 1))[None, :]
    causal = (kv < t) & (kv <= q)
    if window is not None:
        causal &= kv > q - window
    return causal | (kv % t == q)


def _expected_block_mask(torch, t, anchors, bk, window, non_causal):
    n = len(anchors)
    q = torch.arange(n * bk)
    blk, slot = q // bk, q % bk
    p = torch.tensor(anchors)[blk][:, None]
    kv = torch.arange(t + n * bk)[None, :]
    ctx = (kv < t) & (kv < p)
    if window is not None:
        ctx &= kv >= p - window
    kv_blk, kv_slot = (kv - t) // bk, (kv - t) % bk
    own = (kv >= t) & (kv_blk == blk[:, None])
    if not non_causal:
        own &= kv_slot <= slot[:, None]
    return ctx | own


def _check_config(cfg, v, verifier_dir):
    arch = {
        "eagle3": "Eagle3DraftModel",
        "dflash": "DFlashDraftModel",
        "dspark": "DSparkDraftModel",
    }[v.algorithm]
    cfg_cls = {"eagle3": "Eagle3", "dflash": "DFlash", "dspark": "DSpark"}[v.algorithm]
    assert cfg["architectures"] == [arch]
    assert cfg["speculators_model_type"] == v.algorithm
    assert cfg["speculators_version"] == "0.9.0"
    # an artefact of the config class's `_auto_class = ""` (speculators==0.9.0:speculators/config.py)
    assert cfg["auto_map"] == {"": f"config.{cfg_cls}SpeculatorConfig"}
    assert cfg["draft_vocab_size"] == (v.draft_vocab_size or V)
    assert cfg["tie_word_embeddings"] is False
    assert cfg["target_hidden_size"] is None
    assert cfg["dtype"] == "float32"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == v.algorithm
    assert sc["default_proposal_method"] == "greedy"
    (pm,) = sc["proposal_methods"]
    assert pm == {
        "proposal_type": "greedy",
        "speculative_tokens": pm["speculative_tokens"],
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    if v.algorithm == "eagle3":
        assert pm["speculative_tokens"] == v.ttt_steps
    else:
        sfa = v.effective_sample_from_anchor()
        assert pm["speculative_tokens"] == (v.block_size if sfa else v.block_size - 1)
    assert sc["verifier"]["name_or_path"] == str(Path(verifier_dir).resolve())
    want_arch = (
        "Qwen3ForCausalLM" if VERIFIERS[v.verifier]["model_type"] == "qwen3" else "LlamaForCausalLM"
    )
    assert sc["verifier"]["architectures"] == [want_arch]
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == v.layer_model_type
    assert tl["num_hidden_layers"] == v.num_layers
    assert tl["vocab_size"] == V and tl["hidden_size"] == HID and tl["head_dim"] == 16
    assert tl["rope_parameters"] == {"rope_type": "default", "rope_theta": v.rope_theta}
    assert tl["attention_bias"] is v.attention_bias
    if v.layer_types is not None:
        assert tl["layer_types"] == list(v.layer_types) and tl["sliding_window"] == v.sliding_window
    elif v.layer_model_type == "llama":
        assert "layer_types" not in tl and "sliding_window" not in tl
    else:
        assert tl["layer_types"] == ["full_attention"] * v.num_layers
        assert tl["sliding_window"] is None and tl["use_sliding_window"] is False
    common = {
        "architectures",
        "auto_map",
        "draft_vocab_size",
        "dtype",
        "speculators_config",
        "speculators_model_type",
        "speculators_version",
        "target_hidden_size",
        "tie_word_embeddings",
        "transformer_layer_config",
        "transformers_version",
    }
    if v.algorithm == "eagle3":
        extra = {
            "eagle_aux_hidden_state_layer_ids",
            "embed_requires_grad",
            "fc_norm",
            "norm_before_fc",
            "norm_before_residual",
            "norm_output",
        }
        assert cfg["eagle_aux_hidden_state_layer_ids"] == list(v.aux_layer_ids)
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            assert cfg[flag] is getattr(v, flag), flag
        assert cfg["embed_requires_grad"] is False
    else:
        extra = {
            "aux_hidden_state_layer_ids",
            "block_size",
            "mask_token_id",
            "sample_from_anchor",
            "sliding_window_non_causal",
        }
        assert cfg["aux_hidden_state_layer_ids"] == list(v.aux_layer_ids)
        assert cfg["block_size"] == v.block_size
        assert cfg["mask_token_id"] == v.mask_token_id
        assert cfg["sample_from_anchor"] is v.effective_sample_from_anchor()
        assert cfg["sliding_window_non_causal"] is v.sliding_window_non_causal
        if v.algorithm == "dspark":
            extra |= {
                "markov_rank",
                "markov_head_type",
                "enable_confidence_head",
                "confidence_head_with_markov",
            }
            assert cfg["markov_rank"] == v.markov_rank
            assert cfg["markov_head_type"] == v.markov_head_type
            assert cfg["enable_confidence_head"] is v.enable_confidence_head
            assert cfg["confidence_head_with_markov"] is v.confidence_head_with_markov
    assert set(cfg) == common | extra


def _check_tensors(H, torch, ckpt, v, verifier_dir):  # noqa: N803
    tensors = ckpt["tensors"]
    want = H.expected_saved_tensors(v)
    assert set(tensors) == set(want)
    for name, (shape, dtype) in want.items():
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].dtype == dtype, name
    assert ckpt["metadata"] == {"format": "pt"}
    assert ckpt["files"] == ["config.json", "config.py", "model.safetensors"]
    # randomised: no norm gain is the identity, no tensor is NaN
    for name, x in tensors.items():
        if x.is_floating_point():
            assert torch.isfinite(x).all(), name
        if "norm" in name and x.ndim == 1:
            assert not torch.equal(x, torch.ones_like(x)), name
    ver = H.verifier_tensors(verifier_dir)
    if v.reduced_vocab:
        t2d, d2t = tensors["t2d"], tensors["d2t"]
        assert int(t2d.sum()) == v.draft_vocab_size == d2t.numel()
        target = torch.arange(d2t.numel()) + d2t
        assert torch.equal(target, torch.nonzero(t2d).squeeze(1))
        assert (target[1:] > target[:-1]).all() and d2t.unique().numel() > 1
    if "lm_head.weight" in tensors:
        head = ver["lm_head"][tensors["t2d"]] if v.reduced_vocab else ver["lm_head"]
        assert torch.equal(tensors["lm_head.weight"], head) is (not v.own_lm_head)
    if "embed_tokens.weight" in tensors:
        assert torch.equal(tensors["embed_tokens.weight"], ver["embed_tokens"])


# ---------------------------------------------------------------------------------- the tests


def test_harness_imports_from_interop_dir(H):  # noqa: N803
    assert Path(H.__file__).parent == Path(__file__).parent
    from speculators import SpeculatorModel  # noqa: F401
    from speculators.models import DFlashDraftModel, DSparkDraftModel, Eagle3DraftModel  # noqa: F401

    assert set(H.VARIANT_NAMES) == set(VARIANT_NAMES)


def test_verifier_features_follow_the_after_l_layers_convention(H, torch, verifiers):  # noqa: N803
    for name in VERIFIERS:
        feats = H.make_inputs(verifiers[name], list(range(N_LAYERS + 1)), 9)
        hf = feats["hf_hidden_states"]
        assert len(hf) == N_LAYERS + 1
        for lid in range(N_LAYERS):
            torch.testing.assert_close(feats["taps"][lid], hf[lid], rtol=0, atol=0)
        # id N is pre-norm; HF's last entry is post-norm
        norm = H.verifier_tensors(verifiers[name])["norm"]
        torch.testing.assert_close(_rms(torch, feats["taps"][N_LAYERS], norm), hf[N_LAYERS])
        assert not torch.allclose(feats["taps"][N_LAYERS], hf[N_LAYERS])
        assert feats["features"].shape == (1, 9, (N_LAYERS + 1) * HID)


def test_shift_for_eagle3_uses_speculators_shift_batch(H, torch, inputs):  # noqa: N803
    raw = inputs("qwen3", (1, 3, 5), SEQ + 1)
    s = H.shift_for_eagle3(raw["input_ids"], raw["features"])
    assert torch.equal(s["input_ids"], raw["input_ids"][:, 1:])
    assert torch.equal(s["hidden_states"], raw["features"][:, :-1])
    assert torch.equal(s["position_ids"], torch.arange(1, SEQ + 1)[None])


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_variant_builds_reloads_and_runs(name, H, torch, built, inputs, verifiers):  # noqa: N803
    v = VARIANTS[name]
    verifier_dir = verifiers[v.verifier]
    path = built(name)  # build() already reloaded it and compared state dicts
    ckpt = H.read_checkpoint(path)
    _check_config(ckpt["config"], v, verifier_dir)
    _check_tensors(H, torch, ckpt, v, verifier_dir)
    tensors = ckpt["tensors"]
    vd = v.draft_vocab_size or V
    model = H.load_drafter(path)
    head = model.lm_head.weight.detach()
    if v.algorithm == "eagle3":
        s = _eagle3_inputs(H, inputs, v)
        out = H.eagle3_run(path, s["hidden_states"], s["input_ids"], ttt_steps=v.ttt_steps)
        logits = H.eagle3_logits(path, s["hidden_states"], s["input_ids"], ttt_steps=v.ttt_steps)
        assert len(logits) == v.ttt_steps
        for k in range(v.ttt_steps):
            assert logits[k].shape == (SEQ, vd) and torch.isfinite(logits[k]).all()
            torch.testing.assert_close(logits[k], out["logits"][k], rtol=0, atol=0)
            # positions 1..T shifted by k; teacher-forced tokens x_{i+1+k}, pad 0
            assert torch.equal(out["position_ids"][k], torch.arange(SEQ) + 1 + k)
            ids = torch.cat([s["input_ids"][0, k:], torch.zeros(k, dtype=torch.long)])
            assert torch.equal(out["input_ids"][k], ids)
            torch.testing.assert_close(out["embed_in"][k], model.embed_tokens.weight[ids])
            if k:
                torch.testing.assert_close(out["hidden_in"][k], out["fed_back"][k - 1])
            # logits = lm_head(norm(z))
            z = out["last_layer"][k]
            torch.testing.assert_close(
                logits[k], _rms(torch, z, tensors["norm.weight"]) @ head.T, rtol=1e-5, atol=1e-5
            )
            for li in range(v.num_layers):
                sliding = v.layer_types is not None and v.layer_types[li] == "sliding_attention"
                want = _expected_eagle3_mask(torch, SEQ, k, v.sliding_window if sliding else None)
                assert torch.equal(out["masks"][k][li], want), (k, li)
        # fused features at step 0 (the raw tapped features go in)
        g = s["hidden_states"][0]
        if v.norm_before_fc:
            g = _rms(torch, g, tensors["input_norm.weight"])
        if v.fc_norm:
            chunks = g.chunk(len(v.aux_layer_ids), -1)
            g = torch.cat(
                [_rms(torch, c, tensors[f"fc_norm.{j}.weight"]) for j, c in enumerate(chunks)], -1
            )
        torch.testing.assert_close(
            out["hidden_in"][0], g @ tensors["fc.weight"].T, rtol=1e-5, atol=1e-5
        )
        want_fb = (
            _rms(torch, out["last_layer"], tensors["norm.weight"])
            if v.norm_output
            else out["last_layer"]
        )
        torch.testing.assert_close(out["fed_back"], want_fb, rtol=1e-5, atol=1e-5)
        assert torch.equal(out["valid"][1], torch.arange(SEQ) <= SEQ - 2)
        return

    bk = v.block_size
    anchors = [a for a in ANCHORS if a <= SEQ - bk]
    n = len(anchors)
    raw = inputs(v.verifier, v.aux_layer_ids, SEQ)
    out = H.block_logits(path, raw["features"], raw["input_ids"], anchors)
    x = raw["input_ids"][0]
    a = torch.tensor(anchors)
    slot = torch.arange(bk)
    sfa = v.effective_sample_from_anchor()
    assert out["sample_from_anchor"] is sfa and out["block_size"] == bk
    assert out["logits"].shape == (n, bk, vd) and torch.isfinite(out["logits"]).all()
    assert out["hidden"].shape == (n, bk, HID)
    # block input: anchor token then MASK, positions p..p+Bk-1; context positions 0..T-1
    want_ids = torch.full((n, bk), v.mask_token_id)
    want_ids[:, 0] = x[a]
    assert torch.equal(out["block_token_ids"], want_ids)
    assert torch.equal(out["block_position_ids"], a[:, None] + slot)
    assert torch.equal(out["context_position_ids"], torch.arange(SEQ))
    assert torch.equal(out["target_index"], a[:, None] + slot + (1 if sfa else 0))
    assert torch.equal(out["draft_slots"], slot >= (0 if sfa else 1))
    torch.testing.assert_close(out["base_logits"], out["hidden"] @ head.T, rtol=1e-5, atol=1e-5)
    if v.reduced_vocab and not v.own_lm_head:
        torch.testing.assert_close(
            head, H.verifier_tensors(verifier_dir)["lm_head"][tensors["t2d"]]
        )
    if not v.reduced_vocab:  # not saved: rebuilt from the verifier on load
        assert torch.equal(head, H.verifier_tensors(verifier_dir)["lm_head"])
    sliding = [i for i, t in enumerate(v.layer_types or ()) if t == "sliding_attention"]
    assert out["sliding_layers"] == sliding
    for li in range(v.num_layers):
        window = v.sliding_window if li in sliding else None
        non_causal = li not in sliding or v.sliding_window_non_causal
        want = _expected_block_mask(torch, SEQ, anchors, bk, window, non_causal)
        assert torch.equal(out["masks"][li], want), li
    if v.algorithm == "dflash" or v.markov_rank == 0:
        assert out["markov_bias"] is None and out["prev_token_ids"] is None
        assert torch.equal(out["logits"], out["base_logits"])
    else:
        blk = x[a[:, None] + slot]
        want_prev = blk if sfa else torch.cat([blk[:, :1], blk[:, :-1]], 1)
        assert torch.equal(out["prev_token_ids"], want_prev)
        torch.testing.assert_close(out["logits"], out["base_logits"] + out["markov_bias"])
        e = tensors["markov_head.markov_w1.weight"][want_prev]
        w2 = tensors["markov_head.markov_w2.weight"]
        hid = out["hidden"]
        if v.markov_head_type == "vanilla":
            bias = e @ w2.T
        elif v.markov_head_type == "gated":
            gate = torch.sigmoid(
                torch.cat([hid, e], -1) @ tensors["markov_head.gate_proj.weight"].T
                + tensors["markov_head.gate_proj.bias"]
            )
            bias = (gate * e) @ w2.T
        else:
            state = torch.zeros(n, v.markov_rank)
            outs = []
            for k in range(bk):
                z = torch.cat([state, e[:, k], hid[:, k]], -1)
                zz = (
                    z @ tensors["markov_head.joint_proj.weight"].T
                    + tensors["markov_head.joint_proj.bias"]
                )
                g_, c_, o_ = zz.chunk(3, -1)
                g_ = torch.sigmoid(g_)
                state = g_ * state + (1 - g_) * torch.tanh(c_)
                outs.append(torch.tanh(o_) @ w2.T)
            bias = torch.stack(outs, 1)
        torch.testing.assert_close(out["markov_bias"], bias, rtol=1e-5, atol=1e-5)
    if v.algorithm == "dspark" and v.enable_confidence_head:
        assert out["confidence"].shape == (n, bk)
        feat = out["hidden"]
        if v.confidence_head_with_markov:
            feat = torch.cat(
                [feat, tensors["markov_head.markov_w1.weight"][out["prev_token_ids"]]], -1
            )
        want_c = (feat @ tensors["confidence_head.proj.weight"].T)[..., 0] + (
            tensors["confidence_head.proj.bias"]
        )
        torch.testing.assert_close(out["confidence_logits"], want_c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["confidence"], torch.sigmoid(want_c))
    else:
        assert out["confidence"] is None and out["confidence_logits"] is None


def test_eagle3_rows_depend_only_on_their_prefix(H, torch, built, inputs):  # noqa: N803
    """Row i of step k equals the same row computed on the sequence truncated to i+k+1 rows."""
    v = VARIANTS["eagle3_llama_2layer_sliding"]
    path = built(v.name)
    s = _eagle3_inputs(H, inputs, v)
    full = H.eagle3_logits(path, s["hidden_states"], s["input_ids"], ttt_steps=3)
    for length in (5, 9, 12):
        part = H.eagle3_logits(
            path, s["hidden_states"][:, :length], s["input_ids"][:, :length], ttt_steps=3
        )
        for k in range(3):
            rows = length - k  # rows i with i + k <= length - 1
            torch.testing.assert_close(part[k][:rows], full[k][:rows], rtol=1e-5, atol=1e-5)
            for i in range(rows, length):  # fed the pad id 0 instead of x_{i+1+k}
                if s["input_ids"][0, i + k] != 0:
                    assert not torch.allclose(part[k][i], full[k][i], atol=1e-3)


def test_attention_backends_agree(H, torch, built, inputs):  # noqa: N803
    v = VARIANTS["eagle3_llama_2layer_sliding"]
    s = _eagle3_inputs(H, inputs, v)
    path = built(v.name)
    ref = H.eagle3_run(path, s["hidden_states"], s["input_ids"], ttt_steps=3)["logits"]
    eager = H.eagle3_run(
        path, s["hidden_states"], s["input_ids"], ttt_steps=3, attn_implementation="eager"
    )["logits"]
    torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
    # speculators' default flex path (unfused on CPU) needs T % 128 == 0 for TTT steps >= 1
    s = _eagle3_inputs(H, inputs, v, seq_len=128)
    ref = H.eagle3_run(path, s["hidden_states"], s["input_ids"], ttt_steps=2)["logits"]
    flex = H.eagle3_run(
        path,
        s["hidden_states"],
        s["input_ids"],
        ttt_steps=2,
        attn_implementation="simple_flex_attention",
    )["logits"]
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)
    # DFlash/DSpark flex compiles create_block_mask (~25 s on CPU): eager vs sdpa only here
    v = VARIANTS["dspark_gated_reduced_vocab_sliding"]
    raw = inputs(v.verifier, v.aux_layer_ids)
    path = built(v.name)
    ref = H.block_logits(path, raw["features"], raw["input_ids"], [2, 9])
    eager = H.block_logits(
        path, raw["features"], raw["input_ids"], [2, 9], attn_implementation="eager"
    )
    for key in ("logits", "base_logits", "confidence_logits"):
        torch.testing.assert_close(eager[key], ref[key], rtol=1e-5, atol=1e-5)


def test_blocks_are_independent_and_see_only_their_context(H, torch, built, inputs):  # noqa: N803
    v = VARIANTS["dflash_sliding_non_causal"]  # both layers sliding, window 4
    path = built(v.name)
    raw = inputs(v.verifier, v.aux_layer_ids)
    feats, ids = raw["features"], raw["input_ids"]
    p = 9
    both = H.block_logits(path, feats, ids, [3, p])
    alone = H.block_logits(path, feats, ids, [p])
    torch.testing.assert_close(both["logits"][1], alone["logits"][0], rtol=1e-5, atol=1e-5)

    def with_noise(rows):
        f = feats.clone()
        f[:, rows] += 3.0
        return H.block_logits(path, f, ids, [p])["logits"][0]

    late = list(range(p, SEQ))  # positions >= p (incl. the anchor's own features)
    torch.testing.assert_close(with_noise(late), alone["logits"][0], rtol=1e-5, atol=1e-5)
    early = list(range(0, p - v.sliding_window))  # outside the window of every layer
    torch.testing.assert_close(with_noise(early), alone["logits"][0], rtol=1e-5, atol=1e-5)
    inside = [p - v.sliding_window]
    assert not torch.allclose(with_noise(inside), alone["logits"][0])
    # tokens after the anchor are not read by DFlash (no Markov head)
    ids2 = ids.clone()
    ids2[:, p + 1 :] = 0
    torch.testing.assert_close(
        H.block_logits(path, feats, ids2, [p])["logits"][0],
        alone["logits"][0],
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", ["eagle3_llama_2layer_sliding", "dflash_sliding"])
def test_sliding_window_changes_the_logits(name, H, torch, built, inputs, tmp_path):  # noqa: N803
    v = VARIANTS[name]
    path = built(name)
    full = tmp_path / "full"
    shutil.copytree(path, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention"] * v.num_layers
    (full / "config.json").write_text(json.dumps(cfg))
    if v.algorithm == "eagle3":
        s = _eagle3_inputs(H, inputs, v)
        a = H.eagle3_logits(path, s["hidden_states"], s["input_ids"], ttt_steps=2)
        b = H.eagle3_logits(full, s["hidden_states"], s["input_ids"], ttt_steps=2)
        w = v.sliding_window
        torch.testing.assert_close(a[0][:w], b[0][:w], rtol=1e-5, atol=1e-5)  # window not hit
        assert not torch.allclose(a[0][w:], b[0][w:], atol=1e-3)
    else:
        raw = inputs(v.verifier, v.aux_layer_ids)
        a = H.block_logits(path, raw["features"], raw["input_ids"], [2, 10])["logits"]
        b = H.block_logits(full, raw["features"], raw["input_ids"], [2, 10])["logits"]
        # anchor 2: window covers all context, but in-block attention turns bidirectional
        assert not torch.allclose(a, b, atol=1e-3)


def test_reduced_vocab_mapping_is_a_real_offset(H, torch):  # noqa: N803
    t2d, d2t = H.make_vocab_mapping(V, REDUCED_VOCAB, seed=7)
    assert t2d.dtype == torch.bool and d2t.dtype == torch.int64
    assert t2d[0] and t2d[-1] and int(t2d.sum()) == REDUCED_VOCAB
    assert d2t[0] == 0 and d2t[-1] == V - REDUCED_VOCAB and d2t.unique().numel() > 2


def test_run_reference_bundles_inputs_and_outputs(H, torch, built, verifiers):  # noqa: N803
    for name in ("eagle3_llama_cli_defaults", "dspark_rnn"):
        v = VARIANTS[name]
        ref = H.run_reference(v, built(name), verifiers[v.verifier], seq_len=12, seed=5)
        ins, outs = ref["inputs"], ref["outputs"]
        if v.algorithm == "eagle3":
            assert ins["input_ids"].shape == (1, 12)
            assert ins["hidden_states"].shape == (1, 12, 3 * HID)
            assert outs["logits"].shape == (v.ttt_steps, 12, REDUCED_VOCAB)
        else:
            assert torch.equal(ins["anchor_positions"], torch.arange(12 - v.block_size + 1))
            assert outs["logits"].shape == (12 - v.block_size + 1, v.block_size, V)
