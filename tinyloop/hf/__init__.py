"""Hugging Face checkpoints -> .tinyloop files: `convert(src, out, ...)` (docs/models.md).

`src` is a model folder: config.json, *.safetensors (one file, several, or shards listed by
model.safetensors.index.json; bf16, fp16 or fp32), and optionally generation_config.json,
tokenizer.json, tokenizer_config.json and chat_template.jinja. The ids that end generation are
every eos id the folder names (config.json's and generation_config.json's eos_token_id, then
the tokenizer's eos_token), the first being the header's eos_id. The architecture named in
config.json picks a mapper (architectures.py), which reads config.json and says how every float
weight is made from checkpoint tensors; those tensors' presence and shapes are checked before
any data is read, then tinyloop.quantize quantizes the weights one at a time as it looks them
up (the checkpoint stays memory-mapped), and the file is written with the tokenizer and the
architecture name as meta.* texts (docs/spec.md §6.3). With gptq, a float forward over the
calibration text (tinyloop.calibrate, tokenized by the model's tokenizer) first records each
linear's input Gram matrix, and the int4 linears are quantized by GPTQ.

Not here: the numerics (quantize.py), the file layout (modelfile.py), tokenizing at run time.
"""
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Callable, Dict, Iterator, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..bundled import CALIBRATION_TEXT
from ..calibrate import input_grams, token_windows
from ..config import MAX_STOP_IDS, NAME_MAX_BYTES, WEIGHT_FORMATS, ModelConfig
from ..modelfile import meta_tensor, save_model
from ..quantize import quantize_model
from ..tokenizer import open_tokenizer
from .architectures import MAPPERS, Options, Plan, Source, plan_for
from .safetensors_reader import Checkpoint, ConvertError, read_json

DEFAULT_INT4_GROUP = 32
DEFAULT_CALIBRATION = str(CALIBRATION_TEXT)
Progress = Callable[[int, int, str], None]     # (done, total, what) per float weight
Path = Union[str, "os.PathLike[str]"]

__all__ = ["MAPPERS", "ConvertError", "DEFAULT_ACT_BLOCK", "DEFAULT_CALIBRATION",
           "DEFAULT_INT4_GROUP", "convert"]

# Block activations by default where the full-depth error budget shows they pay
# (docs/performance.md "Fidelity at full depth"): Ouro-1.4B's 24 layers x 4 passes keep 0.918
# of the float logits' cosine with them against 0.840 with one scale per row.
DEFAULT_ACT_BLOCK = {"OuroForCausalLM": 32}


def convert(src: Path, out: Path, weight_format: str = "int8", *, loops: Optional[int] = None,
            core: Optional[Sequence[int]] = None, max_seq_len: Optional[int] = None,
            group_size: Optional[int] = None, progress: Optional[Progress] = None,
            gptq: bool = False, calibration: Optional[Path] = None,
            act_block: Optional[int] = None) -> ModelConfig:
    """Convert the Hugging Face model folder `src` into the .tinyloop file `out`.

    weight_format: "int8" or "int4" (group_size: int4 weights per multiplier, default 32).
    gptq (int4 only): quantize the linears by GPTQ, calibrated on the UTF-8 text file
    `calibration` (default: DEFAULT_CALIBRATION, a few KB of English prose shipped with the
    package), tokenized by the model's tokenizer (its UTF-8 bytes as ids for a model without
    one, when vocab_size >= 256).
    loops: the default depth L (default: the checkpoint's, 1 for a plain LLaMA-family model).
    core: (start, end) for a LLaMA-family model: layers [0, start) become the prelude,
    [start, end) the looped core, [end, n) the coda (default: all layers are the core).
    max_seq_len: positions (default: the checkpoint's max_position_embeddings / block_size).
    act_block: 0 (one activation scale per row) or B, the block activations of docs/spec.md
    §2.2.1 (B must divide the hidden size, heads * head_dim and the intermediate size); None:
    the architecture's default, DEFAULT_ACT_BLOCK where that divides every width, else 0.
    progress(done, total, what) is called as each float weight is read.
    Returns the ModelConfig written. Raises ConvertError (a ValueError) naming the key,
    tensor or option that cannot be converted, or ModelFormatError for a config that breaks
    the file rules (§6.1); `out` is then not written.
    """
    options = Options(weight_format=weight_format,
                      group_size=_group_size(weight_format, group_size), loops=loops,
                      core=None if core is None else _core(core), max_seq_len=max_seq_len)
    text = _calibration_text(weight_format, gptq, calibration)
    src = os.fspath(src)
    with Checkpoint(src) as checkpoint:
        architecture, plan = plan_for(checkpoint.config, options, frozenset(checkpoint))
        _check_tensors(checkpoint, plan, architecture)
        meta = _meta_texts(src, architecture)
        config: ModelConfig = dataclasses.replace(
            plan.config, name=_name(src),
            tokenizer="hf" if "meta.tokenizer_json" in meta else "none")
        config = dataclasses.replace(config, act_block=_act_block(architecture, config, act_block))
        config = _with_special_ids(config, checkpoint.config, _generation_config(src), meta)
        config.validate()
        weights = LazyWeights(checkpoint, plan.recipe, progress)
        hessians = None
        if text is not None:
            windows = token_windows(_calibration_tokens(text, config, meta), config.max_seq_len)
            hessians = input_grams(config, weights, windows, plan.inv_freq)
        config, tensors = quantize_model(config, weights, inv_freq=plan.inv_freq,
                                         hessians=hessians)
    tensors.update({name: meta_tensor(text) for name, text in meta.items()})
    save_model(out, config, tensors)
    return config


