// specdec_kernels._C: the Python module that loads the native ops.
//
// The native kernels' schemas are declared here, in two namespaces apart from the public ops of
// `specdec`: `specdec_native`, the ops' CPU and CUDA backends (kernels in compact_kv_cache.cpp,
// verify_sample_cpu.cpp, paged_attention_cpu.cpp; on CUDA compact_kv_cache_cuda.cpp, a thin
// binding over the torch-free kernel compact_kv_cache_kernel.cu), and `specdec_engine`, the
// engine's model kernels (packed_linear_cpu.cpp, packed_linear_int8_cpu.cpp, decoder_layer_cpu.cpp).
// common.h holds the helpers the sources share.  Importing this module registers them as
// torch.ops.specdec_native.<name> and torch.ops.specdec_engine.<name>.
#include <Python.h>
#include <torch/library.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "specdec_kernels native ops", -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY_FRAGMENT(specdec_native, m) {
  // The public ops are defined in Python (specdec_kernels.ops); this library adds the native
  // kernels they dispatch to.
  // compact_kv_cache: `caches` holds [B, Hkv, S, D] tensors and/or [L, 2, B, Hkv, S, D]
  // buffers (each expanded into its 2L slices), all of one dtype and shape; modified in place.
  // validate=true runs the value checks of the Python op (a device sync on CUDA); with it off
  // the kernels skip out-of-range slots and never touch memory outside the caches.
  m.def(
      "compact_kv_cache(Tensor(a!)[] caches, Tensor cache_seqlens, Tensor accepted_indices, "
      "Tensor num_accepted, bool validate=False) -> ()");
  // paged_compact_kv_cache: the same on a paged cache.  `caches` holds per-layer pools
  // [num_blocks, block_size, Hkv, D] (kv_layout "NHD") or [num_blocks, Hkv, block_size, D]
  // ("HND") and/or [L, 2, ...] buffers of them; block_table [B, max_blocks_per_seq] (int32 or
  // int64) maps logical blocks to physical ones.  Entries outside the table or the pool are
  // skipped; validate=true adds the block-id and no-shared-written-slot checks.
  m.def(
      "paged_compact_kv_cache(Tensor(a!)[] caches, Tensor cache_seqlens, Tensor accepted_indices, "
      "Tensor num_accepted, Tensor block_table, str kv_layout=\"NHD\", bool validate=False) -> ()");

  // CPU fast paths of the verification and sampling ops (csrc/verify_sample_cpu.cpp), on
  // inputs the Python op validated; the [..., V] tensors are read in place through their strides
  // (expanded, sliced and transposed ones too), and the kernels clamp every count and index they
  // use as an address.  The sampling ops take explicit uniforms (clamped into [0, 1) in the
  // kernel, NaN as 0) or, for the missing ones, per-request seeds and offsets from which the
  // kernel computes the Philox numbers itself.
  m.def("verify_greedy(Tensor target_logits, Tensor draft_tokens, Tensor num_draft_tokens) -> (Tensor, Tensor)");
  // The flattened (vLLM v1) forms: target rows [T + B, V] (bonus rows inline) or [T, V] with
  // bonus_token_ids [B]; drafts [T]; cu_num_draft_tokens [B] an inclusive cumsum; output
  // [B, max_spec_len + 1].  Spans derived from cu are clamped, so any cu stays in bounds.
  m.def(
      "verify_greedy_flattened(Tensor target_logits, Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor? bonus_token_ids, int max_spec_len) -> (Tensor, Tensor)");
  m.def(
      "verify_tree_greedy(Tensor target_logits, Tensor tree_tokens, Tensor tree_parents, Tensor num_nodes) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "rejection_sample(Tensor target_probs, Tensor? draft_probs, Tensor draft_tokens, Tensor num_draft_tokens, "
      "Tensor? uniform_samples, Tensor? sample_uniforms, Tensor? seeds=None, Tensor? offsets=None) -> (Tensor, "
      "Tensor)");
  m.def(
      "rejection_sample_flattened(Tensor target_probs, Tensor? draft_probs, Tensor draft_token_ids, "
      "Tensor cu_num_draft_tokens, Tensor? bonus_token_ids, Tensor? uniform_samples, Tensor? sample_uniforms, "
      "int max_spec_len, Tensor? seeds=None, Tensor? offsets=None) -> (Tensor, Tensor)");
  m.def(
      "tree_rejection_sample(Tensor target_probs, Tensor tree_tokens, Tensor tree_parents, Tensor? draft_probs, "
      "Tensor num_nodes, Tensor? uniform_samples, Tensor? sample_uniforms, Tensor? seeds=None, Tensor? offsets=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("sampling_probs(Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p) -> Tensor");
  // The sampling kernels' counter-based uniforms (Philox4x32-10 from seeds and offsets, as
  // specdec_kernels/_random.py defines them) as a float32 [B, width] tensor: a debug path for the tests.
  m.def("philox_uniforms(Tensor seeds, Tensor offsets, int width, int stream) -> Tensor");

  // CPU tree attention over a paged KV cache (csrc/paged_attention_cpu.cpp), reading K/V through
  // the block table in place: q [B, N, H, D] float32/float16/bfloat16; pools [num_blocks,
  // block_size, Hkv, D] ("NHD") or [num_blocks, Hkv, block_size, D] ("HND"); tree_mask None
  // (causal chain) or bool [N, N] / [B, N, N]; block_table int32 [B, max_blocks_per_seq].
  // cache_seqlens are clamped into [0, capacity - N] and block ids into [0, num_blocks).
  m.def(
      "paged_tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? tree_mask, "
      "Tensor block_table, str kv_layout, float sm_scale) -> Tensor");
  // The same kernel over a dense cache [B, Hkv, S, D] (sequence b's slots are row b).
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? tree_mask, "
      "float sm_scale) -> Tensor");
}

