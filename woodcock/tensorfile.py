"""safetensors files as memory-mapped numpy arrays, and a streaming writer that hashes as it writes.

numpy cannot hold bfloat16 by itself; `ml_dtypes` gives it a real dtype, so a BF16 tensor is a
zero-copy view of the file and survives a read-write cycle bit for bit. The official `safetensors`
package refuses BF16 for numpy, hence this small reader.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

# A header larger than this is not a drafter's (speculators headers are a few kB per tensor).
MAX_HEADER_BYTES = 100 * 1024 * 1024
HASH_CHUNK_BYTES = 16 * 1024 * 1024


def dtype_name(array: np.ndarray) -> str:
    """The safetensors name of an array's dtype."""
    try:
        return DTYPE_NAMES[array.dtype]
    except KeyError:
        raise DrafterError(f"dtype {array.dtype} cannot be stored in safetensors") from None


def read_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file, validated against its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DrafterError(
                f"{path}: truncated safetensors file: {size} bytes, expected at least 8"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise DrafterError(
                f"{path}: safetensors header claims {header_len} bytes but the file has {size}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DrafterError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise DrafterError(f"{path}: safetensors header is not a JSON object")
    _check_entries(path, header, size - 8 - header_len)
    return 8 + header_len, header


def _check_entries(path: Path, header: dict, data_len: int) -> None:
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if entry is None:  # MLX writes null; the reference reader accepts it
                continue
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise DrafterError(f"{path}: __metadata__ must map strings to strings")
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise DrafterError(f"{where}: expected keys dtype, shape, data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise DrafterError(f"{where}: unknown dtype {dtype!r}, expected one of {list(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise DrafterError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise DrafterError(f"{where}: bad data_offsets {offsets!r}")
        if offsets[1] > data_len:
            raise DrafterError(
                f"{where}: data ends at byte {offsets[1]} but the file holds {data_len} data bytes"
                " (truncated file?)"
            )
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise DrafterError(
                f"{where}: {offsets[1] - offsets[0]} data bytes for shape {shape} {dtype},"
                f" expected {expected}"
            )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise DrafterError(
                f"{path}: tensor {name!r} starts at byte {begin}, expected {end}"
                " (tensors must be packed without gaps or overlaps)"
            )
        end = stop
    if end != data_len:
        raise DrafterError(f"{path}: {data_len - end} trailing bytes after the last tensor")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors as read-only views of a memory map (nothing is copied), and the file's metadata."""
    path = Path(path)
    data_start, header = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if os.path.getsize(path) == data_start:
        return {name: _empty(entry) for name, entry in header.items()}, metadata
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = {}
    for name, entry in header.items():
        dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        flat = np.frombuffer(
            mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin
        )
        tensors[name] = flat.reshape(entry["shape"])
    return tensors, metadata


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index names, else every
    *.safetensors file in it."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        files = weight_map.values() if isinstance(weight_map, dict) else None
        if files is None or not all(isinstance(v, str) for v in files):
            raise DrafterError(f"{index}: expected a weight_map of tensor name -> file name")
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path}: no model.safetensors (or index of shards)")
    return files


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) checkpoint directory, memory-mapped."""
    tensors: dict[str, np.ndarray] = {}
    for file in checkpoint_files(path):
        for name, array in read_safetensors(file)[0].items():
            if name in tensors:
                raise DrafterError(f"{file}: tensor {name!r} also appears in another shard")
            tensors[name] = array
    return tensors


def _empty(entry: dict) -> np.ndarray:
    return np.zeros(entry["shape"], dtype=DTYPES[entry["dtype"]])


def write_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> str:
    """Write tensors one at a time (memory maps stay maps) and return the file's sha256."""
    names = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in names:
        array = tensors[name]
        header[name] = {
            "dtype": dtype_name(array),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (
        -len(encoded) % 8
    )  # data starts 8-byte aligned, as the reference writer does
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in _chunks([struct.pack("<Q", len(encoded)), encoded], tensors, names):
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def _chunks(prefix: list[bytes], tensors: Mapping[str, np.ndarray], names: Iterable[str]):
    yield from prefix
    for name in names:
        raw = memoryview(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8))
        for start in range(0, len(raw), HASH_CHUNK_BYTES):
            yield raw[start : start + HASH_CHUNK_BYTES]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
