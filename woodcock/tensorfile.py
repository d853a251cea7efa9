"""safetensors files as memory-mapped numpy arrays, and a streaming writer that hashes as it writes.

numpy cannot hold bfloat16 by itself; `ml_dtypes` gives it a real dtype, so a BF16 tensor is a
zero-copy view of the file and survives a read-write cycle bit for bit. The official `safetensors`
package refuses BF16 for numpy, hence this small reader. Torch zip state dicts
(pytorch_model.bin) are read as numpy views of the file too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import queue
import struct
import threading
import weakref
import zipfile
from collections.abc import Callable, Mapping
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
CHUNK_BYTES = 16 * 1024 * 1024
# Linux caches file pages in folios of up to 64 KiB and more; copying between equal offsets
# modulo this moves whole folios (see _alignment_padding).
COPY_ALIGNMENT = 64 * 1024


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
    mapped = map_file(path)
    tensors = {}
    for name, entry in header.items():
        dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        flat = np.frombuffer(
            mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin
        )
        tensors[name] = flat.reshape(entry["shape"])
    return tensors, metadata


def map_file(path: Path) -> mmap.mmap:
    """A read-only memory map of a whole file, whose arrays `write_safetensors` copies in the
    kernel and releases page by page."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        _remember_file(mapped, f.fileno())
    return mapped


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


