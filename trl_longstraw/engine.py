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

The prompt passes (prefill and reverse) never read the last decoder layer's outputs: later tokens read its records,
and the last prompt position's logit comes from the branches. So that layer's MLP and the final norm are skipped, and
its token mixer emits its records without computing its output (`Engine._records_only`, `Pass.outputs_unread`),
sharded or not: under `shard_prompt_state` every rank of the group skips the last layer's attention and its
collectives together. The reverse pass keeps no graph for what was skipped.

Positions follow stock `GRPOTrainer`: a row padded on the left by `pad` tokens places its first real prompt token at
position `pad`, exactly as the padded full-sequence forward does.

Precision follows stock too: every forward of the engine (prefill, scoring, replays, the reverse pass's recompute,
and the shared-prompt decoder of `generation`) runs under one autocast, the one accelerate wraps around stock's
forward (`Engine.autocast`), so the records hold the autocast dtype and the state a generation-time prefill computes
is the one the loss pass computes. Backward calls run outside it, as stock's `accelerator.backward` does.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers.utils import logging

from .context_parallel import CPRound, plan_rounds
from .distributed import agree_pass_counts, branch_model, finish_ddp, fsdp2_gathered, fsdp2_root
from .offload import HostBoundaries
from .rope import RotaryPin

logger = logging.get_logger(__name__)


@dataclass
class PromptState:
    """Per-layer records of one prompt, one record (a tuple of tensors) per prefill chunk.

    `records[layer][c]` is `None` once chunk `c` has been consumed by the reverse pass, once a later record of a
    recurrent layer superseded it (see `Pass.emit`) and the state does not keep `boundaries`, or when the prompt state
    is sharded (`shard_prompt_state`) and another rank holds that chunk. A sharded state with `boundaries` keeps a
    recurrent layer's records on the owners of their chunks, plus the last one on every rank; the reverse pass
    broadcasts each boundary to every rank when it needs it (`sharding.PromptShards.broadcast_boundary`). With
    `host` (`offload_boundary_states`), superseded boundaries wait in host memory instead (`None` here) until the
    reverse pass brings them back.
    """

    records: dict[int, list[tuple[torch.Tensor, ...] | None]] = field(default_factory=dict)
    num_chunks: int = 0
    # Prompt tokens of each chunk, so that a layer can number the prompt positions even of records it does not hold.
    chunk_lengths: list[int] = field(default_factory=list)
    # Keep superseded records too: the exact-mode reverse pass starts chunk `c` from the recurrent state at its start.
    boundaries: bool = False
    # Layers whose records supersede the earlier ones (recurrent states), filled by the prefill.
    recurrent: set[int] = field(default_factory=set)
    # Exact mode with `offload_boundary_states`: the superseded boundaries, in host memory.
    host: HostBoundaries | None = None
    # Exact mode with `prefill_attention_reuse`: chunk -> layer -> what the prefill's fused attention of that chunk
    # returned (`attention.prefix_merge_attention`'s `reuse`: output `[1, Hq, n, Dv]`, fp32 log-sum-exp `[1, Hq, n]`,
    # kernel extras), taken by the reverse pass's forward of the chunk instead of attending again.
    attention: dict[int, dict[int, dict]] = field(default_factory=dict)

    def tensors(self) -> Iterator[torch.Tensor]:
        """The records' tensors (the ones that receive gradient in exact mode)."""
        for chunks in self.records.values():
            for record in chunks:
                if record is not None:
                    yield from record

    def kept_attention_bytes(self) -> int:
        """Bytes of the attention outputs and log-sum-exps kept for the reverse pass (`attention`)."""
        return sum(
            t.numel() * t.element_size()
            for layers in self.attention.values()
            for kept in layers.values()
            for t in (kept["out"], kept["lse"])
        )

    def nbytes(self) -> int:
        """Bytes held by the records and the kept attention outputs (not counting gradients)."""
        return sum(t.numel() * t.element_size() for t in self.tensors()) + self.kept_attention_bytes()

    def requires_grad_(self) -> None:
        """Makes every record a leaf that accumulates the gradient of the branches (exact mode)."""
        for t in self.tensors():
            t.requires_grad_(True)


