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
# The other metrics that a `train()` step logs (kl, entropy, clip ratios, ...) against stock, relative with an absolute
# floor: kl is a mean of functions of the difference between near-equal policy and reference log-probs (about 1e-2 of
# their size), so their ~1e-7 rounding becomes ~1e-5 of it (measured up to 6e-6 on the tiny feature-matrix runs).
METRIC_RTOL = 1e-4
METRIC_ATOL = 1e-5
# prefix_merge_attention against reference_attention, fp32 outputs and gradients, absolute.
ATTN_ATOL_FP32 = 1e-5
# trl_longstraw.qwen3_5.torch_gated_delta_rule against stock's chunked and per-token delta rules, outputs and final
# states, absolute (measured ~3e-7; bit-identical to stock's chunked rule when run in one piece).
DELTA_RULE_ATOL = 1e-5
# bf16: inputs rounded to 8 bits of mantissa; the merged result is computed in fp32 then rounded once, the reference
# rounds its softmax output, so the two can differ by a few bf16 ulps of values of order 1.
ATTN_ATOL_BF16 = 3e-2
# Data-parallel (DDP, FSDP2) and sharded-prompt-state gradients against the single-process gradient of the same global
# batch, relative error in norm per parameter: only the float summation order differs (the bar).
DIST_GRAD_RTOL = 1e-6
# The sharded prompt state against the same single-process gradient. Loosened from DIST_GRAD_RTOL because more sums
# change order: each replicated prefill/reverse chunk is back-propagated by every rank with its share of the seeds
# (shares summed by the data-parallel reduction), and prompt attention merges the ranks' parts. Measured up to 1.1e-6
# on Gated DeltaNet's scalar parameters (A_log, dt_bias), whose gradients sum every prompt token's contribution; the
# sharded kernels alone match fp64 references to 1e-12 (fp64) and 5e-7 (fp32, fused CPU kernels).
SHARDED_GRAD_RTOL = 2e-6
# sharded_prefix_attention against prefix_merge_attention in fp64, absolute (outputs and gradients).
SHARDED_ATTN_ATOL_FP64 = 1e-12
# DSA tests: the smallest gap between a query's k-th and (k+1)-th indexer score, relative to its largest score in
# magnitude, that the tiny glm_moe_dsa batches must show on the stock model. fp32 noise between two summation orders
# (~1e-6 relative) cannot flip a selection across it; the test batches show >= 1e-3.
DSA_MIN_CUTOFF_GAP = 1e-4

# Capacity planner (not float rounding). Published parameter counts are rounded to 2-3 significant digits ("27B",
# "~743B"), so a count built from the real shapes is compared within 2%.
PARAM_COUNT_RTOL = 0.02
# The issue quotes Qwen3.6-27B's fixed prompt state as "about 148 MiB"; the formula gives 146.81 MiB (the issue's
# figure keeps the whole conv window, 4 inputs, where later tokens need the last 3).
STATE_FIXED_RTOL = 0.01
# bf16 on a GPU (benchmarks/gpu_check.py), relative error in norm of outputs and of each gradient against the fp32
# reference on the same rounded inputs: bf16 keeps 8 bits (relative 2^-8 ~ 4e-3 per rounding), and gradients summed
# over thousands of keys or queries reach magnitudes where an absolute bound says nothing.
ATTN_RTOL_BF16 = 2e-2

# Mixed precision: bf16 (TRL's default `bf16=True`, autocast over fp32 weights; or bf16 weights) against stock fp32 on
# the same micro-batch through `trainer.train()` (tests/precision.py). Ours' error is at most BF16_ERROR_FACTOR times
# stock's own bf16 error (detached mode: the plain reference's), each measured against the fp32 run, for
#   - the per-token log-probs: the largest absolute difference over every scored completion token;
#   - the loss: the absolute difference, an error below LOSS_ATOL counting as LOSS_ATOL (at the first iteration the
#     loss depends on the per-token values only through its KL and entropy terms, and both runs' loss errors are a
#     few fp32 ulps of the loss itself: 6e-8 to 7e-7 measured, ours under and over stock's by turns);
#   - the gradient: the relative error in norm ||g - g_fp32|| / ||g_fp32|| of the whole gradient (every parameter
#     gradient concatenated), and of each parameter group (the parameters of one name across layers);
#   - over a run of several optimizer steps (tests/test_matrix.py): the summed relative distance of each step's loss
#     and gradient norm.
# The factor. Rounding alone gives similar errors (measured ours/stock 0.6x to 1.5x); the factor is the room
# for a different rounding order (chunks, branches, absorbed MLA), not for lost precision.
BF16_ERROR_FACTOR = 2.0
