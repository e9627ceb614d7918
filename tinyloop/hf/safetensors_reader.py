"""A Hugging Face checkpoint folder read lazily: its config.json and one float32 tensor at a time.

`Checkpoint(folder)` reads `config.json` and the JSON headers of the folder's safetensors
files (one `*.safetensors` file or several, or the shards that `model.safetensors.index.json`
lists) and maps the files into memory. `shape(name)` answers from the headers;
`tensor(name)` copies one tensor out of its mapping as float32 (bf16, fp16 and fp32 are read;
any other dtype is refused) and hands the pages it read back to the kernel. Nothing else is
loaded, so converting a model needs memory for the tensor at hand, not for the checkpoint.

The safetensors layout (an 8-byte little-endian header length, a JSON header of {name: {dtype,
shape, data_offsets}}, then the data) is parsed here rather than through the `safetensors`
package, whose numpy API cannot return bfloat16. Every malformed input raises ConvertError
naming the file and the tensor.
"""
import json
import math
import mmap
import os
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

INDEX_FILE = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 << 20            # the safetensors package's own limit
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
              "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# The dtypes read as float: the stored little-endian dtype (BF16 as its raw 16 bits).
FLOAT_DTYPES: Dict[str, "np.dtype[Any]"] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
                                            "BF16": np.dtype("<u2")}


class ConvertError(ValueError):
    """A checkpoint cannot be converted: the message names the file, key or tensor."""


class Checkpoint:
    """config.json and the tensors of a Hugging Face model folder; use as a context manager
    (or call close()) to release the file mappings."""

    def __init__(self, folder: str) -> None:
        self.folder = os.fspath(folder)
        if not os.path.isdir(self.folder):
            raise ConvertError(f"{self.folder!r} is not a directory (give a Hugging Face model "
                               "folder with config.json and *.safetensors)")
        self.config: Dict[str, Any] = read_json(os.path.join(self.folder, "config.json"))
        self._maps: Dict[str, mmap.mmap] = {}
        self._entries: Dict[str, Tuple[str, str, Tuple[int, ...], int]] = {}
        try:
            for file, names in self._files().items():
                self._open(file, names)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def shape(self, name: str) -> Tuple[int, ...]:
        """The stored shape of tensor `name` (from the header; reads no data)."""
        return self._entry(name)[2]

    def check_float(self, name: str) -> None:
        """ConvertError unless tensor `name` has a dtype that tensor() reads."""
        file, kind = self._entry(name)[:2]
        if kind not in FLOAT_DTYPES:
            raise ConvertError(f"tensor {name!r} in {file} has dtype {kind}; only "
                               f"{', '.join(FLOAT_DTYPES)} are converted")

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as a new float32 array (a bf16 or fp16 value widened exactly)."""
        self.check_float(name)
        file, kind, shape, offset = self._entry(name)
        m = self._maps[file]
        raw = np.frombuffer(m, FLOAT_DTYPES[kind], math.prod(shape), offset)
        if kind == "BF16":                      # the high half of a float32
            bits = raw.astype(np.uint32)
            bits <<= 16                         # in place: one float32-sized array at a time
            wide: np.ndarray = bits.view(np.float32)
        else:
            wide = raw.astype(np.float32)
        del raw
        if hasattr(mmap, "MADV_DONTNEED"):
            # The copy is made: let the kernel drop the pages read, which would otherwise stay
            # resident until the whole checkpoint is.
            start = offset - offset % mmap.PAGESIZE
            end = offset + wide.size * FLOAT_DTYPES[kind].itemsize
            m.madvise(mmap.MADV_DONTNEED, start, end - start)
        return wide.reshape(shape)

    def _entry(self, name: str) -> Tuple[str, str, Tuple[int, ...], int]:
        if name not in self._entries:
            raise ConvertError(f"missing tensor {name!r} in {self.folder}")
        return self._entries[name]

    def _files(self) -> Dict[str, List[str]]:
        """{file name: the tensor names it must hold, [] = whatever it holds}."""
        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.exists(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index}: no 'weight_map' object of tensor name -> file")
            files: Dict[str, List[str]] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str) or os.path.basename(file) != file:
                    raise ConvertError(f"{index}: tensor {name!r} maps to {file!r}, not a file "
                                       "name in the folder")
                files.setdefault(file, []).append(name)
            return files
        found = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
        if not found:
            raise ConvertError(f"no *.safetensors file in {self.folder} (pytorch_model.bin and "
                               "other formats are not read: save the model with "
                               "safe_serialization=True)")
        return {f: [] for f in found}

    def _open(self, file: str, names: List[str]) -> None:
        path = os.path.join(self.folder, file)
        if not os.path.isfile(path):
            raise ConvertError(f"{path}: listed in {INDEX_FILE} but not found")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_LENGTH_BYTES:
                raise ConvertError(f"{path}: {size} bytes, too small for a safetensors file")
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps[file] = m
        (n,) = np.frombuffer(m, "<u8", 1, 0)
        if n > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
            raise ConvertError(f"{path}: header length {int(n)} exceeds the file "
                               f"({size} bytes) or {MAX_HEADER_BYTES} bytes")
        data_start = HEADER_LENGTH_BYTES + int(n)
        try:
            header = json.loads(m[HEADER_LENGTH_BYTES:data_start].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{path}: the header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        for name, info in header.items():
            self._add(path, file, name, info, data_start, size)
        for name in names:
            if name not in header:
                raise ConvertError(f"{path}: tensor {name!r} is listed in {INDEX_FILE} but "
                                   "not stored in this file")

    def _add(self, path: str, file: str, name: str, info: Any, data_start: int,
             size: int) -> None:
        if name in self._entries:
            raise ConvertError(f"{path}: tensor {name!r} is also stored in "
                               f"{self._entries[name][0]}")
        try:
            kind, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(n) for n in shape)
        except (TypeError, KeyError, ValueError):
            raise ConvertError(f"{path}: tensor {name!r} has a malformed header entry "
                               f"{info!r}") from None
        if kind not in ITEM_BYTES:
            raise ConvertError(f"{path}: tensor {name!r} has the unknown dtype {kind!r}")
        nbytes = math.prod(shape) * ITEM_BYTES[kind]
        if (min(shape, default=0) < 0 or not isinstance(begin, int) or end != begin + nbytes
                or begin < 0 or data_start + end > size):
            raise ConvertError(f"{path}: tensor {name!r} ({kind} {list(shape)}) has data "
                               f"offsets {[begin, end]} that do not fit its size or the file")
        self._entries[name] = (file, kind, shape, data_start + begin)


def read_json(path: str) -> Dict[str, Any]:
    """The JSON object in `path`; ConvertError if the file is missing or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return value
