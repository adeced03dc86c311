"""Exact-mode recurrent boundaries in host memory (`offload_boundary_states`, `trl_longstraw/offload.py`).

On the tiny qwen3_5 (Gated DeltaNet layers around a gated-attention layer): the prefill moves every superseded
boundary out of the prompt state, the reverse pass brings each back just before it is needed and never holds more
than the one it recomputes from and the one prefetched, and the gradients are bit for bit those of the state kept on
the device. The 2-process sharded case is in tests/test_distributed.py (`offload_sharded_exact`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tests.helpers import make_trainer, run_steps
from trl_longstraw import LongStrawGRPOConfig
from trl_longstraw.adapters import get_adapter
from trl_longstraw.engine import Engine, PromptGroup
from trl_longstraw.offload import HostBoundaries
from trl_longstraw.qwen3_5 import Qwen3_5Adapter
from trl_longstraw.testing import build_tokenizer, random_micro_batch

VOCAB = len(build_tokenizer())


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("qwen3_5")


@pytest.fixture(scope="module")
def fused_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def _linear_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


def test_prefill_moves_superseded_boundaries_to_host(fused_model):
    """A 22-token prefix in chunks of 5: the device state keeps only the final DeltaNet record of each layer, the host
    the other 4 boundaries (their bytes: 4 fixed states), equal to the ones a device-kept prefill computes."""
    group = PromptGroup(tokens=torch.arange(3, 26), pad=2, rows=[0])
    kept = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=5).prefill(group, boundaries=True)
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=5, offload_boundaries=True)
    state = engine.prefill(group, boundaries=True)
    linear = _linear_layers(fused_model)
    for layer in linear:
        assert [r is not None for r in state.records[layer]] == [False] * 4 + [True]
    assert sorted(state.host.held) == [0, 1, 2, 3]
    _, fixed = Qwen3_5Adapter.state_bytes(fused_model.config, dtype_bytes=4)
    assert state.host.nbytes() == 4 * fixed
    for chunk, layers in state.host.held.items():
        assert sorted(layers) == linear
        for layer, record in layers.items():
            assert all(torch.equal(a, b) for a, b in zip(record, kept.records[layer][chunk], strict=True))
    # Detached (no boundaries): nothing to offload.
    assert engine.prefill(group, boundaries=False).host is None


def test_restore_installs_leaves_that_require_grad():
    """`restore` puts the copies back as leaves that require grad, bit-exact, and leaves nothing behind."""
    host = HostBoundaries(torch.device("cpu"))
    record = (torch.randn(1, 6, 3).bfloat16(), torch.randn(1, 2, 4, 4))
    records = {3: [record, (torch.zeros(1),)]}
    host.stash(records, {3}, 0)
    assert records[3][0] is None and host.nbytes() == 6 * 3 * 2 + 2 * 4 * 4 * 4
    host.restore(records, 0)
    for got, want in zip(records[3][0], record, strict=True):
        assert got.is_leaf and got.requires_grad and got.dtype == want.dtype and torch.equal(got, want)
    assert not host.held and not host._fetched
    host.restore(records, 1)  # nothing held for chunk 1: unchanged
    assert records[3][1][0].shape == (1,)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_offloaded_boundaries_give_identical_gradients(path, checkpointing, monkeypatch):
    """training_step in exact mode with the boundaries offloaded: the loss and every gradient bit for bit those of the
    device-kept state (prompts of 1 to 4 chunks of 5), and the reverse pass holds at most two boundaries at once."""
    mb = random_micro_batch([17, 7, 1, 2], [9, 1, 5, 3, 4, 2], [0, 1, 0, 2, 1, 3], VOCAB, seed=3)
    settings = dict(prompt_gradient="exact", prefill_chunk_size=5, prefill_progress=False)
    settings.update(gradient_checkpointing=checkpointing, beta=0.0)
    ref_losses, ref_grads = run_steps(make_trainer(path, **settings), [mb])
    fetched: list[int] = []
    restore = HostBoundaries.restore

    def watch(self, records, chunk):
        fetched.append(len(self._fetched))
        restore(self, records, chunk)

    monkeypatch.setattr(HostBoundaries, "restore", watch)
    losses, grads = run_steps(make_trainer(path, offload_boundary_states=True, **settings), [mb])
    assert fetched and max(fetched) <= 1  # restored: the one prefetched a chunk earlier
    assert losses == ref_losses
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_offload_needs_exact_mode():
    with pytest.raises(ValueError, match="offload_boundary_states=False"):
        LongStrawGRPOConfig(
            output_dir="unused", use_cpu=True, bf16=False, prompt_gradient="detached", offload_boundary_states=True
        )
