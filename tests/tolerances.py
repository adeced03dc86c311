"""The one table of numerical tolerances used by the tests (fp32 unless named otherwise).

Loosening an entry needs a written reason next to it.
"""

# Relative error in norm, ||ours - ref|| / ||ref||, of each parameter gradient against stock or a plain reference.
# The bar; measured errors on the tiny models are ~5e-7 (different summation order of chunked attention).
GRAD_RTOL = 1e-5
# Per-token log-probs and entropies, absolute.
LOGP_ATOL = 1e-5
# The scalar loss, absolute.
LOSS_ATOL = 1e-6
# prefix_merge_attention against reference_attention, fp32 outputs and gradients, absolute.
ATTN_ATOL_FP32 = 1e-5
# bf16: inputs rounded to 8 bits of mantissa; the merged result is computed in fp32 then rounded once, the reference
# rounds its softmax output, so the two can differ by a few bf16 ulps of values of order 1.
ATTN_ATOL_BF16 = 3e-2
# bf16 on a GPU (benchmarks/gpu_check.py), relative error in norm of outputs and of each gradient against the fp32
# reference on the same rounded inputs: bf16 keeps 8 bits (relative 2^-8 ~ 4e-3 per rounding), and gradients summed
# over thousands of keys or queries reach magnitudes where an absolute bound says nothing.
ATTN_RTOL_BF16 = 2e-2