def read_torch_bin(file: Path) -> dict[str, np.ndarray]:
    """A torch state dict as numpy arrays, memory-mapped (torch.load with mmap and
    weights_only: no pickle code runs). Needs torch."""
    try:
        import torch
    except ImportError:
        raise DrafterError(
            f"{file}: reading pytorch_model.bin needs torch (pip install 'woodcock[torch]')"
        ) from None
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DrafterError(f"{file}: not a readable torch state dict ({first})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise DrafterError(f"{file}: expected a dict of tensor name -> tensor")
    arrays = {}
    for name, tensor in state.items():
        if tensor.dtype == torch.bfloat16:
            array = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            try:
                array = tensor.numpy()
            except TypeError:
                raise DrafterError(f"{file}: tensor {name!r} has dtype {tensor.dtype}") from None
        arrays[name] = array
    return _as_file_views(file, state, arrays)


def _as_file_views(file: Path, state: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as views of our own map of the file instead of torch's, so that a conversion
    copies them in the kernel and releases their pages as it goes. torch.load(mmap=True) maps
    the whole file at one address, so every storage lies at base + its record's offset in the
    zip; when that does not hold (another torch), torch's views are kept."""
    sizes = {}  # address -> bytes of each distinct non-empty storage
    for tensor in state.values():
        storage = tensor.untyped_storage()
        if storage.nbytes():
            sizes[storage.data_ptr()] = storage.nbytes()
    storages, records = sorted(sizes.items()), _storage_records(file)
    if not records or len(storages) != len(records):
        return arrays
    pairs = list(zip(storages, records, strict=True))
    bases = {address - offset for (address, _), (offset, _) in pairs}
    if len(bases) != 1 or any(size != stored for (_, size), (_, stored) in pairs):
        return arrays
    base = bases.pop()
    mapped = map_file(file)
    views = {}
    for name, array in arrays.items():
        if array.nbytes == 0 or not array.flags.c_contiguous:
            views[name] = array
            continue
        offset = array.__array_interface__["data"][0] - base
        views[name] = np.frombuffer(
            mapped, dtype=array.dtype, count=array.size, offset=offset
        ).reshape(array.shape)
    return views


def _storage_records(file: Path) -> list[tuple[int, int]]:
    """(offset in the file, size) of each non-empty stored `*/data/<key>` record of a torch zip
    file, in file order."""
    records = []
    with zipfile.ZipFile(file) as archive, open(file, "rb") as f:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data" or not info.file_size:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                return []
            f.seek(info.header_offset)
            local = f.read(30)  # the local header: its name and extra lengths can differ
            name_length, extra_length = struct.unpack("<HH", local[26:30])
            records.append((info.header_offset + 30 + name_length + extra_length, info.file_size))
    return sorted(records)


def _empty(entry: dict) -> np.ndarray:
    return np.zeros(entry["shape"], dtype=DTYPES[entry["dtype"]])


def write_safetensors(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    digest: bool = True,
) -> str:
    """Write tensors one at a time (memory maps stay maps) and return the file's sha256 ("" with
    digest=False, which saves the hashing when nobody records the sum). Tensors are stored in
    name order, except that those still as they are in a mapped file keep that file's order
    among themselves, so the kernel can copy them page for page. The sha256 is computed by a
    second thread, piece by piece right behind the writing, so on two cores it costs about the
    time of hashing alone, not hashing plus writing."""
    names = _source_order(tensors, sorted(tensors))
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
    encoded += b" " * _alignment_padding(tensors, names, [header[n] for n in names], encoded)
    hasher = _BackgroundHasher() if digest else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for part in (struct.pack("<Q", len(encoded)), encoded):
            _write_all(fd, memoryview(part))
            if hasher:
                hasher.add(memoryview(part))
        for name in names:
            _write_tensor(fd, tensors[name], hasher)
        return hasher.hexdigest() if hasher else ""
    finally:
        os.close(fd)
        if hasher:
            hasher.stop()


class _BackgroundHasher:
    """sha256 of the pieces handed to `add`, in order, computed by a thread of its own (hashlib
    releases the GIL on large updates). At most `depth` pieces wait, which bounds how far the
    writer runs ahead and so how many source pages are mapped at once; a piece's `done`
    callback (page release) runs once it is hashed."""

    def __init__(self, depth: int = 2):
        self._sha = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def add(self, piece: memoryview, done: Callable[[], None] | None = None) -> None:
        self._queue.put((piece, done))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            piece, done = item
            self._sha.update(piece)
            if done:
                done()

    def hexdigest(self) -> str:
        self.stop()
        return self._sha.hexdigest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _write_tensor(fd: int, array: np.ndarray, hasher: _BackgroundHasher | None) -> None:
    """Write one tensor in pieces: each copied by the kernel when the array is still as it is in
    a mapped file, else written from memory; then hashed (if at all) and its mapped pages
    released, so the process never holds more than a few pieces of a source file."""
    where = _file_offset(array)
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    mapped = _mmap_of(raw)
    # pieces end at COPY_ALIGNMENT boundaries of the source file: the kernel copies from an
    # aligned start whole folios at a time (measured 3.5 against 2.6 GB/s)
    first = 0 if where is None else -where[1] % COPY_ALIGNMENT
    bounds = [0, *range(first or CHUNK_BYTES, raw.size, CHUNK_BYTES), raw.size]
    for start, stop in itertools.pairwise(bounds):
        piece = raw[start:stop]
        copied = where is not None and _kernel_copy(
            fd, _MAPPED_FILES[where[0]], where[1] + start, piece.size
        )
        if not copied:
            where = None  # the kernel could not: write by hand from here on
            _write_all(fd, memoryview(piece))
        release = (lambda p=piece: _release(mapped, p)) if mapped is not None else None
        if hasher:
            hasher.add(memoryview(piece), release)
        elif release and not copied:
            release()


# The file behind each memory map read_safetensors made (a duplicate descriptor, closed with
# the map): a tensor still as it is in its file is copied by the kernel (copy_file_range), as
# fast as copying the file, and enters this process only to be hashed.
_MAPPED_FILES: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()


def _remember_file(mapped: mmap.mmap, fileno: int) -> None:
    if not hasattr(os, "copy_file_range"):
        return
    fd = os.dup(fileno)
    _MAPPED_FILES[mapped] = fd
    weakref.finalize(mapped, os.close, fd)


def _file_offset(array: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """(memory map, byte offset in its file) of a C-contiguous view of a mapped file."""
    if array.nbytes == 0 or not array.flags.c_contiguous:
        return None
    mapped = _mmap_of(array)
    if mapped is None or mapped not in _MAPPED_FILES:
        return None
    base = np.frombuffer(mapped, dtype=np.uint8, count=1).__array_interface__["data"][0]
    return mapped, array.__array_interface__["data"][0] - base


def _source_order(tensors: Mapping[str, np.ndarray], names: list[str]) -> list[str]:
    """Name order, except that the slots of tensors still as they are in a mapped file are
    refilled in those files' order (files ranked by their first tensor's name): deterministic
    for a given input, and the same as name order when nothing moved."""
    files: dict[int, int] = {}
    mapped = []
    for i, name in enumerate(names):
        where = _file_offset(tensors[name])
        if where is not None:
            rank = files.setdefault(id(where[0]), len(files))
            mapped.append((rank, where[1], i))
    order = list(names)
    for slot, (*_, i) in zip(sorted(m[2] for m in mapped), sorted(mapped), strict=True):
        order[slot] = names[i]
    return order


def _alignment_padding(
    tensors: Mapping[str, np.ndarray], names: list[str], entries: list[dict], encoded: bytes
) -> int:
    """Extra header spaces (a multiple of 8) that put the most bytes of mapped tensors at the
    same offset modulo COPY_ALIGNMENT as in their source files: the kernel then copies whole
    page-cache folios, measured 1.4x as fast as copying at a shift of whole pages and about
    twice as fast as at a shift within a page. 0 when nothing is mapped (or already aligned)."""
    page = COPY_ALIGNMENT
    votes: dict[int, int] = {}
    for name, entry in zip(names, entries, strict=True):
        where = _file_offset(tensors[name])
        if where is None:
            continue
        want = (where[1] - entry["data_offsets"][0]) % page  # where the data should start
        votes[want] = votes.get(want, 0) + tensors[name].nbytes
    if not votes:
        return 0
    start = 8 + len(encoded)
    pad = (max(votes, key=votes.get) - start) % page
    return pad if pad % 8 == 0 else 0


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


def _kernel_copy(fd: int, source: int, offset: int, size: int) -> bool:
    """Append `size` bytes of file `source` from `offset` to `fd` without passing them through
    this process; False when the kernel cannot (e.g. across file systems on old kernels)
    before any byte was copied. A copy it stops half-way is finished by hand."""
    done = 0
    while done < size:
        try:
            copied = os.copy_file_range(source, fd, size - done, offset + done)
        except OSError:
            copied = 0
        if copied == 0:
            if done == 0:
                return False
            while done < size:
                part = os.pread(source, min(CHUNK_BYTES, size - done), offset + done)
                if not part:
                    raise DrafterError(f"source file ended {size - done} bytes early while copying")
                _write_all(fd, memoryview(part))
                done += len(part)
            return True
        done += copied
    return True


def _mmap_of(array: np.ndarray) -> mmap.mmap | None:
    """The memory map an array views, if any (read_safetensors' arrays do)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


def _release(mapped: mmap.mmap, part: np.ndarray) -> None:
    """Unmap the pages of `part` once written: they stay in the page cache, but no longer count
    in this process's memory, so converting a file of any size needs one chunk's worth. The
    mapping is read-only and file-backed: a later read maps the same bytes back in."""
    if not hasattr(mmap, "MADV_DONTNEED") or part.size == 0:
        return
    base = np.frombuffer(mapped, dtype=np.uint8, count=1).__array_interface__["data"][0]
    begin = part.__array_interface__["data"][0] - base
    end = begin + part.size
    page = mmap.PAGESIZE
    begin -= begin % page
    end = min(end + (-end % page), len(mapped))
    try:
        mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)
    except (OSError, ValueError):
        pass  # only memory accounting is at stake


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
