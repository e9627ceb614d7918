"""One mapper per Hugging Face architecture: config.json -> a tinyloop ModelConfig and a recipe.

A mapper reads config.json (the `config` dict), the names of the checkpoint's tensors (never their
data: only RavenForCausalLM needs them, whose published layouts share one architecture name and
its keys) and the conversion options. It returns a
`Plan`: the ModelConfig of the converted model (docs/spec.md §1, §6.1) and the *recipe*, which
says how each float weight of tinyloop.quantize's dict is made from checkpoint tensors (their
names and expected shapes, and a function of their float32 arrays). The caller checks every
named tensor's presence and shape before reading any data, so a wrong checkpoint fails in
seconds, naming the tensor.

Every option a mapper does not implement exactly is refused with a ConvertError naming the
config key (sliding-window attention, RoPE scaling kinds other than default/linear/llama3,
activations other than SiLU, biases TinyLoop has no place for, ...). docs/models.md lists what
loads and what does not.
"""
import dataclasses
import math
import re
from typing import AbstractSet, Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..config import ModelConfig
from .safetensors_reader import ConvertError

Shape = Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Options:
    """What the caller chose (None: the checkpoint's own value)."""

    weight_format: str = "int8"
    group_size: int = 0
    loops: Optional[int] = None                # the default depth L
    core: Optional[Tuple[int, int]] = None     # [start, end) of the looped layers (LLaMA family)
    max_seq_len: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Source:
    """One float weight made from checkpoint tensors: `make(*arrays)` of `names`, each of
    which must have the shape in `shapes`."""

    names: Tuple[str, ...]
    shapes: Tuple[Shape, ...]
    make: Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class Plan:
    config: ModelConfig
    recipe: Dict[str, Source]
    ignored: str                               # regex of checkpoint tensors left unused
    inv_freq: Optional[np.ndarray]             # RoPE frequencies, None = config.rope_theta's


def take(name: str, shape: Shape) -> Source:
    """The checkpoint tensor `name` as it is."""
    return Source((name,), (shape,), lambda a: a)