// The engine's CPU kernels (specdec_kernels.decoding: its model's products and layer), apart from
// the ops' backends: torch.ops.specdec_engine.<name>.  Their fakes are registered in Python
// (specdec_kernels/_native.py).
TORCH_LIBRARY_FRAGMENT(specdec_engine, m) {
  // CPU matrix product y = x @ W^T with W stored block-quantised (csrc/packed_linear_cpu.cpp):
  // x float32 [R, I]; kind 0 "affine4" (ggml Q4_1: codes uint8 [O, I / 2], scales and mins
  // float32 [O, I / 32]), 1 "scaled8" (ggml Q8_0: codes int8 as uint8 [O, I], scales) or 2
  // "float32" (codes the float32 weight [O, I], scales unused); returns float32 [R, O], each row
  // independent of the others.  portable=true skips the AVX2 path (for tests).
  m.def(
      "packed_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, bool portable=False) "
      "-> Tensor");
  // The exact packed form of a float32 CPU weight [O, I]: (kind 0 affine4 / 1 scaled8 / -1 none,
  // codes, scales, mins), checked element by element (see csrc/packed_linear_cpu.cpp).
  m.def("packed_weight(Tensor weight) -> (int, Tensor, Tensor, Tensor)");
  // One decoder layer of the engine's model (csrc/decoder_layer_cpu.cpp): Block.forward's ops in
  // one call, writing the block's keys and values into k_cache / v_cache; weights holds 4 linears x 3
  // slots whose kinds say which product reads them; isa: the int8 products' path (0: the best).
  m.def(
      "decoder_layer(Tensor x, Tensor attn_norm, Tensor ffn_norm, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask, Tensor? qkv_bias, "
      "Tensor?[] weights, int[] kinds, int[] out_features, int num_heads, int num_kv_heads, int isa=0) -> Tensor");
  // The layers 0 .. L - 1 of a pass in one call (csrc/decoder_layer_cpu.cpp): decoder_layer per layer
  // with norms[2 l], norms[2 l + 1], qkv_biases[l], weights[12 l ..], kinds / out_features[4 l ..] and
  // the caches kv_cache[l] ([L', 2, B, Hkv, S, D], written in place); L = len(qkv_biases).
  m.def(
      "decoder_stack(Tensor x, Tensor[] norms, float eps, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
      "Tensor cache_seqlens, Tensor? tree_mask, Tensor?[] qkv_biases, Tensor?[] weights, int[] kinds, "
      "int[] out_features, int num_heads, int num_kv_heads, int isa=0) -> Tensor");
  // RMSNorm over the last dimension of x float32 [..., n] with weight [n] (csrc/decoder_layer_cpu.cpp):
  // the loop decoder_layer runs (float64 sum of squares, each row alone), for the engine's
  // Python layer and final norm, so that every path of a pass rounds alike.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // SwiGLU's silu(gate) * up of gate_up float32 [..., 2 I] (gate first; csrc/decoder_layer_cpu.cpp):
  // the loop decoder_layer runs, for the engine's Python layer.  Returns float32 [..., I].
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // The same product with 8-bit activations (csrc/packed_linear_int8_cpu.cpp): x float32 [R, I]
  // quantised per block of 32; weights interleaved in groups of 8 output rows (qw uint8 [G, I / 32,
  // 128 (affine4) or 256 (scaled8)], dw and mw float16 [G, I / 32, 8]); out_features O; isa 0 best,
  // 1 portable, 2 AVX2, 3 AVX-512 VNNI.  Returns float32 [R, O].  packed_linear_int8_isas()
  // (defined beside it) lists the isa levels this CPU runs.
  m.def(
      "packed_linear_int8(Tensor x, Tensor qw, Tensor dw, Tensor? mw, int kind, int out_features, int isa=0) "
      "-> Tensor");
}