class LazyWeights(Mapping[str, np.ndarray]):
    """The float weights dict of tinyloop.quantize, each value made from the checkpoint when
    it is looked up (the last checkpoint tensor read is kept: Huginn's fused Wqkv and fc
    feed three and two weights in a row)."""

    def __init__(self, checkpoint: Checkpoint, recipe: Dict[str, Source],
                 progress: Optional[Progress]) -> None:
        self._checkpoint, self._recipe, self._progress = checkpoint, recipe, progress
        self._seen: Set[str] = set()
        self._last: Tuple[str, Optional[np.ndarray]] = ("", None)

    def __getitem__(self, name: str) -> np.ndarray:
        source = self._recipe[name]
        value = source.make(*(self._read(n) for n in source.names))
        if name not in self._seen:
            self._seen.add(name)
            if self._progress is not None:
                origin = " + ".join(source.names) or "zeros"
                self._progress(len(self._seen), len(self._recipe), f"{name} <- {origin}")
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._recipe)

    def __len__(self) -> int:
        return len(self._recipe)

    def _read(self, name: str) -> np.ndarray:
        if self._last[0] != name:
            self._last = ("", None)                  # free the previous one first
            self._last = (name, self._checkpoint.tensor(name))
        value = self._last[1]
        assert value is not None
        return value


def _check_tensors(checkpoint: Checkpoint, plan: Plan, architecture: str) -> None:
    """Every tensor the recipe names is present, float and of its shape; every other tensor of
    the checkpoint is one the architecture is known to leave unused."""
    used = set()
    for weight, source in plan.recipe.items():
        for name, shape in zip(source.names, source.shapes):
            if name not in checkpoint:
                raise ConvertError(f"missing tensor {name!r} (for {weight}) in {checkpoint.folder}")
            found = checkpoint.shape(name)
            if found != shape:
                raise ConvertError(f"tensor {name!r}: expected shape {list(shape)} from "
                                   f"config.json, found {list(found)}")
            checkpoint.check_float(name)
            used.add(name)
    ignored = re.compile(plan.ignored)
    for name in checkpoint:
        if name not in used and not ignored.fullmatch(name):
            raise ConvertError(f"unexpected tensor {name!r}: the {architecture} mapping does "
                               "not use it (a variant of the architecture TinyLoop does not "
                               "convert)")


def _meta_texts(src: str, architecture: str) -> Dict[str, str]:
    """The meta.* texts (§6.3): the architecture, tokenizer.json and tokenizer_config.json
    (with chat_template.jinja, when present, as its "chat_template")."""
    meta = {"meta.architecture": architecture}
    tokenizer = _text(os.path.join(src, "tokenizer.json"))
    if tokenizer is not None:
        meta["meta.tokenizer_json"] = tokenizer
    config_path = os.path.join(src, "tokenizer_config.json")
    tokenizer_config = _text(config_path)
    template = _text(os.path.join(src, "chat_template.jinja"))
    if template is not None:
        merged = read_json(config_path) if tokenizer_config is not None else {}
        merged["chat_template"] = template
        tokenizer_config = json.dumps(merged, ensure_ascii=False, indent=2)
    if tokenizer_config is not None:
        meta["meta.tokenizer_config"] = tokenizer_config
    return meta


def _calibration_text(weight_format: str, gptq: bool, calibration: Optional[Path]
                      ) -> Optional[str]:
    """The calibration text of a GPTQ conversion (None without gptq), checked before any
    weight is read."""
    if not gptq:
        if calibration is not None:
            raise ConvertError("a calibration file applies to gptq only (--gptq)")
        return None
    if weight_format != "int4":
        raise ConvertError(f"gptq applies to int4 weights only (--format int4), not "
                           f"{weight_format!r}")
    path = DEFAULT_CALIBRATION if calibration is None else os.fspath(calibration)
    try:
        text = _text(path)
    except OSError as exc:                          # a folder, no permission, ...
        raise ConvertError(f"calibration file {path}: {exc.strerror}") from None
    if text is None:
        raise ConvertError(f"calibration file {path} does not exist")
    if not text.strip():
        raise ConvertError(f"calibration file {path} is empty")
    return text


