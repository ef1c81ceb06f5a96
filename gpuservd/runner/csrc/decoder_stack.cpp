// Every decoder layer of one forward in a single call, for the CPU.
//
// The Python layer loop (llama.py) calls eight C++ ops a layer; at decode row counts each call's
// interpreter and dispatch work (~3-10 us) is a large part of the op, and on SmolLM2's 30 layers the
// loop came to ~4-5 ms a step of a ~24 ms 8-row step. This runs the same ops, in the same order, on
// the same tensors, from C++: the outputs are bit-identical to the loop's, and the interpreter (and its
// lock, which the daemon's event loop shares with an engine thread) is out of the step until the
// logits. It calls the ops through the dispatcher by name, so each kernel stays in its own file and
// a kernel this CPU lacks (bf16 pairs without AVX512_BF16) is only looked up when used.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

using OptTensor = std::optional<at::Tensor>;

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, bool)>
pairs_linear() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gpuserv::packed_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, bool)>();
  return op;
}

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, int64_t)>
panels_linear() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gpuserv::packed_linear_f32", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, int64_t)>();
  return op;
}

struct LayerOps {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)> add_rms_norm_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                const at::Tensor&, int64_t, int64_t)>
      rope_store_kv;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      paged_decode;
};

const LayerOps& layer_ops() {
  static const LayerOps ops = [] {
    auto& d = c10::Dispatcher::singleton();
    return LayerOps{
        d.findSchemaOrThrow("gpuserv::rms_norm", "").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("gpuserv::add_rms_norm_", "")
            .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("gpuserv::silu_mul", "").typed<at::Tensor(const at::Tensor&)>(),
        d.findSchemaOrThrow("gpuserv::rope_store_kv", "")
            .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                        int64_t, int64_t)>(),
        d.findSchemaOrThrow("gpuserv::paged_decode", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double)>()};
  }();
  return ops;
}

// h [T, D] is the residual stream entering layer 0; it leaves holding the last layer's output (before the
// final norm), updated in place as the Python loop does. Per layer l, weights[4 l .. 4 l + 3] are the
// packed qkv, o_proj, gate_up and down (bf16 pair panels, or fp32/bf16 column panels when `panels`),
// biases[4 l + j] theirs (None: no bias), out_features[j] their widths; norms[2 l], norms[2 l + 1] the input
// and post-attention RMSNorm weights; k_caches[l] / v_caches[l] the layer's cache [N, bs, KVH, hd].
// Every row attends in paged_decode (decode rows and short prefill chunks, batch.py's kernel rows).
void decoder_stack(at::Tensor& h, at::TensorList weights, const c10::List<OptTensor>& biases,
                   at::IntArrayRef out_features, bool panels, at::TensorList norms, at::TensorList k_caches,
                   at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                   const at::Tensor& block_table, const at::Tensor& ctx_lens, int64_t num_heads,
                   int64_t num_kv_heads, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(v_caches.size()) == L && out_features.size() == 4,
              "decoder_stack: per layer 4 weights, 4 biases, 2 norms and a k and v cache; 4 widths");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decoder_stack: h must be a contiguous [T, D]");
  const int64_t T = h.size(0);
  const int64_t head_dim = k_caches[0].size(3);
  const auto& ops = layer_ops();
  auto linear = [&](const at::Tensor& x, int64_t l, int j) -> at::Tensor {
    const OptTensor bias = biases.get(4 * l + j);
    if (panels) return panels_linear().call(x, weights[4 * l + j], out_features[j], bias, 0);
    return pairs_linear().call(x, weights[4 * l + j], out_features[j], bias, false);
  };
  at::Tensor x = ops.rms_norm.call(h, norms[0], eps);
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor qkv = linear(x, l, 0).view({T, num_heads + 2 * num_kv_heads, head_dim});
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    ops.rope_store_kv.call(qkv, cos, sin, kc, vc, slots, num_heads, num_kv_heads);
    at::Tensor attn = ops.paged_decode.call(qkv.narrow(1, 0, num_heads), kc, vc, block_table, ctx_lens, scale);
    x = ops.add_rms_norm_.call(h, linear(attn.reshape({T, num_heads * head_dim}), l, 1), norms[2 * l + 1], eps);
    at::Tensor delta = linear(ops.silu_mul.call(linear(x, l, 2)), l, 3);
    if (l + 1 < L)
      x = ops.add_rms_norm_.call(h, delta, norms[2 * (l + 1)], eps);
    else
      h.add_(delta);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("decoder_stack(Tensor(a!) h, Tensor[] weights, Tensor?[] biases, int[] out_features, bool panels, "
        "Tensor[] norms, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor block_table, Tensor ctx_lens, int num_heads, int num_kv_heads, float eps, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