class Pass:
    """What the patched layers may read and where their new records go, for one forward."""

    def __init__(self, state: PromptState, visible: int, append: bool = False, shard=None, cp=None):
        self.state = state
        self.visible = visible
        self.append = append
        # `context_parallel.CPRound` in a context-parallel round of a sharded state: this rank runs chunk `cp.chunk`
        # (`visible == cp.first`), and the reverse pass's `sink` maps each layer to `{chunk: record}`.
        self.cp = cp
        # `sharding.PromptShards` when the prompt state is sharded across ranks: attention over the prompt is then
        # collective (`sharding.sharded_prefix_attention`) and `read` returns None for chunks held elsewhere.
        self.shard = shard
        # Reverse pass: layer -> records computed with autograd. Set to None after the forward, so that a gradient
        # checkpointing recompute during backward does not capture again.
        self.sink: dict[int, tuple[torch.Tensor, ...]] | None = None
        # A forward with autograd under gradient checkpointing (the reverse pass's chunks, the loss pass's branches):
        # layer -> what its attention keeps for the checkpoint's recompute (`attention.prefix_merge_attention`'s
        # `reuse`); None elsewhere. `filling` is True during the forward, False during the backward's recompute.
        self.reuse: dict[int, dict] | None = None
        self.filling = False
        # `prefill_attention_reuse` (exact mode, one process): in the prefill, layer -> the slot its attention fills
        # (`PromptState.attention`); in a reverse chunk's forward, layer -> what the prefill's attention of that
        # chunk returned, taken once instead of attending again. None elsewhere.
        self.carried: dict[int, dict] | None = None
        # A prompt pass (prefill, reverse chunk, or their lockstep fillers): the index of the last decoder layer, whose
        # outputs nothing reads (later tokens read only its records, and the last prompt position's logit comes from
        # the branches). Its token mixer may then compute its records alone and return zeros (`Engine._records_only`
        # skips its MLP and the final norm). None elsewhere.
        self.records_only: int | None = None

    def outputs_unread(self, layer_idx: int) -> bool:
        """Whether the token mixer of `layer_idx` may emit its record and return zeros instead of its output: the last
        layer in a prompt pass (`records_only`).

        Sharded too (`shard_prompt_state`, replicated chunks and context-parallel rounds): the record is what the
        collective path emits (`Pass.emit(..., sharded=True)` keeps it on its chunk's owner; a round stores each
        rank's own chunk), and every rank of the group skips the same layer of the same pass, so the attention's
        collectives are dropped on all of them together. Collectives that the records themselves need (Gated
        DeltaNet's round, `qwen3_5._round_core`) still run."""
        return self.records_only == layer_idx

    def attention_reuse(self, layer_idx: int) -> dict | None:
        """The `reuse` slot of this layer's prompt attention (`attention.prefix_merge_attention`).

        Prefill with `carried`: an empty slot that the attention fills and the state keeps for the reverse pass.
        Reverse pass: the output the prefill kept for this chunk, if any, for its forward (the same inputs give the
        same output: the prefill ran the same chunk from the same records); under gradient checkpointing it also
        fills the slot that the checkpoint's recompute takes. Otherwise, under gradient checkpointing, a slot filled
        by the forward (while `filling`) and emptied by the recompute during the backward.
        """
        if self.carried is not None and self.append:
            return self.carried.setdefault(layer_idx, {})
        kept = self.carried.pop(layer_idx, None) if self.carried is not None else None
        if self.reuse is None:
            return dict(kept) if kept else None
        slot = self.reuse.setdefault(layer_idx, {})
        if self.filling:  # the forward fills an empty slot
            if kept:
                slot.update(kept)
                return dict(kept)
            return None if slot else slot
        return slot or None  # the recompute takes a filled one

    @contextlib.contextmanager
    def keeping_attention(self, on: bool):
        """A forward with autograd and its backward, under gradient checkpointing (`on`): each attention layer keeps
        its output for the checkpoint's recompute (`attention_reuse`). The forward runs while `filling`; the caller
        clears it before the backward. Whatever the recompute did not take is dropped on exit. Nothing when not `on`.
        """
        if not on:
            yield
            return
        self.reuse, self.filling = {}, True
        try:
            yield
        finally:
            self.reuse, self.filling = None, False

    def read(self, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        """The records of chunks `[0, visible)` of this layer."""
        return self.state.records.get(layer_idx, [])[: self.visible]

    def chunk_starts(self) -> list[int]:
        """The first prompt position (counted from the first real prompt token) of each visible chunk, then the
        number of visible positions: `visible + 1` values."""
        starts = [0]
        for n in self.state.chunk_lengths[: self.visible]:
            starts.append(starts[-1] + n)
        return starts

    def emit(
        self, layer_idx: int, record: tuple[torch.Tensor, ...], sharded: bool = False, supersedes: bool = False
    ) -> None:
        """Receives the record of the current chunk from layer `layer_idx`.

        A `sharded` record is kept only by the rank that owns the chunk when the state is sharded; other records are
        replicated on every rank (see `sharding`). A record that `supersedes` the earlier ones of its layer (a
        recurrent state, which already sums up all of them) lets the prefill drop those, unless the state keeps its
        chunk `boundaries`; a sharded state with boundaries keeps the previous record only on the owner of its
        chunk. Such records must have the same shapes and dtypes in every chunk: the reverse pass broadcasts a
        boundary into buffers shaped like the next one.

        Raises:
            ValueError: on every rank, when a superseding record of a sharded state with boundaries changes shapes or
                dtypes from one chunk to the next.
        """
        if self.cp is not None:
            if supersedes or not sharded:
                raise RuntimeError(
                    f"layer {layer_idx}: a context-parallel round takes sharded records from `emit` and superseding "
                    "ones from `emit_round`"
                )
            if self.append:
                records = self.state.records.setdefault(layer_idx, [])
                for chunk in self.cp.chunks:
                    records.append(tuple(t.detach() for t in record) if chunk == self.cp.chunk else None)
            elif self.sink is not None:
                self.sink[layer_idx] = {self.cp.chunk: record}
            return
        if self.append:
            records = self.state.records.setdefault(layer_idx, [])
            if supersedes:
                self.state.recurrent.add(layer_idx)
                if not self.state.boundaries:
                    records[:] = [None] * len(records)
                elif self.shard is not None and records:
                    self._drop_unowned_boundary(layer_idx, records, record)
            held = not (sharded and self.shard is not None and self.shard.owner(len(records)) != self.shard.rank)
            records.append(tuple(t.detach() for t in record) if held else None)
        elif self.sink is not None:
            self.sink[layer_idx] = record

    def emit_round(self, layer_idx: int, records: list[tuple[torch.Tensor, ...]]) -> None:
        """Receives, in a context-parallel round, the superseding records of every chunk of the round from layer
        `layer_idx` (a recurrent layer, which computes them for all the round's chunks on every rank), in chunk order.

        Each is taken as `emit(layer_idx, record, supersedes=True)` takes the record of a chunk in a replicated pass.
        """
        if self.append:
            cp, self.cp = self.cp, None
            try:
                for record in records:
                    self.emit(layer_idx, record, supersedes=True)
            finally:
                self.cp = cp
        elif self.sink is not None:
            self.sink[layer_idx] = dict(zip(self.cp.chunks, records, strict=True))

    def _drop_unowned_boundary(
        self, layer_idx: int, records: list[tuple[torch.Tensor, ...] | None], record: tuple[torch.Tensor, ...]
    ) -> None:
        """Sharded prefill with boundaries: `record` supersedes `records[-1]`, which only its chunk's owner keeps.

        Every rank computes every chunk, so the newest record is on every rank (the next chunk, and the branches
        after the last one, start from it) and the same checks run everywhere.
        """
        chunk = len(records) - 1
        before, now = ([(tuple(t.shape), t.dtype) for t in r] for r in (records[chunk], record))
        if before != now:
            raise ValueError(
                f"layer {layer_idx} emitted a superseding record of shapes and dtypes {now} after {before}: a sharded "
                "prompt state with boundaries (exact mode) needs the same ones in every chunk"
            )
        if self.shard.owner(chunk) != self.shard.rank:
            records[chunk] = None


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


def pack_rows(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Splits `rows` into batches whose padded size `len(batch) * max(lengths)` is at most `budget` tokens.

    Rows are taken longest first, so each batch pads little; a row longer than `budget` forms a batch of its own.
    """
    batches: list[list[int]] = []
    for row in sorted(rows, key=lambda r: -lengths[r]):
        # The first row of a batch is its longest, so the padded size is (rows + 1) * that length.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


# Kinds of engine passes, in the order a prompt runs them: FSDP2 issues the same collectives for every pass of a kind.
PREFILL, BRANCH, REVERSE = range(3)


@dataclass
class Slot:
    """One prompt of an engine call, in the order of `Engine._schedule`.

    Attributes:
        group: the prompt; None on a rank that has no prompt left in the world lockstep (fillers only).
        rows: its branch rows; `None` is a zero-weight filler branch (sharded lockstep, one branch per round).
        passes: world lockstep only (`Engine.lockstep`): how many passes of each kind (`PREFILL`, `BRANCH`,
            `REVERSE`) every rank runs for this slot, its own (a sharded group's branch rounds included) first, then
            fillers (`Engine._pad`).
    """

    group: PromptGroup | None
    rows: Iterable[int | None]
    passes: tuple[int, int, int] | None = None


@dataclass
class StepStats:
    """Timings and sizes of the engine work since the last reset, for logging."""

    prompt_positions: int = 0
    # Positions of held states taken instead of prefilling (generation's offers).
    reused_positions: int = 0
    prefill_s: float = 0.0
    replay_s: float = 0.0
    reverse_s: float = 0.0
    state_bytes: int = 0

    def reset(self) -> None:
        self.prompt_positions, self.prefill_s, self.replay_s, self.reverse_s, self.state_bytes = 0, 0.0, 0.0, 0.0, 0
        self.reused_positions = 0


class Engine:
    """Runs prompt-once scoring and branch-replay backward for one model.

    Args:
        model: what is called for a branch: the (possibly wrapped) causal LM with TRL's fused LM head. Under DDP
            the module inside the wrapper is called instead. Under FSDP2 every rank of the world runs the same
            passes (the sharded state's lockstep within a shard group, and across groups or without a sharded state
            the world's: see `lockstep`), so FSDP2 gathers and frees the layers pass by pass (see `distributed`).
        causal_lm: the unwrapped `PreTrainedModel` under `model` (PEFT layers in place, if any).
        adapter: the architecture adapter of `causal_lm`.
        chunk_size: prompt tokens per prefill (and reverse) chunk.
        progress: show a progress bar over the prefill chunks, one over the loss pass's branches and one over the
            exact-mode reverse pass's, for prompts of several chunks (at a million tokens each pass takes minutes);
            generation adds one over each such prompt's decoding steps (`generation.shared_prompt_decoder`).
        shards: a `sharding.PromptShards` to shard the prompt state across its ranks, which then run in lockstep.
        autocast: a factory of the context manager every forward runs in: the autocast of stock's forward under
            mixed precision (entered per forward, so its weight-cast cache lives as long as stock's does), else
            `contextlib.nullcontext`.
        offload_boundaries: keep the exact-mode recurrent chunk boundaries in host memory between the prefill and
            the reverse pass (`offload.HostBoundaries`).
        checkpoint_reverse: under gradient checkpointing, let the reverse pass recompute each layer of a chunk in its
            backward (True), or turn checkpointing off for the reverse pass's chunks, which then keep their whole
            graph and skip that recompute (`LongStrawGRPOConfig.reverse_checkpointing`).
        attention_reuse: under gradient checkpointing, the reverse pass's recompute takes each attention layer's
            output kept by its forward instead of attending again (`Pass.attention_reuse`; same gradients, one
            attention output per layer and chunk token of memory).
        prefill_attention: exact mode, unsharded: the prefill keeps each attention layer's output and log-sum-exp
            (`PromptState.attention`) and the reverse pass's forward of each chunk takes them instead of attending
            again (same gradients; one attention output per layer and prompt token of memory until the reverse pass
            reaches the chunk).
    """

    def __init__(
        self,
        model,
        causal_lm,
        adapter,
        chunk_size: int,
        progress: bool = False,
        shards=None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        offload_boundaries: bool = False,
        checkpoint_reverse: bool = True,
        attention_reuse: bool = True,
        prefill_attention: bool = False,
    ):
        if prefill_attention and shards is not None:
            raise ValueError("prefill_attention applies to an unsharded prompt state: shards must be None")
        self.model = model
        self.prefill_attention = prefill_attention
        self.checkpoint_reverse = checkpoint_reverse
        self.offload_boundaries = offload_boundaries
        self.attention_reuse = attention_reuse
        self.autocast = autocast
        self.causal_lm = causal_lm
        self.adapter = adapter
        self.chunk_size = chunk_size
        self.progress = progress
        self.shards = shards
        # FSDP2 gathers and frees the parameters pass by pass (`distributed.fsdp2_gathered`), so every rank of the
        # world must run the same passes. A prompt state sharded over every process runs them in lockstep; otherwise
        # (data parallelism, or shard groups smaller than the world, each group in its own lockstep) the ranks agree
        # on the number of passes of each kind per prompt slot and pad theirs with fillers (`lockstep`), which never
        # touch the sharded attention, so the groups' collectives stay inside each group.
        self.fsdp = fsdp2_root(model) is not None
        self.lockstep = self.fsdp and (shards is None or shards.world < dist.get_world_size())
        # Context parallelism (`context_parallel`): the ranks of a shard group split each prefill and reverse pass's
        # tokens, for adapters whose token mixers support it at this group size; the others replicate the passes.
        supports = getattr(adapter, "context_parallel", None)
        self.context_parallel = shards is not None and supports is not None and supports(shards.world)
        self.stats = StepStats()
        # Per-call RoPE (dynamic, longrope): each call of `score` and `backward` rotates with the frequencies of
        # stock's one forward over its P + C positions.
        self.rope = RotaryPin(causal_lm)
        # Prompt states held for a later pass over the same prompt with the same weights, oldest first: offered by
        # generation (`offer`) or kept by the scoring pass of a micro-batch for its backward pass. Each is stamped with
        # the weights' version it was computed with (`weights_version`), whether it was offered, and the bytes it
        # counts against `hold_budget`.
        self._held: dict[tuple[int, bytes], tuple[int, PromptState, bool, int]] = {}
        # Bytes that the held states other than the newest may take (None: no limit). The trainer sets it from the
        # memory guard on GPU; the newest state is always held, as the loss pass holds one state anyway.
        self.hold_budget: int | None = None
        self._hold_warned = False

    def release(self) -> None:
        """Drops every held prompt state (kept by a scoring pass, or offered by generation)."""
        self._held.clear()

    def held(self) -> dict[tuple[int, bytes], PromptState]:
        """The held prompt states by prompt key `(pad, token bytes)`, oldest first."""
        return {key: held[1] for key, held in self._held.items()}

    def weights_version(self) -> int:
        """A number that changes whenever a parameter of the model is modified in place (an optimizer step, loading
        weights): the sum of the parameters' autograd version counters."""
        return sum(p._version for p in self.causal_lm.parameters())

    def offer(self, group: PromptGroup, state: PromptState) -> None:
        """Holds `state`, the prefill of `group` with the current weights (generation's), for the loss pass.

        The scoring pass of a micro-batch then takes it instead of prefilling the same prompt again, as long as the
        weights have not changed (`weights_version`) and the state has the chunk boundaries the pass needs.
        """
        self._hold(group, state, offered=True)

    def _hold(self, group: PromptGroup, state: PromptState, offered: bool = False) -> None:
        """Holds `state` under `group`'s key, dropping states of older weights, then the oldest ones beyond
        `hold_budget`.

        Sharded, the ranks of a shard group hold different shares of each state but must keep the same states, as
        they prefill a dropped prompt again together: each state counts the largest share of any rank of the group
        (one all-reduce of one number, which every rank of the group issues here, as they prefill and offer the
        same prompts together), so the ranks drop the same ones.
        """
        key = _key(group)
        version = self.weights_version()
        for old in [k for k, held in self._held.items() if held[0] != version]:
            del self._held[old]
        self._held.pop(key, None)
        size = state.nbytes()
        if self.hold_budget is not None and self.shards is not None:
            size = self.shards.extremes([size], group.tokens.device)[1][0]
        self._held[key] = (version, state, offered, size)
        if self.hold_budget is None:
            return
        while len(self._held) > 1 and sum(held[3] for held in list(self._held.values())[:-1]) > self.hold_budget:
            del self._held[next(iter(self._held))]
            if not self._hold_warned:
                self._hold_warned = True
                logger.warning(
                    "the prompt states of a micro-batch or generation batch do not all fit in the "
                    f"{self.hold_budget / 2**30:.2f} GiB that the memory guard leaves for holding them beside the one "
                    f"in use (the newest takes {size / 2**30:.2f} GiB): some prompts are prefilled again in the loss "
                    "pass (once more per pass than with all states held). Shorter prompts, fewer distinct prompts per "
                    "micro-batch and generation batch, shard_prompt_state or more GPU memory avoid it. Said once per "
                    "run."
                )

    def _take(self, key: tuple[int, bytes], boundaries: bool) -> PromptState | None:
        """The held state of `key` if it was computed with the current weights and has the `boundaries` needed."""
        held = self._held.get(key)
        if held is None or held[0] != self.weights_version() or (boundaries and not held[1].boundaries):
            return None
        return held[1]

    # ----------------------------------------------------------------------------------------------------- prompt
    def _backbone(self):
        return self.causal_lm.base_model

    @contextlib.contextmanager
    def _records_only(self, p: Pass):
        """A prompt pass `p` (prefill, reverse chunk, or their fillers): the last decoder layer's outputs are never
        read (later tokens read its records alone; the branches compute the last prompt position's logit), so for the
        block its post-attention norm, MLP and attention output projection (`self_attn.o_proj`, where it has one)
        return zeros, the backbone's final norm returns its input, and its token mixer may compute its records alone
        (`Pass.outputs_unread`). The prefill then spends nothing on them, and the reverse pass neither recomputes them
        nor keeps their graph, which its backward never consumes (the backbone's output gets no gradient): without the
        projection, a gated attention's gate and gated output are freed at once instead of living through the pass.
        Fillers run the same modules as the passes they pad, so FSDP2 and expert-parallel collectives still match.
        Nothing for a backbone without `layers` and `norm`.
        """
        backbone = self._backbone()
        layers = getattr(backbone, "layers", None)
        last = layers[getattr(backbone.config, "num_hidden_layers", len(layers)) - 1] if layers else None
        parts = [getattr(last, name, None) for name in ("post_attention_layernorm", "mlp")] + [
            getattr(backbone, "norm", None)
        ]
        if not all(isinstance(m, torch.nn.Module) for m in parts):
            yield
            return
        p.records_only = getattr(backbone.config, "num_hidden_layers", len(layers)) - 1

        def zeros(module, hidden_states, *args, **kwargs):
            # A 0-dim zero: the layer's residual add broadcasts it.
            return hidden_states.new_zeros(())

        def identity(module, hidden_states, *args, **kwargs):
            return hidden_states

        replaced = list(zip(parts, (identity, zeros, identity), strict=True))
        projection = getattr(getattr(last, "self_attn", None), "o_proj", None)
        if isinstance(projection, torch.nn.Module):
            replaced.append((projection, zeros))
        with contextlib.ExitStack() as stack:
            for module, forward in replaced:
                stack.enter_context(_forward_replaced(module, forward))
            yield

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]

    def _positions(self, start: int, n: int, device) -> torch.Tensor:
        return torch.arange(start, start + n, device=device)[None]

    def _passes(self, n: int) -> list[list[tuple[int, int]]]:
        """The passes over a prompt prefix of `n` tokens: `[(start, end)]` for a chunk that every rank runs, or one
        `(start, end)` per rank for a context-parallel round (`context_parallel.plan_rounds`)."""
        if self.context_parallel:
            return plan_rounds(n, self.chunk_size, self.shards.world)
        return [[chunk] for chunk in self._chunks(n)]

    def _declare(self, first: int, bounds: list[tuple[int, int]]) -> tuple[int, int, CPRound | None]:
        """Declares the pass over `bounds`, whose first chunk is chunk `first`, to the shards; returns this rank's
        `(start, end)` and the context-parallel round, if any."""
        if len(bounds) == 1:
            if self.shards is not None:
                self.shards.replicated(bounds[0][1] - bounds[0][0])
            return *bounds[0], None
        cp = CPRound(first, [end - start for start, end in bounds], self.shards.rank)
        self.shards.cp_round(cp.lengths)
        return *bounds[cp.rank], cp

    def prefill(
        self, group: PromptGroup, keep: bool = False, reuse: bool = False, boundaries: bool = False
    ) -> PromptState:
        """Runs `tokens[:-1]` of the group without autograd, chunk by chunk, and returns its state.

        With `reuse`, a held state of the same prompt (offered by generation or kept by this micro-batch's scoring
        pass) computed with the current weights is returned instead of prefilling again; only the loss pass and the
        deferred old-policy scoring ask for it, so a reference model's pass (or the PEFT model with adapters
        disabled) never gets the policy's state. With `keep`, the state stays held (see `hold_budget`) until
        `release`, a pass that takes it without `keep`, or a weight change; without `keep`, a reused state is no
        longer held. With `boundaries`, recurrent layers keep their state at every chunk boundary, as the exact-mode
        reverse pass needs.
        """
        key = _key(group)
        if reuse:
            state = self._take(key, boundaries)
            if state is not None:
                version, _, offered, size = self._held.pop(key)
                if offered:
                    self.stats.reused_positions += sum(state.chunk_lengths)
                    self.stats.state_bytes = max(self.stats.state_bytes, state.nbytes())
                if keep:  # held again, as the newest, now kept by this pass
                    self._held[key] = (version, state, False, size)
                return state
        t0 = time.perf_counter()
        prefix = group.tokens[:-1]
        state = PromptState(boundaries=boundaries)
        if boundaries and self.offload_boundaries:
            state.host = HostBoundaries(prefix.device)
        passes = self._passes(prefix.shape[0])
        bar = tqdm(total=prefix.shape[0], desc="prefill", unit="tok", disable=not self.progress or len(passes) < 2)
        with self.adapter.activate(), torch.no_grad():
            for bounds in passes:
                start, end, cp = self._declare(state.num_chunks, bounds)
                p = Pass(state, visible=state.num_chunks, append=True, shard=self.shards, cp=cp)
                if boundaries and self.prefill_attention:
                    p.carried = {}
                with use_pass(p), self._records_only(p), self.autocast():
                    self._backbone()(
                        input_ids=prefix[None, start:end],
                        position_ids=self._positions(group.pad + start, end - start, prefix.device),
                        use_cache=False,
                    )
                # The fused kernels' path fills a layer's slot; the portable one attends again in the reverse pass.
                kept = {layer: slot for layer, slot in (p.carried or {}).items() if slot}
                if kept:
                    state.attention[state.num_chunks] = kept
                for first, last in bounds:
                    state.num_chunks += 1
                    state.chunk_lengths.append(last - first)
                    if state.host is not None and state.num_chunks > 1:
                        # The recurrent records of the previous chunk are now only a boundary for the reverse pass.
                        state.host.stash(state.records, state.recurrent, state.num_chunks - 2)
                bar.update(bounds[-1][1] - bounds[0][0])
        bar.close()
        self.stats.prompt_positions += prefix.shape[0]
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.state_bytes = max(self.stats.state_bytes, state.nbytes())
        if keep:
            self._hold(group, state)
        return state

    def _reusable(self, key: tuple[int, bytes], boundaries: bool) -> bool:
        """Whether `prefill(..., reuse=True)` of the prompt `key` returns a held state instead of prefilling."""
        return self._take(key, boundaries) is not None

    def _agree_held(self, groups: list[PromptGroup], boundaries: bool, device) -> None:
        """Sharded: the ranks of the shard group take the held state of a prompt of `groups` (in the order `agree`
        gave every rank) only if every rank can (`_reusable`), as they prefill it together otherwise; a rank that
        could drops its own (one all-reduce). In practice they hold the same states (generation offered them
        together), so this keeps a disagreement, e.g. a state dropped on one rank only, from hanging the group."""
        if not groups:
            return
        flags = [int(self._reusable(_key(g), boundaries)) for g in groups]
        lowest, _ = self.shards.extremes(flags, device)
        for group, mine, everyone in zip(groups, flags, lowest, strict=True):
            if mine and not everyone:
                self._held.pop(_key(group), None)

    def _num_passes(self, group: PromptGroup) -> int:
        """Prefill (and, sharded or in exact mode, reverse) passes over `group`'s prompt: its chunks, or its
        context-parallel rounds."""
        return len(self._passes(group.tokens.shape[0] - 1))

    def reverse(self, group: PromptGroup, state: PromptState) -> int:
        """Exact mode: back-propagates the gradient accumulated on the records through the prompt, last chunk first.

        Each chunk is recomputed with autograd; its records are freed once consumed, so the state shrinks as the pass
        goes. Afterwards the state is spent and is not kept. Sharded, every rank takes part in every pass (a chunk
        that every rank recomputes, or a context-parallel round in which each recomputes its own chunk) and first
        receives the recurrent records at the pass's start from their owner (one broadcast per pass and dtype).

        Returns the number of passes run: chunks recomputed (chunks whose records received no gradient are skipped,
        unless sharded), context-parallel rounds counting one each.
        """
        t0 = time.perf_counter()
        ran = 0
        self._held.pop(_key(group), None)
        prefix = group.tokens[:-1]
        passes = self._passes(prefix.shape[0])
        firsts = [0]  # the first chunk of each pass
        for bounds in passes[:-1]:
            firsts.append(firsts[-1] + len(bounds))
        if not state.boundaries:
            raise RuntimeError("the exact-mode reverse pass needs a state prefilled with boundaries=True")
        bar = tqdm(total=prefix.shape[0], desc="reverse", unit="tok", disable=not self.progress or len(passes) < 2)
        with self.adapter.activate():
            for i in reversed(range(len(passes))):
                bounds, c = passes[i], firsts[i]
                last = c + len(bounds) - 1
                if state.host is not None and c > 0:
                    # Boundary c - 1 back from host memory (copied while the next pass ran); the next one starts now.
                    state.host.restore(state.records, c - 1)
                    state.host.prefetch(firsts[i - 1] - 1)
                if self.shards is not None and c > 0 and state.recurrent:
                    # The pass starts from the recurrent records of chunk c - 1, which only their owner kept.
                    self.shards.broadcast_boundary(state, c - 1, like=last)
                own = {layer: records[c] for layer, records in state.records.items() if records[c] is not None}
                # The prefill's attention outputs of this chunk (`prefill_attention`), dropped if it is skipped.
                carried = state.attention.pop(c, None)
                # Sharded: every rank runs every pass, as the attention over the prompt is collective.
                if self.shards is not None or any(t.grad is not None for record in own.values() for t in record):
                    ran += 1
                    start, end, cp = self._declare(c, bounds)
                    p = Pass(state, visible=c, shard=self.shards, cp=cp)
                    p.sink = {}
                    p.carried = carried or None
                    checkpointed = (
                        self._backbone().is_activation_checkpointing
                        and self.checkpoint_reverse
                        and self.attention_reuse
                    )
                    # The recompute of each layer takes its attention's output instead of attending again.
                    with (
                        use_pass(p),
                        self._records_only(p),
                        torch.enable_grad(),
                        _checkpointing_off(self._backbone(), not self.checkpoint_reverse),
                        p.keeping_attention(checkpointed),
                    ):
                        with self.autocast():
                            hidden = self._backbone()(
                                input_ids=prefix[None, start:end],
                                position_ids=self._positions(group.pad + start, end - start, prefix.device),
                                use_cache=False,
                            ).last_hidden_state
                        captured, p.sink, p.filling = p.sink, None, False
                        outputs, grads = [], []
                        if self.fsdp:
                            # A zero seed on the output: under per-pass FSDP2 the last layer's parameters are
                            # gathered again for backward by a hook on its output, which the records alone never reach.
                            outputs.append(hidden)
                            grads.append(torch.zeros_like(hidden))
                        for layer, recomputed_records in captured.items():
                            # A context-parallel round captures `{chunk: record}`; a chunk, its own record.
                            for chunk, recomputed_record in (
                                recomputed_records if cp else {c: recomputed_records}
                            ).items():
                                record = state.records[layer][chunk]
                                for j, recomputed in enumerate(recomputed_record):
                                    kept = None if record is None else record[j]
                                    if kept is not None and kept.grad is not None:
                                        outputs.append(recomputed)
                                        grads.append(kept.grad)
                                    elif self.shards is not None and recomputed.requires_grad:
                                        # Zero seeds for records held elsewhere: every rank back-propagates the same
                                        # graph, so the collective backward of the sharded layers meets all ranks.
                                        outputs.append(recomputed)
                                        grads.append(torch.zeros_like(recomputed))
                        if outputs:
                            torch.autograd.backward(outputs, grads)
                for records in state.records.values():
                    records[c : last + 1] = [None] * (last + 1 - c)
                bar.update(bounds[-1][1] - bounds[0][0])
        bar.close()
        self.stats.reverse_s += time.perf_counter() - t0
        return ran

    # ---------------------------------------------------------------------------------------------------- branches
    def _branch(self, group: PromptGroup, completion: torch.Tensor, n: int):
        """Inputs of one branch: the last prompt token then `completion[:n-1]`; labels `completion[:n]`."""
        ids = torch.cat([group.tokens[-1:], completion[: n - 1]])
        positions = self._positions(group.pad + group.tokens.shape[0] - 1, n, ids.device)
        return ids[None], positions, completion[None, :n]

    def _forward_branch(self, ids, positions, labels):
        """Log-probs and entropies `[R, N]` of branches `ids` `[R, N]` against the active pass's prompt state
        (entropies `None` if the fused head has none)."""
        with self.autocast():
            out = branch_model(self.model)(
                input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True
            )
        return out.log_probs, out.entropy

    def _batched_branches(self, group: PromptGroup, completion_ids: torch.Tensor, rows: list[int], lengths: list[int]):
        """Inputs of the branches of `rows` as one batch `[R, N]`, right-padded to the longest; labels -100 there.

        The padding follows each branch's real tokens, so under causal attention it changes none of their values.
        """
        n_max = max(lengths[row] for row in rows)
        ids = group.tokens[-1].repeat(len(rows), n_max)
        labels = torch.full_like(ids, -100)
        for i, row in enumerate(rows):
            n = lengths[row]
            ids[i, 1:n] = completion_ids[row, : n - 1]
            labels[i, :n] = completion_ids[row, :n]
        positions = self._positions(group.pad + group.tokens.shape[0] - 1, n_max, ids.device).expand(len(rows), -1)
        return ids, positions, labels

    def _zero_branch(self, group: PromptGroup | None, backward_fn: Callable[[torch.Tensor], None] | None, device):
        """A one-token branch of weight zero: a lockstep filler for the sharded attention (`group` given: it reads
        that prompt's state), or the FSDP2 sync pass (`group` None: no prompt). Back-propagated with `backward_fn`.
        """
        if group is None:
            ids = positions = torch.zeros(1, 1, dtype=torch.long, device=device)
            labels = ids
        else:
            ids, positions, labels = self._branch(group, group.tokens[-1:], 1)
        lp, ent = self._forward_branch(ids, positions, labels)
        if backward_fn is not None:
            backward_fn(lp.sum() * 0 + (0 if ent is None else ent.sum() * 0))

    def _sync_pass(self, device) -> None:
        self._filler(BRANCH, device, torch.autograd.backward)

    def _filler(self, kind: int, device, backward_fn: Callable[[torch.Tensor], None] | None = None) -> None:
        """One pass of `kind` on a single token against an empty prompt state, with weight zero: it runs the modules
        (and so issues the FSDP2 collectives) of a pass of that kind, and changes no value.

        `PREFILL`: a backbone forward without autograd. `BRANCH`: a one-token branch through the root, back-propagated
        with `backward_fn` if given (the backward pass), else without autograd (scoring). `REVERSE`: a backbone forward
        with autograd, back-propagated from a zero seed on its output, as the reverse pass's chunks are.
        """
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        grad = kind == REVERSE or backward_fn is not None
        p = Pass(PromptState(), visible=0, append=kind == PREFILL)
        with self.adapter.activate(), use_pass(p), torch.set_grad_enabled(grad):
            if kind == BRANCH:
                self._zero_branch(None, backward_fn, device)
                return
            with self._records_only(p), self.autocast():
                hidden = self._backbone()(input_ids=ids, position_ids=ids, use_cache=False).last_hidden_state
            if kind == REVERSE:
                # Inside the pass and the adapter: gradient checkpointing recomputes the layers during backward.
                torch.autograd.backward(hidden, torch.zeros_like(hidden))

    def _pad(self, slot: Slot, kind: int, done: int, device, backward_fn=None) -> None:
        """World lockstep: fillers that bring the `done` passes of `kind` this rank ran for `slot` to the
        agreed count (`Slot.passes`). Nothing otherwise."""
        if slot.passes is None:
            return
        if done > slot.passes[kind]:
            raise RuntimeError(f"ran {done} passes of kind {kind}, more than the {slot.passes[kind]} agreed")
        for _ in range(slot.passes[kind] - done):
            self._filler(kind, device, backward_fn)

    def _schedule(
        self,
        groups: list[PromptGroup],
        rows: list[list[int]],
        lengths: list[int],
        passes: Callable[[PromptGroup, list[int]], tuple[int, int, int]],
        device,
        first: Callable[[PromptGroup], int] | None = None,
        boundaries: bool | None = None,
    ) -> list[Slot]:
        """The prompts to run and, for each, its branch rows.

        Unsharded: `groups` with their `rows`, as given. Sharded: the prompts with rows in the order agreed by the
        group, then sorted by `first` (stable), and rounds in which every rank runs one branch (its own or a
        filler), declared to `shards` round by round.

        World lockstep (FSDP2, unless the state is sharded over every process): the prompts with rows, fewest passes
        first (`passes(group, rows)`: this rank's own counts of a prompt; sharded, the group's branch rounds count as
        its branch passes), so that the ranks' large prompts share slots and fillers stay few, except that unsharded
        a prompt whose state the scoring kept stays first, and sharded `first` still orders first; then empty slots
        up to the largest number of prompts of any rank; each slot with the pass counts agreed by one all-reduce
        over the world (see `Slot`). Every rank of a shard group has the same prompts and counts, so the group stays
        in its own lockstep, and fillers pad it to the other groups' passes.

        `boundaries`, unless None (a call that takes held states: the policy's loss pass), sharded: the ranks agree
        which held states they take (`_agree_held`), with or without the chunk boundaries, before counting passes.
        """
        if self.shards is None:
            if not self.lockstep:
                return [Slot(g, rs) for g, rs in zip(groups, rows, strict=True)]
            work = [(g, rs, passes(g, rs)) for g, rs in zip(groups, rows, strict=True) if rs]
            pinned = int(bool(work) and _key(work[0][0]) in self._held)
            work[pinned:] = sorted(work[pinned:], key=lambda item: sum(item[2]))
        else:
            order, plan = self.shards.agree(groups, [[lengths[r] for r in rs] for rs in rows])
            if boundaries is not None:
                self._agree_held([groups[i] for i in order], boundaries, device)

            def rounds(mine: list[int], everyone: list[list[int]]) -> Iterator[int | None]:
                for i in range(max(len(theirs) for theirs in everyone)):
                    self.shards.branch_round([theirs[i] if i < len(theirs) else 1 for theirs in everyone])
                    yield mine[i] if i < len(mine) else None

            work = []
            for k, i in enumerate(order):
                if any(plan[k]):
                    prefill, _, reverse = passes(groups[i], rows[i])
                    counts = (prefill, max(len(theirs) for theirs in plan[k]), reverse)
                    work.append((groups[i], rounds(rows[i], plan[k]), counts))

            def rank(item) -> tuple[int, int]:
                return (0 if first is None else first(item[0]), sum(item[2]) if self.lockstep else 0)

            work.sort(key=rank)
            if not self.lockstep:
                return [Slot(g, rs) for g, rs, _ in work]
        agreed = agree_pass_counts([counts for _, _, counts in work], len(lengths), device)
        slots = [(g, rs) for g, rs, _ in work]
        slots += [(None, [])] * (len(agreed) - len(slots))
        return [Slot(group, rs, passes=counts) for (group, rs), counts in zip(slots, agreed, strict=True)]

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        keep: bool = False,
        batch_tokens: int = 0,
        boundaries: bool = False,
        reuse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs and entropies `[B, C]` of the completions, without autograd.

        Zero where `completion_mask` is zero, as TRL's fused LM head returns them. Entropies are `None` when the
        model's fused head does not compute them. With `keep`, each prompt's state stays held for `backward` (the
        last one always, earlier ones within `hold_budget`); pass `boundaries=True` when that backward is exact, so
        that the states can be reused. With `reuse`, held states of the current weights (generation's offers) are
        taken instead of prefilling: the policy's passes only.
        With `batch_tokens > 0`, the branches of one prompt run in batches of at most that many (padded) tokens
        against its state, a single longer branch alone (old-policy and reference log-probs), if the adapter
        declares `batches_branches`; with 0, or for other adapters, each branch runs alone, exactly as `backward`
        replays it, so the loss pass sees the same values in both.
        """
        length = prompt_ids.shape[1] + completion_ids.shape[1]
        with fsdp2_gathered(self.model), self.rope.pinned(length):
            prompt, completion = (prompt_ids, prompt_mask), (completion_ids, completion_mask)
            return self._score(*prompt, *completion, keep, reuse, batch_tokens, boundaries)

    def _score(self, prompt_ids, prompt_mask, completion_ids, completion_mask, keep, reuse, batch_tokens, boundaries):
        lengths = completion_lengths(completion_mask)
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        entropies = torch.zeros_like(logps)
        has_entropy = True
        device = prompt_ids.device
        groups = group_prompts(prompt_ids, prompt_mask)
        batched = batch_tokens > 0 and self.shards is None and getattr(self.adapter, "batches_branches", False)

        def passes(group: PromptGroup, rows: list[int]) -> tuple[int, int, int]:
            # A held state may still be dropped by the prefill of an earlier prompt (`hold_budget`): the agreed
            # count assumes a prefill, and a prompt whose held state is taken runs fillers instead (one token each).
            branches = len(pack_rows(rows, lengths, batch_tokens)) if batched else len(rows)
            return self._num_passes(group), branches, 0

        rows = [[r for r in g.rows if lengths[r] > 0] for g in groups]
        takes = boundaries if reuse or keep else None
        for slot in self._schedule(groups, rows, lengths, passes, device, boundaries=takes):
            group = slot.group
            taken = group is not None and (reuse or keep) and self._reusable(_key(group), boundaries)
            if group is None:
                state = PromptState()
            else:
                state = self.prefill(group, keep=keep, reuse=reuse or keep, boundaries=boundaries)
            self._pad(slot, PREFILL, 0 if taken or group is None else self._num_passes(group), device)
            t0 = time.perf_counter()
            p = Pass(state, visible=state.num_chunks, shard=self.shards)
            with self.adapter.activate(), torch.no_grad(), use_pass(p):
                if batched:
                    batches = [
                        (batch, self._batched_branches(group, completion_ids, batch, lengths))
                        for batch in pack_rows(list(slot.rows), lengths, batch_tokens)
                    ]
                else:
                    # Sharded: one branch per round on every rank (fillers included), in lockstep.
                    batches = (
                        ([row], None if row is None else self._branch(group, completion_ids[row], lengths[row]))
                        for row in slot.rows
                    )
                done = 0  # branch passes, a sharded round's zero-weight branch included
                for batch_rows, inputs in batches:
                    done += 1
                    if inputs is None:
                        self._zero_branch(group, None, device)
                        continue
                    lp, ent = self._forward_branch(*inputs)
                    for i, row in enumerate(batch_rows):
                        n = lengths[row]
                        logps[row, :n] = lp[i, :n]
                        if ent is None:
                            has_entropy = False
                        else:
                            entropies[row, :n] = ent[i, :n]
                self._pad(slot, BRANCH, done, device)
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

        Under data parallelism the gradient is reduced once, at the end, unless the wrapper is in `no_sync`.
        """
        sync_pass = functools.partial(self._sync_pass, prompt_ids.device)
        length = prompt_ids.shape[1] + completion_ids.shape[1]
        with fsdp2_gathered(self.model, sync_pass=sync_pass), self.rope.pinned(length):
            prompt, completion = (prompt_ids, prompt_mask), (completion_ids, completion_mask)
            self._backward(*prompt, *completion, grad_logps, grad_entropies, exact, backward_fn)
        finish_ddp(self.model)

    def _backward(
        self, prompt_ids, prompt_mask, completion_ids, completion_mask, grad_logps, grad_entropies, exact, backward_fn
    ) -> None:
        lengths = completion_lengths(completion_mask)
        groups = group_prompts(prompt_ids, prompt_mask)
        live = [
            [
                r
                for r in g.rows
                if lengths[r] > 0 and (grad_logps[r].any() or (grad_entropies is not None and grad_entropies[r].any()))
            ]
            for g in groups
        ]
        device = prompt_ids.device
        # Last scored first: the states the scoring pass kept are held newest first, and beyond `hold_budget` the
        # oldest were dropped. Sharded, the agreed order is sorted by the held states, the same on every rank.
        groups, live = groups[::-1], live[::-1]

        def held_first(group: PromptGroup) -> int:
            # Read when the schedule sorts, after the shard group agreed which held states it takes.
            newest = {key: i for i, key in enumerate(reversed(list(self._held)))}
            return newest.get(_key(group), len(newest))

        def passes(group: PromptGroup, rows: list[int]) -> tuple[int, int, int]:
            chunks = self._num_passes(group)
            return 0 if self._reusable(_key(group), exact) else chunks, len(rows), chunks if exact else 0

        schedule = [
            slot
            for slot in self._schedule(groups, live, lengths, passes, device, first=held_first, boundaries=exact)
            if self.shards is not None or slot.passes is not None or slot.rows
        ]
        for slot in schedule:
            group = slot.group
            if group is None:
                self._pad(slot, PREFILL, 0, device)
                self._pad(slot, BRANCH, 0, device, backward_fn)
                self._pad(slot, REVERSE, 0, device)
                continue
            reused = self._reusable(_key(group), exact)
            # A prompt prefilled here is not held: holding it could drop a held state that a later prompt of this
            # call was planned to reuse.
            state = self.prefill(group, keep=reused, reuse=True, boundaries=exact)
            self._pad(slot, PREFILL, 0 if reused else self._num_passes(group), device)
            if exact:
                state.requires_grad_()
            t0 = time.perf_counter()
            done = 0
            p = Pass(state, visible=state.num_chunks, shard=self.shards)
            # Under gradient checkpointing, each branch's recompute takes its attention outputs from its forward
            # (`Pass.keeping_attention`) instead of attending to the prompt again: bitwise the same, for one attention
            # output per layer and branch token. A sharded state's branch rounds attend again (`sharding.attend`).
            checkpointed = self._backbone().is_activation_checkpointing
            # A bar between the prefill's and the reverse pass's: the branches' replays and backwards.
            rows = tqdm(slot.rows, desc="branches", disable=not self.progress or self._num_passes(group) < 2)
            with self.adapter.activate(), use_pass(p):
                for row in rows:
                    done += 1
                    if row is None:
                        self._zero_branch(group, backward_fn, device)
                        continue
                    n = lengths[row]
                    with p.keeping_attention(checkpointed):
                        lp, ent = self._forward_branch(*self._branch(group, completion_ids[row], n))
                        p.filling = False
                        surrogate = (lp[0] * grad_logps[row, :n].to(lp.dtype)).sum()
                        if grad_entropies is not None:
                            surrogate = surrogate + (ent[0] * grad_entropies[row, :n].to(ent.dtype)).sum()
                        backward_fn(surrogate)
                self._pad(slot, BRANCH, done, device, backward_fn)
            self.stats.replay_s += time.perf_counter() - t0
            self._pad(slot, REVERSE, self.reverse(group, state) if exact else 0, device)
            self._held.pop(_key(group), None)


@contextlib.contextmanager
def _checkpointing_off(backbone, off: bool):
    """With `off`, the checkpointed decoder layers of `backbone` run without checkpointing inside the block (forward
    and backward): their autograd graph is kept instead of recomputed. Nothing otherwise."""
    layers = [m for m in backbone.modules() if getattr(m, "gradient_checkpointing", False)] if off else []
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable):
    """`module` runs `forward(module, ...)` instead of its own forward for the duration of the block; its hooks still
    run. Under accelerate's device hooks the instance `forward` is the hook, which calls `_old_forward`: that one is
    replaced instead."""
    name = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get(name)
    setattr(module, name, functools.partial(forward, module))
    try:
        yield
    finally:
        if previous is None:
            delattr(module, name)
        else:
            setattr(module, name, previous)


def _key(group: PromptGroup) -> tuple[int, bytes]:
    """Identifies a prompt: its left padding and tokens."""
    return group.pad, group.tokens.cpu().numpy().tobytes()
