"""Every format pair, every algorithm: a drafter written in a format that can hold it converts
(through `woodcock convert`) into every other format that can hold it, and the torch reference
gives the same draft logits and tokens before and after (fp32, <= 1e-5; the copies are bit-exact
so the difference is 0). Into a format that cannot hold it, the conversion is refused with one
line saying why, and nothing is written."""

import dataclasses
import json
import shutil
import threading

import numpy as np
import pytest
import torch

from woodcock.cli import main
from woodcock.errors import DrafterError
from woodcock.formats.detect import FORMATS, detect, format_named
from woodcock.ir import Drafter, Fusion, Head, Taps
from woodcock.loading import load_drafter
from woodcock.reference import TorchDrafter
from woodcock.staging import check, checks_in_background, staged_directory
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import (
    COPY_ALIGNMENT,
    file_sha256,
    read_header,
    read_safetensors,
    write_safetensors,
)

V, H = 96, 32
TARGET_LAYERS = 8
ALL = [fmt.NAME for fmt in FORMATS]
EAGLE3 = {"woodcock", "speculators", "safeailab", "specforge"}
SHARES_HEAD = {"zlab-dflash", "specforge-dspark"}


def with_(spec, **changes):
    return dataclasses.replace(spec, **changes)


def eagle3(**fields):
    spec = tiny_spec("eagle3", target_layers=TARGET_LAYERS, **fields)
    # the taps SafeAILab's target code captures for 8 layers: 2, 8 // 2, 8 - 3
    return with_(spec, taps=Taps((2, 4, 5)))


def block(algorithm, **fields):
    return tiny_spec(algorithm, style="qwen3", target_layers=TARGET_LAYERS, **fields)