def _calibration_tokens(text: str, config: ModelConfig, meta: Dict[str, str]) -> np.ndarray:
    """The calibration text's token ids: by the model's tokenizer, or its UTF-8 bytes for a
    model without one."""
    if config.tokenizer == "none":
        if config.vocab_size < 256:
            raise ConvertError(f"gptq: the model has no tokenizer and {config.vocab_size} "
                               "token ids, too few for the calibration text's bytes")
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    else:
        ids = np.asarray(open_tokenizer(config, meta).encode(text), np.int64)
    if len(ids) == 0:
        raise ConvertError("gptq: the calibration text gives no tokens")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ConvertError(f"gptq: the tokenizer gives token ids {int(ids.min())} .. "
                           f"{int(ids.max())} for the calibration text, outside the "
                           f"vocabulary (0 .. {config.vocab_size - 1})")
    return ids


def _text(path: str) -> Optional[str]:
    """The UTF-8 text of `path`, None if there is no such file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise ConvertError(f"{path}: not UTF-8 text ({exc})") from None


def _generation_config(src: str) -> Dict[str, object]:
    """The folder's generation_config.json ({} when it has none)."""
    path = os.path.join(src, "generation_config.json")
    return read_json(path) if os.path.exists(path) else {}


def _with_special_ids(config: ModelConfig, model_config: Dict[str, object],
                      generation_config: Dict[str, object], meta: Dict[str, str]) -> ModelConfig:
    """config with bos_id, eos_id and stop_ids from the folder: bos_token_id of config.json
    (else generation_config.json); the eos ids of config.json, then generation_config.json,
    then the tokenizer's eos_token, each once: the first is eos_id, the rest stop_ids (transformers
    and vLLM stop on each of them)."""
    sources = (("config.json", model_config), ("generation_config.json", generation_config))
    bos = [i for name, c in sources for i in _token_ids(c, "bos_token_id", name, config)]
    eos = [i for name, c in sources for i in _token_ids(c, "eos_token_id", name, config)]
    config = dataclasses.replace(config, bos_id=bos[0] if bos else -1,
                                 eos_id=eos[0] if eos else -1)
    if config.tokenizer == "hf":
        tokenizer_eos = open_tokenizer(config, meta).eos_id
        eos += [] if tokenizer_eos is None else [tokenizer_eos]
    eos = list(dict.fromkeys(eos))
    if len(eos) > 1 + MAX_STOP_IDS:
        raise ConvertError(f"the folder names {len(eos)} eos ids {eos}; a file holds at most "
                           f"{1 + MAX_STOP_IDS} (eos_id and {MAX_STOP_IDS} stop_ids)")
    return dataclasses.replace(config, eos_id=eos[0] if eos else -1, stop_ids=tuple(eos[1:]))


def _token_ids(settings: Dict[str, object], key: str, where: str, config: ModelConfig
               ) -> list[int]:
    """The token ids of a special-token key (a single id, a list of them or null), each
    checked to be a token id of the model."""
    value = settings.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    ids = [i for i in values if isinstance(i, int) and not isinstance(i, bool)]
    if len(ids) < len(values) or not all(0 <= i < config.vocab_size for i in ids):
        raise ConvertError(f"{where}: {key} must be token ids in 0 .. "
                           f"{config.vocab_size - 1} (the model's vocab_size), got {value!r}")
    return ids


def _name(src: str) -> str:
    """The folder's name, cut to the header's 63 UTF-8 bytes (at a character boundary)."""
    name = os.path.basename(os.path.normpath(os.path.abspath(src)))
    return name.encode("utf-8")[:NAME_MAX_BYTES].decode("utf-8", errors="ignore")


def _act_block(architecture: str, config: ModelConfig, act_block: Optional[int]) -> int:
    """The act_block asked for, or for None the architecture's default where it divides every
    linear's input width (docs/models.md "Block activations")."""
    if act_block is not None:
        return act_block
    block = DEFAULT_ACT_BLOCK.get(architecture, 0)
    widths = (config.d_model, config.n_heads * config.head_dim, config.ffn_dim)
    return block if block and all(k % block == 0 for k in widths) else 0


def _group_size(weight_format: str, group_size: Optional[int]) -> int:
    if weight_format not in WEIGHT_FORMATS:
        raise ConvertError(f"weight_format must be 'int8' or 'int4', got {weight_format!r}")
    if weight_format == "int8":
        if group_size not in (None, 0):
            raise ConvertError(f"group_size {group_size} applies to int4 only")
        return 0
    return DEFAULT_INT4_GROUP if group_size is None else group_size


def _core(core: Sequence[int]) -> Tuple[int, int]:
    if (len(core) != 2 or any(isinstance(i, bool) or not isinstance(i, int) for i in core)):
        raise ConvertError(f"core must be (start, end), two layer numbers, got {core!r}")
    return core[0], core[1]
