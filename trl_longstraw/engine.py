"""The prompt-once engine: chunked no-grad prefill, per-branch replay, and the exact-mode reverse pass.

A micro-batch holds rows `prompt + completion`. Rows whose prompts are identical (same tokens and same left padding)
share one *prompt state*: for each layer, one *record* per prefill chunk, holding what later tokens need from that
chunk (keys and values for attention layers; the adapters define other records). A *pass* tells the patched layers
which records they may read and where new records go:

- prefill: chunk `c` reads records `[0, c)` and appends its own, without autograd;
- replay: a branch reads every record and writes none, so branches never see each other;
- reverse (exact mode): chunk `c` is recomputed with autograd reading records `[0, c)` as leaves; its own records
  are captured with their graph and back-propagated with the gradient accumulated on them, which in turn
  accumulates gradient on records `[0, c)`.

Positions follow stock `GRPOTrainer`: a row padded on the left by `pad` tokens places its first real prompt token at
position `pad`, exactly as the padded full-sequence forward does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


@dataclass
class PromptState:
    """Per-layer records of one prompt, one record (a tuple of tensors) per prefill chunk.

    `records[layer][c]` is `None` once chunk `c` has been consumed by the reverse pass, or once a later record of a
    recurrent layer superseded it (see `Pass.emit`) and the state does not keep `boundaries`.
    """

    records: dict[int, list[tuple[torch.Tensor, ...] | None]] = field(default_factory=dict)
    num_chunks: int = 0
    # Keep superseded records too: the exact-mode reverse pass starts chunk `c` from the recurrent state at its start.
    boundaries: bool = False

    def tensors(self) -> Iterator[torch.Tensor]:
        for chunks in self.records.values():
            for record in chunks:
                if record is not None:
                    yield from record

    def nbytes(self) -> int:
        """Bytes held by the records (not counting gradients)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def requires_grad_(self) -> None:
        """Makes every record a leaf that accumulates the gradient of the branches (exact mode)."""
        for t in self.tensors():
            t.requires_grad_(True)


