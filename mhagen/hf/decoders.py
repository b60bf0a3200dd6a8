"""The decoder-only families of mhagen.hf.optimize: how each Hugging Face attention class
maps onto one fused mhagen layer (mhagen.mha options and per-head weights), and what each
refuses by name.

- llama (LlamaAttention, MistralAttention, Qwen2Attention, Gemma2Attention): q/k/v/o
  Linear layers, grouped K/V, rotary (rope_type "default": mhagen.rotary(rope_theta);
  other rope types are refused), the module's `scaling` (Gemma 2: query_pre_attn_scalar),
  sliding windows (Mistral's config.sliding_window, Qwen2/Gemma 2 per layer type), Gemma
  2's attn_logit_softcapping; Gemma 2's bidirectional variant is refused.
- gpt2 (GPT2Attention): Conv1D weights ([in, out]: c_attn [D, 3D], c_proj [D, D]), the
  module's scaling (scale_attn_weights, scale_attn_by_inverse_layer_idx); its
  cross-attention variant is refused.
- bloom (BloomAttention): the fused query_key_value interleaved per head ([H, 3, d] rows),
  ALiBi (mhagen.alibi: BLOOM's slopes are the paper's), the residual added as BLOOM's
  attention does.
- falcon (FalconAttention): query_key_value in its three layouts (new_decoder_architecture:
  per K/V group [queries..., key, value]; multi_query: [H queries, key, value]; otherwise
  [H, 3, d] per head), rotary (rope_type "default") or ALiBi divided by sqrt(head_dim)
  (Falcon adds alibi / sqrt(head_dim) to the scaled scores).

Weights are read from the module's parameters as float32 numpy (w_q[h] = W_q rows of head
h, transposed to [D, d]); a projection without bias gets zeros where another has one.
"""
from __future__ import annotations

import math

import numpy as np

import mhagen
from mhagen.ir.expr import alibi_slopes
from mhagen.hf.fused import Family, LayerPlan, Unsupported, register_family


