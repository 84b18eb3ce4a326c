"""The ops: one folder per public op (its front on every backend, its Triton or native kernels,
hostile inputs, the paged form); here the checks that cover every op at once (registration,
opcheck, compile, backend choice, AOT compilation, realistic shapes)."""
