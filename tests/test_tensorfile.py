import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from helpers import base_is_mmap

from woodcock.errors import DrafterError
from woodcock.tensorfile import DTYPES, file_sha256, read_safetensors, write_safetensors


def sample_tensors():
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.standard_normal((3, 5)).astype(dtype)
        for name, dtype in DTYPES.items()
        if name not in ("BOOL",) and not name.startswith(("I", "U"))
    }
    tensors["I64"] = np.arange(7, dtype=np.int64)
    tensors["BOOL"] = np.array([True, False, True])
    tensors["scalar"] = np.array(2.5, dtype=np.float32)
    tensors["empty"] = np.zeros((0, 4), dtype=np.float32)
    return tensors


def test_round_trip_is_bit_exact_and_memory_mapped(tmp_path):
    tensors = sample_tensors()
    digest = write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    assert digest == file_sha256(tmp_path / "t.safetensors")
    loaded, metadata = read_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"format": "pt"}
    assert set(loaded) == set(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        assert loaded[name].tobytes() == array.tobytes()
    assert base_is_mmap(loaded["BF16"])
    assert not loaded["F32"].flags.writeable


def test_files_agree_with_the_reference_safetensors_package(tmp_path):
    plain = {
        k: v for k, v in sample_tensors().items() if v.dtype != ml_dtypes.bfloat16 and "F8" not in k
    }
    write_safetensors(tmp_path / "ours.safetensors", plain)
    theirs = safetensors.numpy.load_file(tmp_path / "ours.safetensors")
    for name, array in plain.items():
        assert np.array_equal(theirs[name], array)
    safetensors.numpy.save_file(plain, tmp_path / "ref.safetensors")
    ours, _ = read_safetensors(tmp_path / "ref.safetensors")
    for name, array in plain.items():
        assert np.array_equal(ours[name], array)


def write_raw(path, header: dict, data: bytes, header_len=None):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len or len(encoded)) + encoded + data)


@pytest.mark.parametrize(
    "header, data, header_len, message",
    [
        ({}, b"", 10**6, "header claims"),
        (
            {"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "unknown dtype",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "expected 8",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            None,
            "truncated",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
            },
            b"\0" * 8,
            None,
            "gaps or overlaps",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 9,
            None,
            "trailing",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape"),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "expected keys"),
    ],
)
def test_damaged_files_are_refused_with_the_file_and_tensor_named(
    tmp_path, header, data, header_len, message
):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data, header_len)
    with pytest.raises(DrafterError, match=message) as info:
        read_safetensors(path)
    assert str(path) in str(info.value)


def test_truncated_and_garbage_files(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": np.ones((64, 64), np.float32)})
    full = path.read_bytes()
    for cut in (0, 5, 12, len(full) - 1):
        path.write_bytes(full[:cut])
        with pytest.raises(DrafterError, match=str(path)):
            read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(DrafterError, match="not valid JSON"):
        read_safetensors(path)
