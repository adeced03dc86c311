"""GPU check of the Qwen3.5 adapter: the flash-linear-attention path against the torch delta rule, and replay on CUDA.

1. `gated_delta_rule` on bf16 CUDA inputs (the fla kernel when installed) against `torch_gated_delta_rule` on fp32
   copies: output, final state and the gradients of every input, the initial state included (exact mode needs it).
2. The tiny hybrid on CUDA in fp32 (torch path): prefix state + replay against the padded full forward, as the CPU
   test does.

Exits 0 when both pass, 1 when one fails, 2 without CUDA.

    python benchmarks/qwen3_5_gpu_check.py
"""

from __future__ import annotations

import sys
import tempfile

import torch

# bf16 rounds inputs to 8 bits of mantissa; over 1000 steps of a recurrence the relative error stays at a few 1e-3.
BF16_RTOL = 3e-2
LOGP_ATOL = 1e-4  # fp32 on GPU: TF32 is off by default for matmuls in torch, the CPU bar is 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_kernel() -> bool:
    from trl_longstraw.qwen3_5 import fla_chunk_gated_delta_rule, gated_delta_rule, torch_gated_delta_rule

    print(f"fla installed: {fla_chunk_gated_delta_rule is not None}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hk, hv, d = 1000, 16, 48, 128
    q, k = (torch.randn(1, t, hk, d, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(1, t, hv, d, device="cuda", generator=gen)
    g = -torch.rand(1, t, hv, device="cuda", generator=gen) * 0.3
    beta = torch.rand(1, t, hv, device="cuda", generator=gen)
    s0 = torch.randn(1, hv, d, d, device="cuda", generator=gen) * 0.1
    w_out = torch.randn(1, t, hv, d, device="cuda", generator=gen)
    w_state = torch.randn(1, hv, d, d, device="cuda", generator=gen)

    def run(fn, dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [x.clone().requires_grad_() for x in (g, beta, s0)]
        if dtype != torch.float32:
            xs[4] = beta.to(dtype).requires_grad_()  # stock passes beta in the model dtype, g in fp32
        out, state = fn(*xs[:5], xs[5])
        ((out.float() * w_out).sum() + (state * w_state).sum()).backward()
        return out, state, [x.grad for x in xs]

    out, state, grads = run(gated_delta_rule, torch.bfloat16)
    ref_out, ref_state, ref_grads = run(torch_gated_delta_rule, torch.float32)
    errors = {"output": rel(out, ref_out), "state": rel(state, ref_state)}
    errors.update(
        {f"grad {n}": rel(a, b) for n, a, b in zip("q k v g beta s0".split(), grads, ref_grads, strict=True)}
    )
    for name, err in errors.items():
        print(f"  {name}: relative error {err:.2e}")
    return all(err <= BF16_RTOL for err in errors.values())


def check_replay() -> bool:
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine
    from trl_longstraw.reference import plain_token_logps
    from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

    path = save_tiny_model(tempfile.mkdtemp(), "qwen3_5")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    mb = random_micro_batch([301, 7, 1], [9, 1, 5, 3], [0, 1, 0, 2], len(build_tokenizer()), seed=1)
    mb = {k: v.cuda() for k, v in mb.items()}
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    c = mb["completion_ids"].shape[1]
    with torch.no_grad():
        ref, _ = plain_token_logps(
            model(input_ids=ids, attention_mask=mask).logits[:, -c - 1 : -1], mb["completion_ids"], 1.0
        )
        engine = Engine(model, model, get_adapter(model), chunk_size=70)
        lp, _ = engine.score(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    scored = mb["completion_mask"].bool()
    err = (lp[scored] - ref[scored]).abs().max().item()
    print(f"  replay log-probs on CUDA (fp32): max abs error {err:.2e}")
    return err <= LOGP_ATOL


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        sys.exit(2)
    print("1. delta rule, bf16 (fla when installed) against fp32 torch:")
    ok_kernel = check_kernel()
    print("2. tiny hybrid replay on CUDA:")
    ok_replay = check_replay()
    print("PASS" if ok_kernel and ok_replay else "FAIL")
    sys.exit(0 if ok_kernel and ok_replay else 1)


if __name__ == "__main__":
    main()