class Pass:
    """What the patched layers may read and where their new records go, for one forward."""

    def __init__(self, state: PromptState, visible: int, append: bool = False):
        self.state = state
        self.visible = visible
        self.append = append
        # Reverse pass: layer -> records computed with autograd. Set to None after the forward, so that a gradient
        # checkpointing recompute during backward does not capture again.
        self.sink: dict[int, tuple[torch.Tensor, ...]] | None = None

    def read(self, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        """The records of chunks `[0, visible)` of this layer."""
        return self.state.records.get(layer_idx, [])[: self.visible]

    def emit(self, layer_idx: int, record: tuple[torch.Tensor, ...], supersedes: bool = False) -> None:
        """Receives the record of the current chunk from layer `layer_idx`.

        A record that `supersedes` the earlier ones of its layer (a recurrent state, which already sums up all of
        them) lets the prefill drop those, unless the state keeps its chunk `boundaries`.
        """
        if self.append:
            records = self.state.records.setdefault(layer_idx, [])
            if supersedes and not self.state.boundaries:
                records[:] = [None] * len(records)
            records.append(tuple(t.detach() for t in record))
        elif self.sink is not None:
            self.sink[layer_idx] = record


_ACTIVE: list[Pass] = []


def active_pass() -> Pass:
    """The pass of the forward in progress. Raises if a patched layer runs outside the engine."""
    if not _ACTIVE:
        raise RuntimeError("a trl_longstraw layer ran outside of an engine pass")
    return _ACTIVE[-1]


@contextlib.contextmanager
def use_pass(p: Pass):
    _ACTIVE.append(p)
    try:
        yield p
    finally:
        _ACTIVE.pop()


@dataclass
class PromptGroup:
    """Rows of a micro-batch that share one prompt.

    Attributes:
        tokens: `[L]` the prompt without padding.
        pad: left padding of these rows, i.e. the position of `tokens[0]`.
        rows: indices of the rows in the micro-batch.
    """

    tokens: torch.Tensor
    pad: int
    rows: list[int]


def group_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[PromptGroup]:
    """Groups the rows of `prompt_ids` `[B, P]` by prompt content. Rows need not be adjacent.

    Raises:
        ValueError: if a row's mask is not left padding (zeros, then ones), or a row has no prompt token.
    """
    groups: dict[tuple[int, bytes], PromptGroup] = {}
    mask = prompt_mask.bool()
    for row in range(prompt_ids.shape[0]):
        length = int(mask[row].sum())
        pad = prompt_ids.shape[1] - length
        if length == 0:
            raise ValueError(f"row {row} has an empty prompt: every prompt needs at least one token")
        if not bool(mask[row, pad:].all()):
            raise ValueError(
                f"row {row} has prompt_mask {prompt_mask[row].tolist()}: prompts must be left-padded (zeros, then "
                "ones). Tokenize with padding_side='left'."
            )
        tokens = prompt_ids[row, pad:]
        key = (pad, tokens.cpu().numpy().tobytes())
        if key not in groups:
            groups[key] = PromptGroup(tokens=tokens, pad=pad, rows=[])
        groups[key].rows.append(row)
    return list(groups.values())


def completion_lengths(completion_mask: torch.Tensor) -> list[int]:
    """Number of scored tokens of each row of `completion_mask` `[B, C]`, which must be ones then zeros."""
    lengths = []
    for row in range(completion_mask.shape[0]):
        n = int(completion_mask[row].sum())
        if not bool(completion_mask[row, :n].bool().all()):
            raise ValueError(
                f"row {row} has completion_mask {completion_mask[row].tolist()}: completions must be right-padded "
                "(ones, then zeros)."
            )
        lengths.append(n)
    return lengths


@dataclass
class StepStats:
    """Timings and sizes of the engine work since the last reset, for logging."""

    prompt_positions: int = 0
    prefill_s: float = 0.0
    replay_s: float = 0.0
    reverse_s: float = 0.0
    state_bytes: int = 0

    def reset(self) -> None:
        self.prompt_positions, self.prefill_s, self.replay_s, self.reverse_s, self.state_bytes = 0, 0.0, 0.0, 0.0, 0


class Engine:
    """Runs prompt-once scoring and branch-replay backward for one model.

    Args:
        model: what is called for a branch: the (possibly wrapped) causal LM with TRL's fused LM head.
        causal_lm: the unwrapped `PreTrainedModel` under `model` (PEFT layers in place, if any).
        adapter: the architecture adapter of `causal_lm`.
        chunk_size: prompt tokens per prefill (and reverse) chunk.
        progress: show a progress bar over prefill chunks for prompts of several chunks.
    """

    def __init__(self, model, causal_lm, adapter, chunk_size: int, progress: bool = False):
        self.model = model
        self.causal_lm = causal_lm
        self.adapter = adapter
        self.chunk_size = chunk_size
        self.progress = progress
        self.stats = StepStats()
        # The state of the last prompt prefilled, reused when the next request is for the same prompt
        # (scoring pass, then backward pass of the same micro-batch).
        self._kept: tuple[tuple[int, bytes], PromptState] | None = None

    # ----------------------------------------------------------------------------------------------------- prompt
    def _backbone(self):
        return self.causal_lm.base_model

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]

    def _positions(self, start: int, n: int, device) -> torch.Tensor:
        return torch.arange(start, start + n, device=device)[None]

    def prefill(self, group: PromptGroup, keep: bool = False, boundaries: bool = False) -> PromptState:
        """Runs `tokens[:-1]` of the group without autograd, chunk by chunk, and returns its state.

        With `keep`, the state stays referenced until the next prefill, which reuses it for the same prompt. With
        `boundaries`, recurrent layers keep their state at every chunk boundary, as the exact-mode reverse pass needs.
        """
        key = (group.pad, group.tokens.cpu().numpy().tobytes())
        if self._kept is not None and self._kept[0] == key and (self._kept[1].boundaries or not boundaries):
            return self._kept[1]
        self._kept = None
        t0 = time.perf_counter()
        prefix = group.tokens[:-1]
        state = PromptState(boundaries=boundaries)
        chunks = self._chunks(prefix.shape[0])
        bar = tqdm(total=prefix.shape[0], desc="prefill", unit="tok", disable=not self.progress or len(chunks) < 2)
        with self.adapter.activate(), torch.no_grad():
            for start, end in chunks:
                with use_pass(Pass(state, visible=state.num_chunks, append=True)):
                    self._backbone()(
                        input_ids=prefix[None, start:end],
                        position_ids=self._positions(group.pad + start, end - start, prefix.device),
                        use_cache=False,
                    )
                state.num_chunks += 1
                bar.update(end - start)
        bar.close()
        self.stats.prompt_positions += prefix.shape[0]
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.state_bytes = max(self.stats.state_bytes, state.nbytes())
        if keep:
            self._kept = (key, state)
        return state

    def reverse(self, group: PromptGroup, state: PromptState) -> None:
        """Exact mode: back-propagates the gradient accumulated on the records through the prompt, last chunk first.

        Each chunk is recomputed with autograd; its records are freed once consumed, so the state shrinks as the pass
        goes. Afterwards the state is spent and is not kept.
        """
        t0 = time.perf_counter()
        self._kept = None
        prefix = group.tokens[:-1]
        chunks = self._chunks(prefix.shape[0])
        with self.adapter.activate():
            for c in reversed(range(len(chunks))):
                start, end = chunks[c]
                own = {layer: records[c] for layer, records in state.records.items()}
                if any(record is None for record in own.values()):
                    raise RuntimeError("the exact-mode reverse pass needs a state prefilled with boundaries=True")
                if any(t.grad is not None for record in own.values() for t in record):
                    p = Pass(state, visible=c)
                    p.sink = {}
                    with use_pass(p), torch.enable_grad():
                        self._backbone()(
                            input_ids=prefix[None, start:end],
                            position_ids=self._positions(group.pad + start, end - start, prefix.device),
                            use_cache=False,
                        )
                        captured, p.sink = p.sink, None
                        outputs, grads = [], []
                        for layer, record in own.items():
                            for recomputed, kept in zip(captured[layer], record, strict=True):
                                if kept.grad is not None:
                                    outputs.append(recomputed)
                                    grads.append(kept.grad)
                        torch.autograd.backward(outputs, grads)
                for records in state.records.values():
                    records[c] = None
        self.stats.reverse_s += time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------------- branches
    def _branch(self, group: PromptGroup, completion: torch.Tensor, n: int):
        """Inputs of one branch: the last prompt token then `completion[:n-1]`; labels `completion[:n]`."""
        ids = torch.cat([group.tokens[-1:], completion[: n - 1]])
        positions = self._positions(group.pad + group.tokens.shape[0] - 1, n, ids.device)
        return ids[None], positions, completion[None, :n]

    def _forward_branch(self, state: PromptState, ids, positions, labels):
        out = self.model(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True)
        return out.log_probs[0], None if out.entropy is None else out.entropy[0]

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        keep_last: bool = False,
        boundaries: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs and entropies `[B, C]` of the completions, without autograd.

        Zero where `completion_mask` is zero, as TRL's fused LM head returns them. Entropies are `None` when the
        model's fused head does not compute them. With `keep_last`, the last prompt state stays for `backward`;
        pass `boundaries=True` when that backward is exact, so that the state can be reused.
        """
        lengths = completion_lengths(completion_mask)
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        entropies = torch.zeros_like(logps)
        has_entropy = True
        for group in group_prompts(prompt_ids, prompt_mask):
            state = self.prefill(group, keep=keep_last, boundaries=boundaries)
            t0 = time.perf_counter()
            with self.adapter.activate(), torch.no_grad(), use_pass(Pass(state, visible=state.num_chunks)):
                for row in group.rows:
                    n = lengths[row]
                    if n == 0:
                        continue
                    lp, ent = self._forward_branch(state, *self._branch(group, completion_ids[row], n))
                    logps[row, :n] = lp
                    if ent is None:
                        has_entropy = False
                    else:
                        entropies[row, :n] = ent
            self.stats.replay_s += time.perf_counter() - t0
        return logps, entropies if has_entropy else None

    def backward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        grad_logps: torch.Tensor,
        grad_entropies: torch.Tensor | None,
        exact: bool,
        backward_fn: Callable[[torch.Tensor], None],
    ) -> None:
        """Accumulates into the parameters' `.grad` the gradient of a loss whose derivatives with respect to the
        per-token log-probs and entropies `[B, C]` are `grad_logps` and `grad_entropies`.

        Each branch is replayed with autograd and back-propagated on its own (`backward_fn` on the scalar
        `sum(logps * grad_logps) + sum(entropies * grad_entropies)`), then freed. In exact mode, the gradient that
        the branches leave on the prompt state is then carried through the prompt by `reverse`.
        """
        lengths = completion_lengths(completion_mask)
        groups = group_prompts(prompt_ids, prompt_mask)
        # Start with the prompt whose state the scoring pass left behind.
        if self._kept is not None:
            groups.sort(key=lambda g: (g.pad, g.tokens.cpu().numpy().tobytes()) != self._kept[0])
        for group in groups:
            rows = [r for r in group.rows if lengths[r] > 0]
            live = [r for r in rows if grad_logps[r].any() or (grad_entropies is not None and grad_entropies[r].any())]
            if not live:
                continue
            state = self.prefill(group, keep=True, boundaries=exact)
            if exact:
                state.requires_grad_()
            t0 = time.perf_counter()
            with self.adapter.activate(), use_pass(Pass(state, visible=state.num_chunks)):
                for row in live:
                    n = lengths[row]
                    lp, ent = self._forward_branch(state, *self._branch(group, completion_ids[row], n))
                    surrogate = (lp * grad_logps[row, :n].to(lp.dtype)).sum()
                    if grad_entropies is not None:
                        surrogate = surrogate + (ent * grad_entropies[row, :n].to(ent.dtype)).sum()
                    backward_fn(surrogate)
            self.stats.replay_s += time.perf_counter() - t0
            if exact:
                self.reverse(group, state)
        self._kept = None