def rows(name: str, shape: Shape, start: int, stop: int,
         then: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> Source:
    """Rows start .. stop-1 of the checkpoint tensor `name` (then `then` of them)."""
    return Source((name,), (shape,), lambda a: then(a[start:stop]))


def zeros(n: int) -> Source:
    return Source((), (), lambda: np.zeros(n, np.float32))


# ---- config.json values -----------------------------------------------------------------

def _int(config: Dict[str, Any], key: str, default: Optional[int] = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        what = "missing" if key not in config else f"{value!r}"
        raise ConvertError(f"config.json: {key} must be an integer, got {what}")
    return value


def _optional_int(config: Dict[str, Any], key: str, default: int) -> int:
    """An integer key that may be absent or null (then `default`)."""
    return default if config.get(key) is None else _int(config, key)


def _float(config: Dict[str, Any], key: str, default: Optional[float] = None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "missing" if key not in config else f"{value!r}"
        raise ConvertError(f"config.json: {key} must be a number, got {what}")
    return float(value)


def _raven_embed_scale(config: Dict[str, Any], d: int) -> float:
    """RavenForCausalLM's embedding multiplier: init_values.embed_scale when the config has it
    (its code reads it from there: 1.0 in a retrofitted Llama), else sqrt(n_embd), the value
    Huginn-0125 derives."""
    init_values = config.get("init_values")
    if isinstance(init_values, dict) and "embed_scale" in init_values:
        return _float(init_values, "embed_scale")
    return math.sqrt(d)


def _refuse(key: str, value: Any, why: str) -> ConvertError:
    return ConvertError(f"config.json: {key} = {value!r} is not supported: {why}")


def _require_value(config: Dict[str, Any], key: str, allowed: Sequence[Any], why: str) -> None:
    """The key, when present, must hold one of `allowed` (absent means the allowed default)."""
    if key in config and config[key] not in allowed:
        raise _refuse(key, config[key], why)


def _loops(options: Options, default: int) -> int:
    return options.loops if options.loops is not None else default


def _max_seq_len(options: Options, positions: int) -> int:
    return options.max_seq_len if options.max_seq_len is not None else positions


def _model_config(options: Options, **fields: Any) -> ModelConfig:
    """The ModelConfig of the mapped fields and the options' weight format, validated."""
    mc = ModelConfig(weight_format=options.weight_format, group_size=options.group_size,
                     **fields)
    mc.validate()
    return mc


# ---- RoPE ---------------------------------------------------------------------------------

def _rope(config: Dict[str, Any], head_dim: int) -> Tuple[float, Optional[np.ndarray]]:
    """(theta, scaled frequencies or None) of a LLaMA-family config: rope_theta with
    rope_scaling (or transformers 5's rope_parameters) of kind default, linear or llama3."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise _refuse(key, params, "expected an object with a rope_type")
    theta = _float(config if "rope_theta" in config else params, "rope_theta", 1e4)
    kind = params.get("rope_type", params.get("type", "default"))
    _require_value(config, "partial_rotary_factor", (1, 1.0), "RoPE on part of each head")
    if kind == "default":
        return theta, None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = _float(params, "factor")
    if kind == "linear":
        return theta, inv_freq / factor
    if kind == "llama3":
        low, high = _float(params, "low_freq_factor"), _float(params, "high_freq_factor")
        original = _float(params, "original_max_position_embeddings")
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return theta, np.where(medium, mixed, scaled)
    raise ConvertError(f"config.json: {key} of rope_type {kind!r} is not supported (TinyLoop "
                       "implements none/default, linear and llama3)")


def _interleaved_to_rotate_half(a: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows of a q or k projection (or bias) reordered within each head from interleaved-pair
    RoPE (pairs 2i, 2i+1) to rotate-half (pairs i, i + D/2): 0, 2, .., D-2, 1, 3, .., D-1."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return a.reshape(heads, head_dim, *a.shape[1:])[:, order].reshape(a.shape)


# ---- the LLaMA-style decoder layer (LLaMA, Mistral, Qwen2, Nanbeige, Ouro) ----------------

@dataclasses.dataclass(frozen=True)
class _Dims:
    d: int
    H: int
    G: int
    D: int
    F: int
    V: int
    n_layers: int


def _llama_dims(config: Dict[str, Any]) -> _Dims:
    d, H = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if config.get("head_dim") is None and d % H:
        raise ConvertError(f"config.json: hidden_size {d} is not a multiple of "
                           f"num_attention_heads {H} (and no head_dim is given)")
    G = _optional_int(config, "num_key_value_heads", H)
    D = _optional_int(config, "head_dim", d // H)
    return _Dims(d, H, G, D, _int(config, "intermediate_size"), _int(config, "vocab_size"),
                 _int(config, "num_hidden_layers"))


def _check_llama_options(config: Dict[str, Any], max_seq_len: int, qkv_bias: bool) -> None:
    """Refuse every LLaMA-family option TinyLoop does not compute exactly."""
    _require_value(config, "hidden_act", ("silu",), "TinyLoop's MLP is SwiGLU (silu)")
    _require_value(config, "mlp_bias", (False, None), "the MLP linears have no bias")
    if not qkv_bias:
        _require_value(config, "attention_bias", (False, None),
                       "o_proj has no bias in TinyLoop (q/k/v biases: Qwen2)")
    for i, kind in enumerate(config.get("layer_types") or ()):
        if kind != "full_attention":
            raise _refuse(f"layer_types[{i}]", kind, "only full attention is implemented "
                          "(no sliding-window layers)")
    if config.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, "sliding-window attention is not implemented")
    window = config.get("sliding_window")
    if "use_sliding_window" not in config and window is not None and window < max_seq_len:
        raise _refuse("sliding_window", window, f"sliding-window attention is not implemented; "
                      f"convert with max_seq_len <= {window} (--max-seq-len {window}), where "
                      "the window covers the whole sequence")


def _llama_block(recipe: Dict[str, Source], b: str, layer: int, dims: _Dims, *, qkv_bias: bool,
                 sandwich: bool) -> None:
    p, d, H, G, D, F = f"model.layers.{layer}.", dims.d, dims.H, dims.G, dims.D, dims.F
    recipe[f"{b}.attn_norm"] = take(p + "input_layernorm.weight", (d,))
    for part, heads in (("q", H), ("k", G), ("v", G)):
        recipe[f"{b}.w{part}"] = take(f"{p}self_attn.{part}_proj.weight", (heads * D, d))
        if qkv_bias:
            recipe[f"{b}.b{part}"] = take(f"{p}self_attn.{part}_proj.bias", (heads * D,))
    recipe[f"{b}.wo"] = take(p + "self_attn.o_proj.weight", (d, H * D))
    if sandwich:       # Ouro: the *_2 norms act on the attention's and the MLP's outputs
        recipe[f"{b}.attn_post_norm"] = take(p + "input_layernorm_2.weight", (d,))
        recipe[f"{b}.ffn_post_norm"] = take(p + "post_attention_layernorm_2.weight", (d,))
    recipe[f"{b}.mlp_norm"] = take(p + "post_attention_layernorm.weight", (d,))
    recipe[f"{b}.w_gate"] = take(p + "mlp.gate_proj.weight", (F, d))
    recipe[f"{b}.w_up"] = take(p + "mlp.up_proj.weight", (F, d))
    recipe[f"{b}.w_down"] = take(p + "mlp.down_proj.weight", (d, F))


def _llama_plan(config: Dict[str, Any], options: Options, *, qkv_bias: bool = False,
                sandwich: bool = False, loops: int = 1, step_norm: bool = False,
                loopable: bool = True) -> Plan:
    """The plan of a LLaMA-style stack; `loopable`: --core may pick the looped span."""
    dims = _llama_dims(config)
    n = dims.n_layers
    if options.core is None:
        start, end = 0, n
    elif not loopable:
        raise ConvertError("--core applies to plain LLaMA-family models only: this "
                           "architecture loops all its layers")
    else:
        start, end = options.core
        if not 0 <= start < end <= n:
            raise ConvertError(f"--core {start}:{end}: need 0 <= START < END <= "
                               f"num_hidden_layers ({n})")
    max_seq_len = _max_seq_len(options, _int(config, "max_position_embeddings"))
    _check_llama_options(config, max_seq_len, qkv_bias)
    tied = bool(config.get("tie_word_embeddings", False))
    theta, inv_freq = _rope(config, dims.D)
    mc = _model_config(
        options, max_seq_len=max_seq_len, vocab_size=dims.V, d_model=dims.d, n_heads=dims.H,
        n_kv_heads=dims.G, head_dim=dims.D, ffn_dim=dims.F, n_pre_blocks=start,
        default_loops=_loops(options, loops), tied_head=tied, rope_theta=theta,
        rms_eps=_float(config, "rms_norm_eps", 1e-6), n_core_blocks=end - start,
        n_coda_blocks=n - end, block_layout="sandwich" if sandwich else "pre",
        qkv_bias=qkv_bias, step_norm=step_norm)
    recipe = {"tok_emb": take("model.embed_tokens.weight", (dims.V, dims.d)),
              "final_norm": take("model.norm.weight", (dims.d,))}
    if step_norm:
        recipe["core.step_norm"] = take("model.norm.weight", (dims.d,))
    for layer, b in enumerate(mc.block_prefixes()):
        _llama_block(recipe, b, layer, dims, qkv_bias=qkv_bias, sandwich=sandwich)
    if not tied:
        recipe["head"] = take("lm_head.weight", (dims.V, dims.d))
    ignored = "|".join(filter(None, [r"model\.rotary_emb\.inv_freq",
                                     r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
                                     r"lm_head\.weight" if tied else ""]))
    return Plan(mc, recipe, ignored, inv_freq)


def _llama(config: Dict[str, Any], options: Options) -> Plan:
    return _llama_plan(config, options)


def _qwen2(config: Dict[str, Any], options: Options) -> Plan:
    return _llama_plan(config, options, qkv_bias=True)


# Nanbeige options that change the computation (q/k norms, n-gram embeddings, hyper-connections,
# depth attention, KV shared between loops, looping only the middle layers, ...): refused when
# on, since several add no tensor that the unused-tensor check would catch.
NANBEIGE_VARIANTS = ("qk_layernorm", "emb_neighbor_num", "insert_ngram_layer_idx",
                     "ngram_insert_all_layers", "enable_double_loop_split", "loop_middle_layers",
                     "loop_share_kv", "enable_hyper_connection", "enable_mhc",
                     "enable_h_res_identity", "enable_depth_attention")


def _nanbeige_loops(config: Dict[str, Any]) -> int:
    """The depth Nanbeige's own forward runs (its `_get_num_loops`, at inference too):
    len(loop_loss_weights) + 1 when that list is non-empty, else num_loops."""
    weights = config.get("loop_loss_weights")
    if weights is not None and (not isinstance(weights, list) or any(
            isinstance(w, bool) or not isinstance(w, (int, float)) for w in weights)):
        raise ConvertError(f"config.json: loop_loss_weights must be a list of numbers or null, "
                           f"got {weights!r}")
    return len(weights) + 1 if weights else _int(config, "num_loops", 1)


def _nanbeige(config: Dict[str, Any], options: Options) -> Plan:
    for key in NANBEIGE_VARIANTS:
        if config.get(key):
            raise _refuse(key, config[key], "TinyLoop converts Nanbeige's plain looped layout "
                          "(the same layers run once per loop, a KV slot per pass) only")
    skip = config.get("skip_loop_final_norm", False)
    return _llama_plan(config, options, loops=_nanbeige_loops(config), step_norm=not skip,
                       loopable=False)


def _ouro(config: Dict[str, Any], options: Options) -> Plan:
    """Ouro: a sandwich core run total_ut_steps times, model.norm between and after the passes.
    Its early-exit gate, a linear (1, d) with a bias that scores model.norm(h) after each pass,
    is the file's exit gate (docs/spec.md §5.7), quantized like the head, which reads the same
    norm; early_exit_threshold (1.0 when absent or null: every token runs all passes) its
    threshold."""
    threshold = 1.0 if config.get("early_exit_threshold") is None else _float(
        config, "early_exit_threshold")
    if not 0 < threshold <= 1:
        raise _refuse("early_exit_threshold", threshold, "the exit gate's threshold is a "
                      "probability in (0, 1] (docs/spec.md §5.7)")
    plan = _llama_plan(config, options, sandwich=True, loops=_int(config, "total_ut_steps", 4),
                       step_norm=True, loopable=False)
    d = plan.config.d_model
    recipe = {**plan.recipe, "exit_gate": take("model.early_exit_gate.weight", (1, d)),
              "exit_gate_bias": take("model.early_exit_gate.bias", (1,))}
    mc = dataclasses.replace(plan.config, exit_gate=True, exit_threshold=threshold)
    mc.validate()
    return dataclasses.replace(plan, config=mc, recipe=recipe)


def _iquest_loop(config: Dict[str, Any], options: Options) -> Plan:
    """IQuest-Coder Loop (vLLM's iquest_loopcoder.py): LLaMA's pre-norm layers all looped
    loop_num times with no norm between loops, loop attention (docs/spec.md §4) with window
    loop_window_size and model.gate_projections.{i} (weight [H, D], bias [H]) as layer i's gate.
    As the published model does, head_dim is hidden_size / num_attention_heads whatever the
    config says, and attention_bias is ignored (its q, k, v and o projections have none)."""
    loops, window = _int(config, "loop_num", 2), _int(config, "loop_window_size", 64)
    if loops < 1 or not 1 <= window <= 2**20:
        raise ConvertError(f"config.json: loop_num ({loops}) must be >= 1 and loop_window_size "
                           f"({window}) in 1 .. 2^20")
    d, H = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if d % H:
        raise ConvertError(f"config.json: hidden_size {d} is not a multiple of "
                           f"num_attention_heads {H}")
    llama = {k: v for k, v in config.items() if k not in ("head_dim", "attention_bias")}
    plan = _llama_plan({**llama, "head_dim": d // H}, options, loops=loops, loopable=False)
    mc = dataclasses.replace(plan.config, loop_window=window)
    mc.validate()
    recipe = dict(plan.recipe)
    for j, b in enumerate(mc.block_prefixes()):
        p = f"model.gate_projections.{j}."
        recipe[f"{b}.loop_gate"] = take(p + "weight", (H, d // H))
        recipe[f"{b}.loop_gate_bias"] = take(p + "bias", (H,))
    return dataclasses.replace(plan, config=mc, recipe=recipe)


# ---- RavenForCausalLM: Huginn-0125 and retrofitted-recurrence Llamas -----------------------
#
# McLeish et al. 2025 ("Teaching pretrained language models to think deeper with retrofitted
# recurrence") save a Llama's layers as a prelude, a core and a coda in Huginn's format: Huginn's
# config with the Llama's sizes written over it, the same fused tensors, and a modeling file
# (raven_modeling_minimal_llama.py) whose blocks are LLaMA's pre-norm blocks (norm_1, norm_2) with
# transformers' rotate-half RoPE from rope_theta / rope_scaling, no norm before the coda. Huginn's
# own blocks carry norm_1 .. norm_4 and read rope_base; the OLMo-2 flavour adds attn.q_norm and
# attn.k_norm.

_RAVEN_LAYER = r"transformer\.(?:prelude|core_block|coda)\.\d+\."
_RAVEN_QK_NORM = re.compile(_RAVEN_LAYER + r"attn\.[qk]_norm\.weight")
_RAVEN_SANDWICH_NORM = re.compile(_RAVEN_LAYER + r"norm_[34]\.weight")


def _raven(config: Dict[str, Any], options: Options, names: AbstractSet[str]) -> Plan:
    """Huginn-0125, or a retrofitted-recurrence Llama: config.json's rope_theta (which only the
    retrofitted code reads) says which, and the layers' tensors must agree."""
    if options.core is not None:
        raise ConvertError("--core applies to plain LLaMA-family models only: RavenForCausalLM "
                           "has its own prelude, core and coda")
    qk_norm = sorted(n for n in names if _RAVEN_QK_NORM.fullmatch(n))
    if qk_norm:
        raise ConvertError(
            f"tensor {qk_norm[0]!r}: a RavenForCausalLM with q/k norms (the OLMo-2 flavour of "
            "retrofitted recurrence: RMSNorm over the whole q and k projections, norm_1 and "
            "norm_2 on the attention and MLP outputs, no norm on their inputs) is not supported: "
            "TinyLoop's blocks (docs/spec.md §1, §4) have no q/k norm and no placement without "
            "an input norm")
    sandwich = sorted(n for n in names if _RAVEN_SANDWICH_NORM.fullmatch(n))
    retrofitted = "rope_theta" in config
    if retrofitted and sandwich:
        raise ConvertError(
            f"config.json has rope_theta (a retrofitted-recurrence Llama, whose blocks have "
            f"norm_1 and norm_2 only) but the checkpoint holds {sandwich[0]!r} (Huginn's "
            "sandwich norms): which layout it is cannot be told; if those norms are leftovers "
            "that its modeling file does not load, remove them from the checkpoint")
    if not retrofitted and not sandwich:
        raise ConvertError(
            "config.json: rope_theta is missing, but the layers have no norm_3 / norm_4 (a "
            "retrofitted-recurrence Llama, whose RoPE is rope_theta with rope_scaling; "
            f"rope_base = {config.get('rope_base')!r} is a stale copy of Huginn's): the RoPE base "
            "is unknown")
    return _retrofitted_llama(config, options) if retrofitted else _huginn(config, options)


@dataclasses.dataclass(frozen=True)
class _RavenLayout:
    """What the two RavenForCausalLM layouts do differently."""

    block_layout: str                          # "post" (Huginn) or "pre" (retrofitted)
    norms: Dict[str, str]                      # TinyLoop gain -> the block's checkpoint norm
    interleaved_rope: bool                     # Huginn's pairs (2i, 2i+1): permute q/k rows
    coda_norm: bool                            # ln_f before the coda (Huginn)
    positions: int
    rope_theta: float
    inv_freq: Optional[np.ndarray]
    ignored: str                               # checkpoint tensors left unused, but lm_head


def _raven_dims(config: Dict[str, Any]) -> Tuple[_Dims, bool]:
    """(sizes, qk_bias) of a RavenForCausalLM config, refusing what TinyLoop cannot compute."""
    d, H = _int(config, "n_embd"), _int(config, "n_heads")
    if d % H:
        raise ConvertError(f"config.json: n_embd {d} is not a multiple of n_heads {H}")
    G = _optional_int(config, "num_key_value_heads", H)
    vocab = _int(config, "vocab_size")
    multiple = _int(config, "padding_multiple", 4096)
    V = _int(config, "padded_vocab_size", -(-vocab // multiple) * multiple)
    _require_value(config, "bias", (False,), "Huginn's linears have no bias in TinyLoop")
    _require_value(config, "injection_type", ("linear",), "only the linear adapter on [x, e]")
    _require_value(config, "nonlin_name", ("SiLU",), "TinyLoop's MLP is SwiGLU (silu)")
    _require_value(config, "mlp_class_name", ("GatedMLP",), "TinyLoop's MLP is gated")
    _require_value(config, "block_class_name", ("SandwichBlock",), "only the SandwichBlock")
    _require_value(config, "test_time_noise", (0, 0.0), "no noise is drawn between iterations")
    qk_bias = bool(config.get("qk_bias", True))
    if qk_bias and G != H:
        raise _refuse("num_key_value_heads", G, f"qk_bias needs as many kv heads as heads ({H})")
    n_layers = sum(_int(config, f"n_layers_in_{part}")
                   for part in ("prelude", "recurrent_block", "coda"))
    return _Dims(d, H, G, d // H, _int(config, "intermediate_size"), V, n_layers), qk_bias


def _huginn(config: Dict[str, Any], options: Options) -> Plan:
    return _raven_plan(config, options, *_raven_dims(config), _RavenLayout(
        block_layout="post", interleaved_rope=True, coda_norm=True,
        norms=dict(attn_norm="norm_1", attn_post_norm="norm_2", mlp_norm="norm_3",
                   ffn_post_norm="norm_4"),
        positions=_int(config, "block_size", 4096),
        rope_theta=_float(config, "rope_base", 50000.0), inv_freq=None, ignored=r"freqs_cis"))


def _retrofitted_llama(config: Dict[str, Any], options: Options) -> Plan:
    """Its attention splits heads by n_embd // n_heads, its RoPE (transformers' LLaMA one) sizes
    them by head_dim: the two must agree. block_size and rope_base are stale Huginn values."""
    dims, qk_bias = _raven_dims(config)
    if config.get("head_dim") is not None and _int(config, "head_dim") != dims.D:
        raise _refuse("head_dim", config["head_dim"], f"the retrofitted-recurrence code splits "
                      f"heads by n_embd // n_heads = {dims.D} but sizes RoPE by head_dim")
    theta, inv_freq = _rope(config, dims.D)
    return _raven_plan(config, options, dims, qk_bias, _RavenLayout(
        block_layout="pre", interleaved_rope=False, coda_norm=False,
        norms=dict(attn_norm="norm_1", mlp_norm="norm_2"),
        positions=_int(config, "max_position_embeddings"), rope_theta=theta, inv_freq=inv_freq,
        ignored=""))


def _raven_plan(config: Dict[str, Any], options: Options, dims: _Dims, qk_bias: bool,
                layout: _RavenLayout) -> Plan:
    d, V = dims.d, dims.V
    tied = bool(config.get("tie_embeddings", True))
    n_pre, k = _int(config, "n_layers_in_prelude"), _int(config, "n_layers_in_recurrent_block")
    n_coda = _int(config, "n_layers_in_coda")
    mc = _model_config(
        options, max_seq_len=_max_seq_len(options, layout.positions), vocab_size=V, d_model=d,
        n_heads=dims.H, n_kv_heads=dims.G, head_dim=dims.D, ffn_dim=dims.F, n_pre_blocks=n_pre,
        default_loops=_loops(options, _int(config, "mean_recurrence")), tied_head=tied,
        rope_theta=layout.rope_theta, rms_eps=_float(config, "norm_eps", 1e-6),
        n_core_blocks=k, n_coda_blocks=n_coda, block_layout=layout.block_layout,
        qkv_bias=qk_bias, injection=True, embed_scale=_raven_embed_scale(config, d),
        coda_norm=layout.coda_norm)
    recipe = {"tok_emb": take("transformer.wte.weight", (V, d)),
              "final_norm": take("transformer.ln_f.weight", (d,)),
              "core.adapter": take("transformer.adapter.weight", (d, 2 * d))}
    if layout.coda_norm:
        recipe["coda.input_norm"] = take("transformer.ln_f.weight", (d,))
    parts = ([("prelude", i) for i in range(n_pre)] + [("core_block", j) for j in range(k)]
             + [("coda", c) for c in range(n_coda)])
    for b, (part, i) in zip(mc.block_prefixes(), parts):
        _raven_block(recipe, b, f"transformer.{part}.{i}.", dims, qk_bias, layout)
    if not tied:
        recipe["head"] = take("lm_head.weight", (V, d))
    ignored = "|".join(filter(None, [layout.ignored, r"lm_head\.weight" if tied else ""]))
    return Plan(mc, recipe, ignored, layout.inv_freq)


def _raven_block(recipe: Dict[str, Source], b: str, p: str, dims: _Dims, qk_bias: bool,
                 layout: _RavenLayout) -> None:
    """Huginn's SandwichBlock: x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x),
    or the retrofitted one: x += attn(norm_1(x)); x += mlp(norm_2(x)). Both: Wqkv rows are
    [q; k; v], fc rows [gate; up]."""
    d, H, G, D, F = dims.d, dims.H, dims.G, dims.D, dims.F
    qkv, qkv_shape = p + "attn.Wqkv.weight", ((H + 2 * G) * D, d)

    def rope_order(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        if not layout.interleaved_rope:
            return lambda a: a
        return lambda a: _interleaved_to_rotate_half(a, heads, D)

    def norm(ours: str) -> None:
        if ours in layout.norms:
            recipe[f"{b}.{ours}"] = take(f"{p}{layout.norms[ours]}.weight", (d,))

    norm("attn_norm")
    recipe[f"{b}.wq"] = rows(qkv, qkv_shape, 0, H * D, rope_order(H))
    recipe[f"{b}.wk"] = rows(qkv, qkv_shape, H * D, (H + G) * D, rope_order(G))
    recipe[f"{b}.wv"] = rows(qkv, qkv_shape, (H + G) * D, (H + 2 * G) * D)
    if qk_bias:
        bias, shape = p + "attn.qk_bias", (2, 1, H, D)
        recipe[f"{b}.bq"] = Source((bias,), (shape,), lambda a: rope_order(H)(a[0].reshape(-1)))
        recipe[f"{b}.bk"] = Source((bias,), (shape,), lambda a: rope_order(G)(a[1].reshape(-1)))
        recipe[f"{b}.bv"] = zeros(G * D)
    recipe[f"{b}.wo"] = take(p + "attn.proj.weight", (d, H * D))
    norm("attn_post_norm")
    norm("mlp_norm")
    fc, fc_shape = p + "mlp.fc.weight", (2 * F, d)
    recipe[f"{b}.w_gate"] = rows(fc, fc_shape, 0, F)
    recipe[f"{b}.w_up"] = rows(fc, fc_shape, F, 2 * F)
    recipe[f"{b}.w_down"] = take(p + "mlp.proj.weight", (d, F))
    norm("ffn_post_norm")


Mapper = Callable[[Dict[str, Any], Options, AbstractSet[str]], Plan]


def _by_config(mapper: Callable[[Dict[str, Any], Options], Plan]) -> Mapper:
    """A mapper that needs config.json only."""
    return lambda config, options, names: mapper(config, options)


# ---- HrmTextForCausalLM: HRM-Text (transformers 5.23's models/hrm_text) -------------------

def _hrm_text(config: Dict[str, Any], options: Options) -> Plan:
    """HRM-Text: two stacks of num_layers_per_stack pre-norm blocks (weightless norms, a sigmoid
    gate on the attention output, multi-head; the checkpoint fuses gate, q, k, v in
    attn.gqkv_proj and gate, up in mlp.gate_up_proj), the two-state core of docs/spec.md §1 with
    L_cycles low cycles in each of H_cycles iterations, the embedding times embedding_scale
    (1 / initializer_range when null), lm_head on the high stack's (weightless) closing norm.
    z_L_init must be zero (the published code creates it so and never trains it)."""
    _require_value(config, "hidden_act", ("silu",), "TinyLoop's MLP is SwiGLU (silu)")
    for key in ("mlp_bias", "attention_bias"):
        _require_value(config, key, (False, None), "TinyLoop's o_proj, gate_proj and MLP "
                       "linears have no bias")
    d, H = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    D = _optional_int(config, "head_dim", 128)         # HrmTextConfig's default, not d / H
    F, V = _int(config, "intermediate_size"), _int(config, "vocab_size")
    n = _int(config, "num_layers_per_stack")
    cycles, loops = _int(config, "L_cycles", 3), _int(config, "H_cycles", 2)
    if n < 1 or cycles < 1 or loops < 1:
        raise ConvertError(f"config.json: num_layers_per_stack ({n}), L_cycles ({cycles}) and "
                           f"H_cycles ({loops}) must be >= 1")
    scale = config.get("embedding_scale")
    scale = 1.0 / _float(config, "initializer_range", 0.02) if scale is None else _float(
        config, "embedding_scale")
    tied = bool(config.get("tie_word_embeddings", False))
    theta, inv_freq = _rope(config, D)
    mc = _model_config(
        options, max_seq_len=_max_seq_len(options, _int(config, "max_position_embeddings")),
        vocab_size=V, d_model=d, n_heads=H, n_kv_heads=H, head_dim=D, ffn_dim=F,
        n_pre_blocks=0, default_loops=_loops(options, loops), tied_head=tied, rope_theta=theta,
        rms_eps=_float(config, "rms_norm_eps", 1e-6), n_core_blocks=2 * n, embed_scale=scale,
        core_cycles=cycles, attn_gate=True)
    ones = Source((), (), lambda: np.ones(d, np.float32))
    recipe = {"tok_emb": Source(("model.embed_tokens.weight", "model.z_L_init"), ((V, d), (d,)),
                                _zero_low_state),
              "final_norm": ones}
    for b, (stack, j) in zip(mc.block_prefixes(), [(s, j) for s in ("L", "H") for j in range(n)]):
        p = f"model.{stack}_module.layers.{j}."
        recipe[f"{b}.attn_norm"] = recipe[f"{b}.mlp_norm"] = ones
        gqkv, gqkv_shape = p + "attn.gqkv_proj.weight", (4 * H * D, d)
        for i, part in enumerate("gqkv"):           # fused in this order, H * D rows each
            recipe[f"{b}.w{part}"] = rows(gqkv, gqkv_shape, i * H * D, (i + 1) * H * D)
        recipe[f"{b}.wo"] = take(p + "attn.o_proj.weight", (d, H * D))
        gate_up, gate_up_shape = p + "mlp.gate_up_proj.weight", (2 * F, d)
        recipe[f"{b}.w_gate"] = rows(gate_up, gate_up_shape, 0, F)
        recipe[f"{b}.w_up"] = rows(gate_up, gate_up_shape, F, 2 * F)
        recipe[f"{b}.w_down"] = take(p + "mlp.down_proj.weight", (d, F))
    if not tied:
        recipe["head"] = take("lm_head.weight", (V, d))
    return Plan(mc, recipe, r"lm_head\.weight" if tied else "", inv_freq)


def _zero_low_state(embedding: np.ndarray, z_l_init: np.ndarray) -> np.ndarray:
    """The embedding, once z_L_init (the low state's start) is checked to be zero: docs/spec.md
    §1 starts the low state at zero."""
    if np.any(z_l_init != 0):
        raise ConvertError("model.z_L_init is not zero: TinyLoop starts HRM-Text's low state "
                           "at zero (docs/spec.md §1), as the published model creates it")
    return embedding


MAPPERS: Dict[str, Mapper] = {
    "LlamaForCausalLM": _by_config(_llama),
    "MistralForCausalLM": _by_config(_llama),
    "Qwen2ForCausalLM": _by_config(_qwen2),
    "NanbeigeForCausalLM": _by_config(_nanbeige),
    "OuroForCausalLM": _by_config(_ouro),
    "RavenForCausalLM": _raven,
    "HrmTextForCausalLM": _by_config(_hrm_text),
    "IQuestLoopCoderForCausalLM": _by_config(_iquest_loop),
}


# Looped models TinyLoop knows of but cannot run yet, and the operations docs/spec.md lacks for
# each (docs/models.md, "Not supported"). Parcae's config names no architecture, only its class.
NOT_YET = {
    "ParcaeConfig": "Parcae's ReLU^2 MLP, per-head q/k norms after RoPE, gated value "
                    "embeddings, prelude norm, the linear before the coda and its diagonal "
                    "injection",
}


def plan_for(config: Dict[str, Any], options: Options,
             tensors: AbstractSet[str]) -> Tuple[str, Plan]:
    """(architecture name, its Plan) for a checkpoint's config.json and tensor names."""
    names = config.get("architectures")
    known = names[0] if isinstance(names, list) and names else config.get("_class_name")
    if isinstance(known, str) and known in NOT_YET:
        raise ConvertError(f"config.json: {known} is a looped model TinyLoop cannot run yet: "
                           f"docs/spec.md has no form for {NOT_YET[known]}")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ConvertError(f"config.json: architectures must name one architecture, got "
                           f"{names!r}")
    mapper = MAPPERS.get(names[0])
    if mapper is None:
        raise ConvertError(f"config.json: architecture {names[0]!r} is not supported; "
                           f"TinyLoop converts {', '.join(MAPPERS)}")
    return names[0], mapper(config, options, tensors)
