"""RoPE types whose frequencies depend on the forward call (`dynamic`, `longrope`), pinned to stock's forwards.

transformers' `dynamic_rope_update` lets a rotary module recompute its inverse frequencies from the positions of each
call, `length = max(position_ids) + 1`:

- `dynamic` (NTK): grows them to `length` when it exceeds the longest length seen so far (`max_seq_len_cached`), and
  resets them to the original ones when a call is shorter than `max_position_embeddings` after a longer one. The
  frequencies of a call therefore depend on the earlier calls too.
- `longrope`: the long factors when `length > original_max_position_embeddings`, else the short ones.

Stock `GRPOTrainer` runs each loss, old-policy and reference forward once over the whole padded sequence, `P + C`
positions. The engine runs the same positions as chunks and branches, each of which would see a shorter `length`
and rotate with other frequencies. `RotaryPin.pinned(length)` applies transformers' own update once, for `length`
positions, so that the module's state evolves exactly as in stock's single forward, then holds those frequencies
while every chunk and branch of the engine call runs.

`transformers.generate` runs the prompt forward at `L`, the longest prompt of the batch (positions come from the
attention mask), and its `k`-th decoding step at `L + k`; `generation.generate_shared` pins its prefill and steps to
those lengths, decoding each distinct prompt from the state that stock's one batched `generate` started from.

The static types (`default`, `linear`, `yarn`, `llama3`, `proportional`) compute their frequencies once, when the
module is built: there is nothing to pin, and `RotaryPin` holds no module for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# While pinned, a module reports this type, for which transformers' update does nothing.
_HELD = "default"


def updates_per_call(rope_type: str) -> bool:
    """Whether transformers' `dynamic_rope_update` recomputes the frequencies of `rope_type` at each call (the same
    test as its wrapper)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary embedding modules of `model` whose frequencies change from call to call.

    Raises:
        ValueError: for a rotary module with per-layer-type RoPE settings (a dict of types) among which one updates
            per call: those are not pinned.
    """
    found = []
    for name, module in model.named_modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, dict):
            dynamic = sorted(t for t in rope_type.values() if isinstance(t, str) and updates_per_call(t))
            if dynamic:
                raise ValueError(
                    f"{name} uses per-layer-type RoPE with {dynamic}, which trl_longstraw does not pin to stock's "
                    "single forward: use a static rope_type (default, linear, yarn, llama3)."
                )
        elif isinstance(rope_type, str) and updates_per_call(rope_type) and hasattr(module, "inv_freq"):
            found.append(module)
    return found


class RotaryPin:
    """Pins the frequencies of a model's per-call RoPE modules (see the module docstring); a no-op without any."""

    def __init__(self, model: torch.nn.Module):
        self.modules = rotary_modules(model)

    @contextlib.contextmanager
    def pinned(self, length: int) -> Iterator[None]:
        """Within the block, every call of the rotary modules uses the frequencies of a stock forward over `length`
        positions, applied (with its effect on the cached state) on entry. Nested pins keep the outer frequencies."""
        held = []
        try:
            for module in self.modules:
                if module.rope_type == _HELD:
                    continue
                position_ids = torch.tensor([[length - 1]], device=module.inv_freq.device)
                # transformers' own update; the module's cos/sin for that one position are discarded.
                module(module.inv_freq, position_ids)
                held.append((module, module.rope_type))
                module.rope_type = _HELD
            yield
        finally:
            for module, rope_type in held:
                module.rope_type = rope_type

    def snapshot(self) -> list[dict[str, Any]]:
        """The per-call state of every module: frequencies, cached length and attention scaling."""
        return [
            {
                "inv_freq": module.inv_freq.clone(),
                "max_seq_len_cached": module.max_seq_len_cached,
                "attention_scaling": module.attention_scaling,
            }
            for module in self.modules
        ]

    def restore(self, snapshot: list[dict[str, Any]]) -> None:
        """Puts back a state taken by `snapshot`."""
        for module, state in zip(self.modules, snapshot, strict=True):
            module.inv_freq.copy_(state["inv_freq"])
            module.max_seq_len_cached = state["max_seq_len_cached"]
            module.attention_scaling = state["attention_scaling"]
