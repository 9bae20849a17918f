"""Block-scaled FP8 weights (the format of Qwen's and DeepSeek's FP8 releases): ``naive.py`` the
readable reference (quantize, dequantize, the linear and the routed experts), ``torch.py`` the
torch path (dequantize what is used, then the bf16/fp32 op), ``gemm.py`` and ``moe.py`` the
Triton kernels (FP8 weights upcast in registers, block scales on the fp32 partial sums)."""