# name -> (spec, the formats that can hold it)
CASES = {
    "eagle3-reduced-vocab": (eagle3(draft_vocab_size=40), EAGLE3),
    "eagle3-own-embedding-fc-norm": (
        with_(
            eagle3(tap_norm="per_tap"),
            head=Head(lm_head="own", embedding="own"),
        ),
        {"woodcock", "speculators", "specforge"},
    ),
    "eagle3-2-layers": (eagle3(num_layers=2, draft_vocab_size=50), {"woodcock", "speculators"}),
    "eagle3.1-qwen3": (
        eagle3(style="qwen3", norm_output=True, norm_before_residual=True),
        {"woodcock", "speculators"},
    ),
    "dflash": (block("dflash"), {"woodcock", "speculators", "zlab-dflash"}),
    "dflash-reduced-vocab": (
        with_(block("dflash", draft_vocab_size=40), head=Head(lm_head="own", embedding="shared")),
        {"woodcock", "speculators"},
    ),
    "dspark-shared-head": (
        block("dspark", markov_head_type="vanilla"),
        {"woodcock", "speculators", "specforge-dspark"},
    ),
    "dspark-own-head-rnn": (
        with_(
            block("dspark", markov_head_type="rnn", confidence_head_with_markov=False),
            head=Head(lm_head="own", embedding="own"),
        ),
        {"woodcock", "speculators", "deepspec-dspark"},
    ),
    "dspark-gated-no-confidence": (
        block("dspark", markov_head_type="gated", confidence_head=False),
        {"woodcock", "speculators", "specforge-dspark"},
    ),
}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny matrices: threads only add contention (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def target_tensors():
    rng = np.random.default_rng(7)
    return {
        "embed_tokens.weight": rng.standard_normal((V, H), dtype=np.float32),
        "lm_head.weight": 0.3 * rng.standard_normal((V, H), dtype=np.float32),
    }


TARGET = target_tensors()


def make(spec):
    """random_drafter with larger weights, so that a wrong tensor moves the logits visibly."""
    drafter = random_drafter(spec, seed=3)
    weights = {
        name: a if name.endswith("norm.weight") else a * np.float32(5.0)
        for name, a in drafter.weights.items()
    }
    return Drafter(spec, drafter.vocab, weights)


def draft(drafter):
    """Greedy draft tokens and logits from fixed random target features."""
    spec = drafter.spec
    model = TorchDrafter(drafter, TARGET)
    rng = np.random.default_rng(11)
    taps = torch.from_numpy(
        rng.standard_normal((6, len(spec.taps.layer_ids) * spec.target.hidden_size))
    ).float()
    if spec.is_block:
        result = model.block_draft(taps, 5)
    else:
        result = model.eagle3_draft(taps, torch.from_numpy(rng.integers(0, V, 7)), 4)
    return result


def taps_args(fmt_name, spec):
    """SafeAILab does not store taps: the user states them."""
    if fmt_name != "safeailab":
        return []
    return ["--taps", ",".join(str(i) for i in spec.taps.layer_ids)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The target's config: z-lab and SpecForge DSpark files need its layer count, which the
    speculators format does not record (--target records it; those formats share the head)."""
    path = tmp_path_factory.mktemp("target")
    config = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": TARGET_LAYERS}
    (path / "config.json").write_text(json.dumps({**config, "hidden_size": H, "vocab_size": V}))
    write_safetensors(
        path / "model.safetensors", {"model.embed_tokens.weight": TARGET["embed_tokens.weight"]}
    )
    return path


def target_args(dest_name, target_dir):
    return ["--target", str(target_dir)] if dest_name in SHARES_HEAD else []


def run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, *capsys.readouterr()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_pair(case, tmp_path, capsys, target_dir):
    spec, holders = CASES[case]
    assert holders <= set(ALL)
    drafter = make(spec)
    expected = draft(drafter)
    for source_name in sorted(holders):
        source = tmp_path / f"src-{source_name}"
        format_named(source_name).write(drafter, source)
        assert detect(source).NAME == source_name
        for dest_name in ALL:
            dest = tmp_path / f"{source_name}-to-{dest_name}"
            code, out, err = run(
                ["convert", str(source), str(dest), "--to", dest_name]
                + taps_args(source_name, spec)
                + target_args(dest_name, target_dir),
                capsys,
            )
            pair = f"{case}: {source_name} -> {dest_name}"
            if dest_name not in holders:
                assert code == 2, pair
                assert err.startswith("woodcock: error: ") and err.count("\n") == 1, (pair, err)
                assert not dest.exists(), pair
                assert not list(tmp_path.glob(f".{dest.name}*")), pair
                continue
            assert code == 0, (pair, err)
            assert detect(dest).NAME == dest_name, pair
            converted = load_drafter(
                dest, taps=spec.taps.layer_ids if dest_name == "safeailab" else None
            )
            assert converted.spec.taps == spec.taps, pair
            result = draft(converted)
            assert torch.equal(result.tokens, expected.tokens), pair
            assert torch.allclose(result.logits, expected.logits, rtol=0, atol=1e-5), pair
            if expected.confidence is not None:
                assert torch.allclose(result.confidence, expected.confidence, atol=1e-6), pair


def test_the_refusals_say_why(tmp_path, capsys):
    """Three refusals users meet, and what their one line says."""
    cases = [
        (CASES["dspark-shared-head"][0], "safeailab", "SafeAILab holds EAGLE-3 drafters only"),
        (CASES["dspark-shared-head"][0], "specforge", "SpecForge holds EAGLE-3"),
        (
            CASES["dflash-reduced-vocab"][0],
            "zlab-dflash",
            "a reduced draft vocabulary (40 of 96 ids): z-lab DFlash has no draft-to-target map",
        ),
        (CASES["eagle3-2-layers"][0], "safeailab", "exactly one decoder layer; this drafter has 2"),
        (CASES["dflash"][0], "deepspec-dspark", "DeepSpec DSpark holds DSpark drafters only"),
        (
            CASES["dspark-own-head-rnn"][0],
            "specforge-dspark",
            "the drafter's own embedding and lm_head (SpecForge DSpark always uses the target's)",
        ),
        (
            CASES["dspark-shared-head"][0],
            "deepspec-dspark",
            "shared with the target (DeepSpec stores both; pass --target to copy them in)",
        ),
    ]
    for i, (spec, dest_name, message) in enumerate(cases):
        source = tmp_path / f"s{i}"
        format_named("woodcock").write(make(spec), source)
        code, _, err = run(
            ["convert", str(source), str(tmp_path / f"d{i}"), "--to", dest_name], capsys
        )
        assert code == 2 and message in err, (dest_name, err)
        assert not (tmp_path / f"d{i}").exists()


@pytest.mark.parametrize("dest_format", ["speculators", "woodcock"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_source_failing_its_sha256_leaves_no_output(tmp_path, capsys, dest_format, dry_run):
    """The weights' sha256 is checked while the output is written: a mismatch still fails the
    conversion with the manifest's line, and nothing appears (not even a plan)."""
    source = tmp_path / "src"
    format_named("woodcock").write(make(CASES["eagle3-reduced-vocab"][0]), source)
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # in the last tensor's data: the file still parses
    weights.write_bytes(bytes(data))
    dest = tmp_path / "out"
    code, out, err = run(
        ["convert", str(source), str(dest), "--to", dest_format] + ["--dry-run"] * dry_run,
        capsys,
    )
    assert code == 2 and "model.safetensors: sha256" in err and "does not match" in err, err
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_drafter_with_non_finite_weights_is_refused(tmp_path, capsys, bad):
    drafter = make(CASES["eagle3-reduced-vocab"][0])
    weights = dict(drafter.weights)
    fc = weights["fc.weight"].copy()
    fc[3, 5] = bad
    weights["fc.weight"] = fc
    source = tmp_path / "src"
    format_named("speculators").write(dataclasses.replace(drafter, weights=weights), source)
    for dry_run in (False, True):
        code, out, err = run(
            ["convert", str(source), str(tmp_path / "out"), "--to", "woodcock"]
            + ["--dry-run"] * dry_run,
            capsys,
        )
        assert code == 2 and out == "", err
        assert err.strip() == (
            f"woodcock: error: {source}: tensor 'fc.weight' holds inf or nan values;"
            " expected finite weights"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_background_checks_gate_the_staged_output(tmp_path):
    release, ran_in = threading.Event(), []

    def failing_check():
        ran_in.append(threading.get_ident())
        release.wait(10)
        raise DrafterError("source: damaged")

    with pytest.raises(DrafterError, match="source: damaged"):
        with checks_in_background():
            check(failing_check)
            with staged_directory(tmp_path / "out") as staging:
                (staging / "file").write_text("written before the check ended")
                release.set()
    assert ran_in and ran_in[0] != threading.get_ident()
    assert list(tmp_path.iterdir()) == []
    calls = []  # outside the block a check runs at once, in this thread
    check(lambda: calls.append(threading.get_ident()))
    assert calls == [threading.get_ident()]


def test_block_formats_need_the_target_layer_count(tmp_path, capsys, target_dir):
    source = tmp_path / "speculators"
    format_named("speculators").write(make(CASES["dflash"][0]), source)
    dest = tmp_path / "zlab"
    code, _, err = run(["convert", str(source), str(dest), "--to", "zlab-dflash"], capsys)
    assert code == 2 and "needs num_target_layers" in err and "pass --target" in err
    code, _, err = run(
        ["convert", str(source), str(dest), "--to", "zlab-dflash", "--target", str(target_dir)],
        capsys,
    )
    assert code == 0, err
    config = json.loads((dest / "config.json").read_text())
    assert config["num_target_layers"] == TARGET_LAYERS
    assert load_drafter(dest).spec.head == Head(lm_head="shared", embedding="shared")


def test_a_target_of_another_shape_is_refused(tmp_path, capsys, target_dir):
    """--target must be the target the drafter was built for: sizes, and the layer count where
    the source records it (speculators does not: the target's is recorded)."""
    drafter = make(CASES["eagle3-reduced-vocab"][0])
    assert drafter.spec.target.num_hidden_layers == TARGET_LAYERS
    source, unrecorded = tmp_path / "src", tmp_path / "speculators"
    format_named("woodcock").write(drafter, source)
    format_named("speculators").write(drafter, unrecorded)
    config = json.loads((target_dir / "config.json").read_text())
    for field, value in (("num_hidden_layers", 12), ("hidden_size", 2 * H)):
        other = tmp_path / f"other-{field}"
        shutil.copytree(target_dir, other)
        (other / "config.json").write_text(json.dumps({**config, field: value}))
        code, out, err = run(
            [
                "convert",
                str(source),
                str(tmp_path / "out"),
                "--to",
                "woodcock",
                "--target",
                str(other),
            ],
            capsys,
        )
        recorded = getattr(drafter.spec.target, field)
        assert code == 2 and err.strip() == (
            f"woodcock: error: target {other}: {field} = {value}, but the drafter was built for"
            f" {recorded}"
        ), err
        assert not (tmp_path / "out").exists()
    code, _, err = run(
        [
            "convert",
            str(unrecorded),
            str(tmp_path / "out"),
            "--to",
            "woodcock",
            "--target",
            str(other.parent / "other-num_hidden_layers"),
        ],
        capsys,
    )
    assert code == 0, err
    assert load_drafter(tmp_path / "out").spec.target.num_hidden_layers == 12


def test_the_summary_names_what_the_output_format_does_not_keep(tmp_path, capsys):
    from woodcock.ir import VocabCounts

    drafter = make(CASES["eagle3-reduced-vocab"][0])
    counts = VocabCounts(np.arange(V, dtype=np.int64), {"source": "test corpus"})
    algorithm = dataclasses.replace(drafter.spec.algorithm, speculative_tokens=5)
    drafter = Drafter(
        dataclasses.replace(drafter.spec, algorithm=algorithm),
        dataclasses.replace(drafter.vocab, counts=counts),
        drafter.weights,
    )
    source = tmp_path / "src"
    format_named("woodcock").write(drafter, source)
    code, out, err = run(
        ["convert", str(source), str(tmp_path / "spec"), "--to", "speculators"], capsys
    )
    assert code == 0, err
    assert out.splitlines()[-1] == (
        "not kept by speculators (the output reads back without them): token counts (PATH@N"
        " truncation needs a counts file then), the target's layer count"
    )
    code, out, err = run(
        ["convert", str(source), str(tmp_path / "sf"), "--to", "specforge"], capsys
    )
    assert code == 0, err
    assert "speculative_tokens 5 (read back as 3)" in out.splitlines()[-1]
    code, out, err = run(
        ["convert", str(source), str(tmp_path / "dry"), "--to", "speculators", "--dry-run"],
        capsys,
    )
    assert code == 0 and out.splitlines()[0].startswith("dry run: nothing written"), err
    assert out.splitlines()[-1].startswith("not kept by speculators") and "token counts" in out
    assert not (tmp_path / "dry").exists()
    code, out, err = run(
        ["convert", str(source), str(tmp_path / "same"), "--to", "woodcock"], capsys
    )
    assert code == 0 and "not kept" not in out


def test_taps_other_than_safeailabs_are_refused(tmp_path):
    spec = with_(CASES["eagle3-reduced-vocab"][0], taps=Taps((1, 4, 5)))
    with pytest.raises(DrafterError, match=r"always captures ids \(2, N//2, N-3\) = \[2, 4, 5\]"):
        format_named("safeailab").write(make(spec), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_fused_bias_or_concat_norm_is_refused_by_every_research_format(tmp_path):
    spec = CASES["eagle3-reduced-vocab"][0]
    for fusion in (
        Fusion(tap_norm="none", fc_bias=True, hidden_norm=False),
        Fusion(tap_norm="concat", fc_bias=False, hidden_norm=False),
    ):
        drafter = make(with_(spec, fusion=fusion))
        for name in ("safeailab", "specforge"):
            with pytest.raises(DrafterError, match="cannot hold"):
                format_named(name).write(drafter, tmp_path / name)
            assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------------------------
# Streaming: tensors go from file to file one at a time, without staying in memory


def test_unhashed_writes_copy_mapped_tensors_page_aligned(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.standard_normal((300, 70)).astype(np.float32),
        "b": rng.integers(0, 9, 1000).astype(np.int64),
        "c": np.zeros((0, 4), np.float32),
        "d": rng.standard_normal(5000).astype(np.float32),
    }
    write_safetensors(tmp_path / "src.safetensors", arrays)
    # built in memory only: the same bytes with or without the digest
    write_safetensors(tmp_path / "plain-src.safetensors", arrays, digest=False)
    assert (tmp_path / "plain-src.safetensors").read_bytes() == (
        tmp_path / "src.safetensors"
    ).read_bytes()
    mapped, _ = read_safetensors(tmp_path / "src.safetensors")
    tensors = {
        "z-renamed": mapped["a"],  # still as in the file: copied by the kernel
        "b": mapped["b"],
        "c": mapped["c"],
        "d": mapped["d"],
        "a.T": mapped["a"].T,  # not contiguous: written by hand
        "fresh": rng.standard_normal(32).astype(np.float32),  # in memory
    }
    assert write_safetensors(tmp_path / "plain.safetensors", tensors, digest=False) == ""
    digest = write_safetensors(tmp_path / "hashed.safetensors", tensors)
    assert digest == file_sha256(tmp_path / "hashed.safetensors")
    # hashing changes nothing in what is written
    assert (tmp_path / "hashed.safetensors").read_bytes() == (
        tmp_path / "plain.safetensors"
    ).read_bytes()
    for name in ("plain", "hashed"):
        again, _ = read_safetensors(tmp_path / f"{name}.safetensors")
        assert set(again) == set(tensors)
        for key, array in tensors.items():
            assert np.array_equal(again[key], array), (name, key)
    for name, array in arrays.items():  # the source pages were released, not lost
        assert np.array_equal(mapped[name], array)
    # mapped tensors keep their file order among themselves (in the slots name order gives
    # them) and, for most of their bytes, their offsets modulo COPY_ALIGNMENT
    source_start, source_header = read_header(tmp_path / "src.safetensors")
    start, header = read_header(tmp_path / "plain.safetensors")
    out = {n: start + e["data_offsets"][0] for n, e in header.items() if n != "__metadata__"}
    source = {
        n: source_start + e["data_offsets"][0]
        for n, e in source_header.items()
        if n != "__metadata__"
    }
    assert out["z-renamed"] < out["b"] < out["d"]
    for out_name, in_name in (("z-renamed", "a"), ("b", "b")):
        assert (out[out_name] - source[in_name]) % COPY_ALIGNMENT == 0, out_name
    assert start % 8 == 0


def resident_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux /proc")
@pytest.mark.parametrize("digest", [True, False])
def test_writing_does_not_keep_the_source_resident(tmp_path, digest):
    big = np.ones((64, 1024, 1024), np.uint8)  # 64 MiB
    write_safetensors(tmp_path / "src.safetensors", {"big": big})
    del big
    mapped, _ = read_safetensors(tmp_path / "src.safetensors")
    before = resident_mb()
    write_safetensors(tmp_path / "out.safetensors", mapped, digest=digest)
    assert resident_mb() - before < 24  # one 16 MiB chunk at most, not the 64 MiB tensor
