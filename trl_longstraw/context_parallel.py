"""Context-parallel prompt passes for a sharded prompt state (`shard_prompt_state`).

Without context parallelism every rank of a shard group runs every prefill and reverse chunk (only the prompt
attention is split, see `sharding`). With it, the prompt is cut into *rounds* of W consecutive chunks and, in round
`j`, rank `r` runs chunk `j * W + r` alone: the chunk it owns (`PromptShards.owner`). So each rank runs 1/W of the
prompt's tokens through every token-wise layer (embeddings, norms, projections, MLPs), in the prefill and in the
reverse pass, and keeps the records of the chunks it ran. MoE layers route each rank's own tokens, also under expert
parallelism (transformers' `all_to_all` sends every (token, expert) pair to the expert's rank: `expert_parallel`).

Token mixers see the other ranks' chunks of the round through collectives:

- attention (`sharding.sharded_prefix_attention` in a round, `PromptShards.cp_round`): the queries, keys and values
  of every rank are gathered; each rank attends every rank's queries to its own earlier chunks and the first half of
  each later rank's queries to its own chunk, and the partial outputs and log-sum-exps go back to the query owners,
  which merge them with their causal part and with their other half attended to the round's earlier chunks (the
  branch-round exchange; the halves keep the ranks' work equal within the round, `sharding._RoundSplit`);
- Gated DeltaNet (`qwen3_5`): sequence-parallel, for any number of ranks and heads. One all-gather (`gather`) of
  every rank's last `kernel - 1` conv inputs gives each rank the conv history at the start of its chunk; rank 0 runs
  the delta rule from the round's state, a later rank from an unknown one, as an affine function of it (its chunk's
  output and final state from zero, and their linear action on the initial state: `qwen3_5.segment_gated_delta_rule`,
  one call of the delta rule on values widened by `Dk` zero columns); a second all-gather of every rank's final state
  and `[Dk, Dk]` transition per head gives every rank the state at each boundary of the round, from which rank `r`
  resumes its output and every rank builds the whole records. Two small collectives per layer and round (a
  head-parallel all-to-all design needed three, moving every token's conv inputs and outputs, and a head count that
  the group divides);
- MLA with DSA (`glm_moe_dsa`): every rank gathers the round's compressed rows (`kv_lora_rank + qk_rope_head_dim`
  latent and rope key, and the indexer key: small, one row per token) and numbers them after the prefix; the
  indexer's top-k over the prefix chunks is taken as in a branch round (every rank's queries scored against each
  rank's chunks, the candidates merged by the query owners in key order), then over the round's rows causally, so it
  is the global top-k of one process, ties included; absorbed MLA attends the round's rows locally and the prefix
  through the branch-round exchange, merged by log-sum-exp. The exchanges run in slices of at most
  `glm_moe_dsa.EXCHANGE_ROWS` gathered queries (checkpointed with autograd), which bounds their memory whatever the
  chunk size and group size.

A round's tokens are split as the chunks fall: W chunks of `chunk_size`, and the last round's remainder evenly over
the ranks (`plan_rounds`); a remainder shorter than W runs as one replicated chunk (every rank runs it, the path
without context parallelism). Every collective here is differentiable with the semantics of `sharding`: each rank
back-propagates its own share of the loss, and the backward of a gather sums the shares of each rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CPRound:
    """One context-parallel round of a prompt pass: rank `r` runs chunk `first + r` of `lengths[r]` tokens."""

    first: int
    lengths: list[int]
    rank: int

    @property
    def chunk(self) -> int:
        """The chunk this rank runs."""
        return self.first + self.rank

    @property
    def chunks(self) -> range:
        return range(self.first, self.first + len(self.lengths))


def plan_rounds(n: int, chunk_size: int, world: int) -> list[list[tuple[int, int]]]:
    """The passes of a prompt prefix of `n` tokens, as `(start, end)` per rank (a round of `world` chunks) or one
    `(start, end)` that every rank runs (a replicated chunk, for a remainder of fewer than `world` tokens).

    Rounds of `world` chunks of `chunk_size` tokens; the last, shorter round gives `remainder // world` tokens to each
    rank and one more to the first `remainder % world` ranks.
    """
    rounds: list[list[tuple[int, int]]] = []
    start = 0
    while start < n:
        remaining = n - start
        if remaining >= world * chunk_size:
            sizes = [chunk_size] * world
        elif remaining >= world:
            sizes = [remaining // world + (r < remaining % world) for r in range(world)]
        else:
            rounds.append([(start, n)])
            break
        bounds = []
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        rounds.append(bounds)
    return rounds


# The all-gather of `sharding` (`_GatherTokens`) without its token padding; `sharding` imports the engine (through
# `generation`), which imports this module, so it is not shared.
def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllGather(torch.autograd.Function):
    """`x` of every rank stacked `[W, ...]`; the backward gives each rank the sum of every rank's gradient of its
    slice (its share and the others')."""

    @staticmethod
    def forward(ctx, x, world: int, group):
        ctx.group = group
        out = x.new_empty(world, *x.shape)
        dist.all_gather_single(out, x.contiguous()[None], group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group).sum(0), None, None


def gather(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """All-gather: `x` of every rank, stacked `[W, ...]`. Collective, differentiable (each rank's slice gets the sum of
    every rank's share of its gradient)."""
    return _AllGather.apply(x, world, group)