def _array(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def _heads_in(weight: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """A Linear weight [heads * d, D] (out, in) -> per-head [heads, D, d]."""
    return np.ascontiguousarray(weight.reshape(heads, head_dim, -1).transpose(0, 2, 1))


def _weights(q, k, v, o, bq, bk, bv, bo, heads, kv_heads, head_dim, d_model):
    """mhagen's weights from Linear-layout arrays (q [H*d, D] ... o [D, H*d], biases or
    None); returns (weights, bias) with zeros for missing biases when any is present."""
    w = {"w_q": _heads_in(q, heads, head_dim), "w_k": _heads_in(k, kv_heads, head_dim),
         "w_v": _heads_in(v, kv_heads, head_dim), "w_o": np.ascontiguousarray(o.T)}
    bias = any(b is not None for b in (bq, bk, bv, bo))
    if bias:
        zeros = np.zeros
        w["b_q"] = (zeros((heads, head_dim), np.float32) if bq is None
                    else bq.reshape(heads, head_dim))
        w["b_k"] = (zeros((kv_heads, head_dim), np.float32) if bk is None
                    else bk.reshape(kv_heads, head_dim))
        w["b_v"] = (zeros((kv_heads, head_dim), np.float32) if bv is None
                    else bv.reshape(kv_heads, head_dim))
        w["b_o"] = zeros(d_model, np.float32) if bo is None else bo
    return w, bias


def _linear(layer):
    return _array(layer.weight), None if layer.bias is None else _array(layer.bias)


def _rotary(config, family: str):
    """mhagen.rotary of a config's rope parameters; other rope types refused by name."""
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope and not {"rope_type", "rope_theta"} <= set(rope):
        rope = next(iter(rope.values()), {}) if all(isinstance(v, dict)
                                                    for v in rope.values()) else rope
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise Unsupported(f"rope_type {kind!r} (scaled rotary) is not covered; mhagen's "
                          "rotary is the default RoPE (rope_theta only)")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return mhagen.rotary(base=float(theta)), float(theta)


def _hidden(fused, args, kwargs, name="hidden_states"):
    return args[0] if args else kwargs[name]


def _gqa_note(heads, kv_heads):
    return (f"{heads} heads" if heads == kv_heads else
            f"{heads} heads, {kv_heads} K/V heads" if kv_heads > 1 else
            f"{heads} heads, multi-query")


@register_family
class Llama(Family):
    """LLaMA and the families that share its attention (q/k/v/o projections, rotary)."""
    name = "llama"
    classes = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Gemma2Attention")

    def plan(self, module, config) -> LayerPlan:
        config = getattr(module, "config", config)
        if getattr(module, "is_causal", True) is False:
            raise Unsupported("bidirectional attention (use_bidirectional_attention) is not "
                              "covered: the fused decoder layers are causal")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim, d_model = module.head_dim, config.hidden_size
        rotary, theta = _rotary(config, self.name)
        if hasattr(module, "sliding_window"):       # Qwen2, Gemma 2: per layer type
            window = module.sliding_window
        else:                                       # Mistral reads its config
            window = getattr(config, "sliding_window", None)
        softcap = getattr(module, "attn_logit_softcapping", None)
        q, bq = _linear(module.q_proj)
        k, bk = _linear(module.k_proj)
        v, bv = _linear(module.v_proj)
        o, bo = _linear(module.o_proj)
        weights, bias = _weights(q, k, v, o, bq, bk, bv, bo, heads, kv_heads, head_dim,
                                 d_model)
        options = dict(d_model=d_model, num_heads=heads, head_dim=head_dim,
                       kv_heads=kv_heads, causal=True, rotary=rotary, bias=bias,
                       scale=float(module.scaling))
        note = [_gqa_note(heads, kv_heads), f"rotary {theta:g}"]
        if window is not None:
            options["mask"] = mhagen.sliding_window(int(window))
            note.append(f"window {window}")
        if softcap:
            options["score_mod"] = mhagen.softcap(float(softcap))
            note.append(f"softcap {softcap:g}")
        if not math.isclose(module.scaling, head_dim ** -0.5):
            note.append(f"scale {module.scaling:.6g}")
        return LayerPlan(options, weights, positions=True, note=", ".join(note))

    def forward(self, fused, *args, **kwargs):
        return fused.attend(_hidden(fused, args, kwargs)), None


@register_family
class GPT2(Family):
    """GPT-2: Conv1D projections ([in, out]), learned positions outside the attention."""
    name = "gpt2"
    classes = ("GPT2Attention",)

    def plan(self, module, config) -> LayerPlan:
        if module.is_cross_attention:
            raise Unsupported("GPT-2's cross-attention (add_cross_attention=True) is not "
                              "covered")
        heads, head_dim, d_model = module.num_heads, module.head_dim, module.embed_dim
        w = _array(module.c_attn.weight)             # [D, 3D]: in, out
        b = _array(module.c_attn.bias)
        q, k, v = (w[:, i * d_model:(i + 1) * d_model].T for i in range(3))
        bq, bk, bv = (b[i * d_model:(i + 1) * d_model] for i in range(3))
        o = _array(module.c_proj.weight).T           # Conv1D [in, out] -> Linear [out, in]
        weights, bias = _weights(q, k, v, o, bq, bk, bv, _array(module.c_proj.bias), heads,
                                 heads, head_dim, d_model)
        options = dict(d_model=d_model, num_heads=heads, head_dim=head_dim, causal=True,
                       bias=bias, scale=float(module.scaling))
        note = f"{heads} heads" + ("" if math.isclose(module.scaling, head_dim ** -0.5)
                                   else f", scale {module.scaling:.6g}")
        return LayerPlan(options, weights, note=note)

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs)
        if bound.arguments.get("encoder_hidden_states") is not None:
            raise Unsupported("GPT-2's cross-attention call is not covered")
        return fused.attend(bound.arguments["hidden_states"]), None


@register_family
class Bloom(Family):
    """BLOOM: fused query_key_value interleaved per head, ALiBi, the residual added inside."""
    name = "bloom"
    classes = ("BloomAttention",)

    def plan(self, module, config) -> LayerPlan:
        heads, head_dim, d_model = module.num_heads, module.head_dim, module.hidden_size
        w, b = _linear(module.query_key_value)       # rows [H, 3, d]
        w4, b3 = w.reshape(heads, 3, head_dim, d_model), b.reshape(heads, 3, head_dim)
        q, k, v = (w4[:, i].reshape(heads * head_dim, d_model) for i in range(3))
        bq, bk, bv = (b3[:, i].reshape(-1) for i in range(3))
        o, bo = _linear(module.dense)
        weights, bias = _weights(q, k, v, o, bq, bk, bv, bo, heads, heads, head_dim, d_model)
        options = dict(d_model=d_model, num_heads=heads, head_dim=head_dim, causal=True,
                       bias=bias, score_mod=mhagen.alibi(heads),
                       scale=float(module.inv_norm_factor))
        return LayerPlan(options, weights, note=f"{heads} heads, ALiBi")

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs)
        y = fused.attend(bound.arguments["hidden_states"])
        return y + bound.arguments["residual"], None     # dropout_add in eval mode


def _falcon_alibi(heads: int, head_dim: int):
    """Falcon's ALiBi: its slopes (BLOOM's) divided by sqrt(head_dim), added to the scaled
    scores as slope * (kv_idx - q_idx) (softmax ignores the per-query constant)."""
    slopes = [s / math.sqrt(head_dim) for s in alibi_slopes(heads)]
    return mhagen.score + mhagen.table(slopes, mhagen.head) * (mhagen.kv_idx - mhagen.q_idx)


@register_family
class Falcon(Family):
    """Falcon: query_key_value in its three layouts, rotary or ALiBi."""
    name = "falcon"
    classes = ("FalconAttention",)

    def plan(self, module, config) -> LayerPlan:
        config = module.config
        heads, head_dim, d_model = module.num_heads, module.head_dim, module.hidden_size
        kv_heads = module.num_kv_heads
        w, b = _linear(module.query_key_value)
        rows = w.reshape(-1, head_dim, d_model)
        brows = None if b is None else b.reshape(-1, head_dim)
        if module.new_decoder_architecture:
            per = heads // kv_heads + 2             # each group: its queries, a key, a value
            group = np.arange(rows.shape[0]).reshape(kv_heads, per)
            pick = (group[:, :-2].reshape(-1), group[:, -2], group[:, -1])
            layout = "grouped"
        elif module.multi_query:
            pick = (np.arange(heads), np.array([heads]), np.array([heads + 1]))
            layout = "multi-query"
        else:
            trip = np.arange(rows.shape[0]).reshape(heads, 3)
            pick = (trip[:, 0], trip[:, 1], trip[:, 2])
            layout = "per-head"
        q, k, v = (rows[i].reshape(-1, d_model) for i in pick)
        bq, bk, bv = ((None,) * 3 if brows is None else
                      tuple(brows[i].reshape(-1) for i in pick))
        o, bo = _linear(module.dense)
        weights, bias = _weights(q, k, v, o, bq, bk, bv, bo, heads, kv_heads, head_dim,
                                 d_model)
        options = dict(d_model=d_model, num_heads=heads, head_dim=head_dim,
                       kv_heads=kv_heads, causal=True, bias=bias,
                       scale=float(module.inv_norm_factor))
        note = [_gqa_note(heads, kv_heads), f"{layout} query_key_value"]
        if config.alibi:
            options["score_mod"] = _falcon_alibi(heads, head_dim)
            note.append("ALiBi / sqrt(head_dim)")
            positions = False
        else:
            rotary, theta = _rotary(config, self.name)
            options["rotary"] = rotary
            note.append(f"rotary {theta:g}")
            positions = True
        return LayerPlan(options, weights, positions=positions, note=", ".join(note))

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs)
        return fused.attend(bound.arguments["hidden_states"]), None
