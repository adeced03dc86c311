"""Shared-prompt generation on the transformers path: one prefill per distinct prompt, the G samples decode after it.

Stock `GRPOTrainer` calls `model.generate` on the whole generation batch, whose rows repeat each prompt G times, so
every prompt is prefilled G times and its keys and values are held G times. Here each distinct prompt is prefilled
once by the engine (chunked, without autograd) and its G rows decode against that one state: at each step a layer
reads every prompt record (batch 1, broadcast over the rows) and then the rows' own tail of decoded tokens.

Sampling itself stays transformers': `generate` builds the logits processors and stopping criteria from the
trainer's `GenerationConfig` and calls `shared_prompt_decoder(...)` in place of its `_sample` loop, which this
module mirrors step for step (processors on the padded rows, multinomial or argmax, pad after EOS, stop criteria).
Positions follow `generate`: the first real prompt token is at position 0 whatever the padding; except that a prompt
whose state is offered to the loss pass (training) starts where the loss pass places it, after its left padding
(`shared_prompt_decoder`'s `offset`).

Several processes decode in *lockstep* where a forward issues collectives that need every rank: FSDP2's per-layer
all-gathers and, under expert parallelism (`expert_parallel`), the experts' all-to-alls inside every MoE layer. With
the prompt state sharded over all processes the ranks of the shard group decode the same prompts in one agreed order,
every step a branch round of their rows, until every rank's rows are done (their prompt attention merges across the
ranks anyway). Otherwise under FSDP2 (the engine's *world lockstep*: no sharded state, i.e. data parallelism with
different prompts per rank, or shard groups smaller than the world, each group with its own prompts) every rank of the
world must run the same forwards. The ranks (the ranks of a shard group alike, as they hold the same prompts) agree on
the number of prompt slots and each slot's prefill passes (two max all-reduces over the world: the most distinct
prompts of any rank, then `distributed.agree_pass_counts`, as the loss pass does) and pad theirs with one-token filler
prefills. After each decoding step one all-reduce over the world (`_agree_unfinished`: a flag per rank) tells each rank
whether a row of its shard group (without a sharded state: its own) and whether a row of any rank still decodes. A
group whose rows are all done while another group's are not, or with no prompt in the slot, runs one-token filler steps
(`_filler_step`, against no prompt state: no sharded attention, so no collective of the group) whose outputs are
discarded until no rank decodes; the ranks of a group whose rows are not all done keep stepping in its branch rounds
(finished rows append padding, as stock does after EOS). Either way every rank runs the same number of forwards in
the same order, so the collectives meet.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation import GenerationMode

from .distributed import agree_pass_counts, fsdp2_gathered, fsdp2_reshard
from .engine import PREFILL, Engine, Pass, PromptGroup, PromptState, use_pass

SUPPORTED_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)


class DecodePass(Pass):
    """A decoding step of G rows that share one prompt state.

    A layer reads every record of the prompt (batch 1), then the rows' tail (batch G) of tokens decoded before this
    step; the record it emits for the step's token is appended to the tail, or replaces the rows' previous one when
    it `supersedes` (a recurrent state). Prompt records are never written, so the state stays the engine's
    `PromptState` of that prompt, which a later pass may read. An adapter opts in with `decode_tail(capacity)` (the
    tail storage, see `adapters` for the interface); its layers must then accept prompt records of batch 1 with G
    rows of queries, as `prefix_merge_attention` does by broadcasting (no copy of the prompt).
    """

    def __init__(self, state: PromptState, tail, shard=None):
        super().__init__(state, visible=state.num_chunks, shard=shard)
        self.tail = tail

    def read(self, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        return super().read(layer_idx) + self.tail.records(layer_idx)

    def prompt_records(self, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        """The prompt's records of `layer_idx` alone (batch 1), for layers that treat them apart from the tail."""
        return super().read(layer_idx)

    def emit(
        self, layer_idx: int, record: tuple[torch.Tensor, ...], sharded: bool = False, supersedes: bool = False
    ) -> None:
        # Decoded tokens are not part of the prompt: their records stay on this rank, whatever `sharded` says.
        record = tuple(t.detach() for t in record)
        if supersedes:
            self.tail.replace(layer_idx, record)
        else:
            self.tail.append(layer_idx, record)


# What the shared-prompt decoder reproduces as transformers applies it. `generate` builds the logits processors and
# stopping criteria from the config and hands them to the decoder, which runs them on the same padded rows as stock.
SAMPLING_SETTINGS = {
    "do_sample": "sampling (multinomial) or greedy (argmax)",
    "temperature": "TemperatureLogitsWarper",
    "top_k": "TopKLogitsWarper",
    "top_p": "TopPLogitsWarper",
    "min_p": "MinPLogitsWarper",
    "repetition_penalty": "RepetitionPenaltyLogitsProcessor, over the padded rows as stock",
    "max_new_tokens": "MaxLengthCriteria",
    "max_length": "MaxLengthCriteria",
    "eos_token_id": "EosTokenCriteria, then padding after EOS",
    "pad_token_id": "padding after EOS",
    # Other logits processors that `generate` builds and the decoder runs unchanged (tests/test_generation.py).
    "suppress_tokens": "SuppressTokensLogitsProcessor",
    "begin_suppress_tokens": "SuppressTokensAtBeginLogitsProcessor",
    "min_length": "MinLengthLogitsProcessor",
    "min_new_tokens": "MinNewTokensLengthLogitsProcessor",
    "no_repeat_ngram_size": "NoRepeatNGramLogitsProcessor",
    "bad_words_ids": "NoBadWordsLogitsProcessor",
    "sequence_bias": "SequenceBiasLogitsProcessor",
    "typical_p": "TypicalLogitsWarper",
    "epsilon_cutoff": "EpsilonLogitsWarper",
    "eta_cutoff": "EtaLogitsWarper",
}
# Settings that do not change which tokens are drawn: ids the model's own config sets, the cache (the decoder holds
# its own state), compilation, and version bookkeeping.
NEUTRAL_SETTINGS = {
    "bos_token_id",
    "decoder_start_token_id",
    "cache_implementation",
    "cache_config",
    "max_cache_len",
    "use_cache",
    "disable_compile",
    "compile_config",
    "transformers_version",
    "_from_model_config",
}
# The alternative to name for the settings the decoder refuses, where there is one.
ALTERNATIVES = {
    "num_return_sequences": "GRPO repeats each prompt num_generations times itself",
    "guidance_scale": "classifier-free guidance runs extra model forwards inside a logits processor",
    "return_dict_in_generate": "GRPO uses only the token ids",
    "output_scores": "GRPO uses only the token ids (set vllm_importance_sampling_correction on the vLLM path for "
    "generation log-probs)",
    "output_logits": "GRPO uses only the token ids",
    "max_time": "limit the length with max_completion_length instead",
    "stop_strings": "stop on token ids: add them to eos_token_id in generation_kwargs",
}


def check_generation_config(config: GenerationConfig) -> None:
    """Raises ValueError for settings the shared-prompt decoder does not reproduce, naming the alternative.

    Supported: sampling or greedy decoding with the settings of `SAMPLING_SETTINGS` (EOS and padding after it, the
    maximum length, temperature, top-k, top-p, min-p, repetition penalty, and the other logits processors listed
    there), each as transformers applies it, since the decoder runs the processors `generate` builds. Any other
    setting that differs from `GenerationConfig()`'s default is refused.
    """
    fix = "or set shared_generation=False in LongStrawGRPOConfig to generate with transformers' own loop"
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"shared-prompt generation supports sampling and greedy decoding, not {mode.value}: remove the "
            f"generation_kwargs that select it (num_beams, penalty_alpha, dola_layers, ...), {fix}."
        )
    default = GenerationConfig().to_dict()
    for name, value in config.to_dict().items():
        if name in SAMPLING_SETTINGS or name in NEUTRAL_SETTINGS or (name in default and value == default[name]):
            continue
        why = ALTERNATIVES.get(name, "the shared-prompt decoder does not reproduce it")
        raise ValueError(
            f"generation setting {name}={value!r} is not supported by shared-prompt generation ({why}): remove it "
            f"from generation_kwargs, {fix}. Supported: {', '.join(sorted(SAMPLING_SETTINGS))}."
        )


def shared_prompt_decoder(
    engine: Engine,
    prompt: torch.Tensor,
    longest: int | None = None,
    rows_per_rank: list[int] | None = None,
    offer: bool = False,
    boundaries: bool = False,
    offset: int = 0,
    prefill_passes: int | None = None,
) -> Callable:
    """A `custom_generate` callable for `model.generate` that decodes rows which all hold `prompt`.

    Args:
        engine: the engine of the generating model (its `causal_lm` carries any active PEFT adapter).
        prompt: `[L]` the prompt without padding; the rows passed to `generate` are this prompt, left-padded.
        longest: the longest prompt of the batch that stock's one `generate` call would hold (default `L`): per-call
            RoPE (dynamic, longrope) rotates the prompt with the frequencies of `longest` positions and the `k`-th
            step with those of `longest + k`, as in that call (see `rope`).
        rows_per_rank: with a sharded prompt state (`engine.shards`), the number of rows of this prompt on each rank
            of the shard group, which decode in lockstep: every step is a branch round of those rows, and the ranks
            step until every rank's rows are done (a rank whose rows finished early appends padding, as stock does
            after EOS, which `trim_after_eos` drops).
        offer: hand the prompt state to the engine's next loss pass (`Engine.offer`), which then does not prefill
            this prompt again while the weights are unchanged.
        boundaries: prefill with the recurrent chunk boundaries (an offer to an exact-mode loss pass).
        offset: the position of the first prompt token (default 0, as `generate` numbers them). An offered state
            is prefilled at the positions the loss pass gives the prompt, after its left padding in the batch (stock's
            forward numbers padded rows from 0), and the steps decode at the positions that follow: under RoPE the
            attention scores depend only on differences of positions, so the decoded distribution is `generate`'s up
            to float rounding.
        prefill_passes: in the engine's world lockstep (`engine.lockstep`), the prefill passes every rank runs for
            this prompt's slot (agreed by `generate_shared`; this rank pads its own with fillers), and the ranks then
            decode in lockstep (see the module docstring). Default: this prompt's own passes.
    """
    longest = longest or prompt.shape[0]
    shards = engine.shards
    if shards is not None and rows_per_rank is None:
        raise ValueError("decoding against a sharded prompt state needs rows_per_rank")
    lockstep = _world_lockstep(engine)

    def decode(
        model,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ) -> torch.LongTensor:
        """Mirrors `GenerationMixin._sample` (no streamer, no dict output). `input_ids` `[G, P]` -> `[G, P + T]`."""
        if synced_gpus and not in_lockstep(engine):
            raise ValueError(
                "shared-prompt generation runs every process in lockstep (as synced_gpus asks) only under FSDP2 or "
                "with the prompt state sharded over every process: shard the model with FSDP2 (fsdp_version: 2), or "
                "set shared_generation=False in LongStrawGRPOConfig."
            )
        if streamer is not None:
            raise ValueError("shared-prompt generation does not stream: remove the streamer.")
        # Under FSDP2 (then in lockstep: synced_gpus) the root's own parameters stay gathered, as the prefill calls
        # the backbone, and the layers gather pass by pass (on a rank without a prompt in this slot too:
        # `generate_shared`).
        with fsdp2_gathered(engine.model):
            ids = _decode(input_ids, logits_processor, stopping_criteria, generation_config)
        fsdp2_reshard(engine.model)  # no backward follows to reshard what FSDP2 keeps gathered after a forward
        return ids

    def _decode(input_ids, logits_processor, stopping_criteria, generation_config: GenerationConfig):
        rows, width = input_ids.shape
        pad_token_id = generation_config._pad_token_tensor
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)
        # Positions as generate derives them from the attention mask (the first real prompt token at 0), or after
        # the left padding the loss pass gives the prompt (`offset`).
        group = PromptGroup(tokens=prompt, pad=offset, rows=list(range(rows)))
        with engine.rope.pinned(longest):
            state = engine.prefill(group, boundaries=boundaries)
        if lockstep:  # the passes this prefill ran: chunks, or context-parallel rounds
            _filler_prefills((prefill_passes or 0) - engine._num_passes(group), engine, input_ids.device)
        if offer:
            engine.offer(group, state)
        tail = engine.adapter.decode_tail(generation_config.max_length - width)
        # The rows' ids `[G, width + max new tokens]`, filled one column per step; `ids` is the view of what is
        # decoded so far, which the logits processors and stopping criteria read as stock's `input_ids`. Allocated
        # after the prefill and written in place, where stock concatenates a new `[G, width + t]` tensor per step.
        buffer = input_ids.new_empty(rows, max(generation_config.max_length, width + 1))
        buffer[:, :width] = input_ids
        ids = buffer[:, :width]
        del input_ids
        step_ids = prompt[-1:].expand(rows)
        step = 0
        # Beside the prefill's bar and under the same condition (`Engine.progress`, prompts of several passes): at
        # 32K tokens the 8 rows' 128 steps took half the prefill's time. Tokens of all rows (G per step, finished
        # rows' padding included); it stops short of its total when every row has met EOS.
        bar = tqdm(
            total=rows * (generation_config.max_length - width),
            desc="decode",
            unit="tok",
            disable=not engine.progress or engine._num_passes(group) < 2,
        )
        with bar, engine.adapter.activate(), torch.no_grad(), use_pass(DecodePass(state, tail, shards)):
            while True:
                if shards is not None:
                    shards.branch_round(rows_per_rank)
                position = offset + prompt.shape[0] - 1 + step
                # The prefill's and the loss pass's precision (see `engine`); the RoPE of `generate` at this length.
                with engine.autocast(), engine.rope.pinned(longest + step):
                    outputs = engine.causal_lm(
                        input_ids=step_ids[:, None],
                        position_ids=torch.full((rows, 1), position, device=buffer.device),
                        use_cache=False,
                    )
                next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=buffer.device)
                del outputs
                next_token_scores = logits_processor(ids, next_token_logits)
                if generation_config.do_sample:
                    probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(next_token_scores, dim=-1)
                if has_eos_stopping_criteria:
                    next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
                if ids.shape[1] == buffer.shape[1]:  # a stopping criterion past max_length: grow as stock's cat
                    buffer = torch.cat([buffer, buffer.new_empty(rows, buffer.shape[1])], dim=1)
                buffer[:, ids.shape[1]] = next_tokens
                ids = buffer[:, : ids.shape[1] + 1]
                bar.update(rows)
                unfinished = unfinished & ~stopping_criteria(ids, None)
                in_group, anywhere = _agree_unfinished(unfinished, shards, lockstep)
                if not anywhere:
                    return ids
                if not in_group:  # world lockstep: this group's rows are done, another rank's are not
                    _filler_steps(engine, buffer.device)
                    return ids
                step_ids = next_tokens
                step += 1

    return decode


def _world_lockstep(engine: Engine) -> bool:
    """Whether `engine`'s generation runs in the world lockstep (FSDP2 without a state sharded over every process:
    see the module docstring)."""
    return engine.lockstep and dist.is_initialized() and dist.get_world_size() > 1


def _agree_unfinished(unfinished: torch.Tensor, shards, lockstep: bool = False) -> tuple[bool, bool]:
    """Whether a row of `unfinished` `[G]` is still going: `(in this rank's shard group, anywhere)`.

    Without `shards`, the group is this rank alone. In the world `lockstep`, one all-reduce (max) over the world of a
    flag per rank answers both, the same call on every rank whether it decodes or runs fillers; otherwise, with
    `shards`, one over the shard group (whose ranks are then the only ones that must agree).
    """
    mine = int(bool(unfinished.any())) if unfinished.numel() else 0
    if lockstep:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.long, device=unfinished.device)
        flags[dist.get_rank()] = mine
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        ranks = [dist.get_rank()] if shards is None else dist.get_process_group_ranks(shards.group)
        return bool(flags[ranks].any()), bool(flags.any())
    if shards is not None:
        flag = torch.tensor([mine], dtype=torch.long, device=unfinished.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shards.group)
        mine = int(flag.item())
    return bool(mine), bool(mine)


def in_lockstep(engine: Engine) -> bool:
    """Whether `engine`'s ranks can decode in lockstep: one process, the prompt state sharded over every process,
    or the engine's world lockstep (FSDP2, with shard groups smaller than the world or without a sharded state)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    return engine.lockstep or (engine.shards is not None and engine.shards.world == dist.get_world_size())


def _filler_prefills(n: int, engine: Engine, device) -> None:
    """`n` one-token filler prefill passes (`Engine._filler`): the world lockstep's padding of a prompt slot in which
    another rank (shard group) prefills more passes."""
    for _ in range(n):
        engine._filler(PREFILL, device)


def _filler_step(engine: Engine, device) -> None:
    """A decoding step's forward on one token against an empty prompt state, through the model a decoding step calls
    (so it issues the same collectives: FSDP2's gathers, the experts' all-to-alls); its output is discarded."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with (
        engine.adapter.activate(),
        torch.no_grad(),
        use_pass(Pass(PromptState(), visible=0)),
        engine.autocast(),
    ):
        engine.causal_lm(input_ids=ids, position_ids=ids, use_cache=False)


def _filler_steps(engine: Engine, device) -> None:
    """World lockstep, on a rank whose shard group (or itself, without a sharded state) has no row left to decode:
    one filler step per decoding step of the other ranks, each followed by the step's agreement, until no rank
    decodes."""
    done = torch.zeros(0, dtype=torch.long, device=device)
    while True:
        _filler_step(engine, device)
        if not _agree_unfinished(done, None, lockstep=True)[1]:
            return


def generation_config_for_decoder(config: GenerationConfig) -> GenerationConfig:
    """A copy of `config` with transformers' own cache turned off: the engine holds the prompt state and tails."""
    config = GenerationConfig.from_dict(config.to_dict())
    config.use_cache = False
    config.cache_implementation = None
    return config


def trim_after_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row of `completion_ids` `[G, T]` up to and including its first EOS, as `GRPOTrainer` trims them."""
    device = completion_ids.device
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
    completion_mask = sequence_indices <= eos_idx.unsqueeze(1)
    return [c[m].tolist() for c, m in zip(completion_ids.cpu(), completion_mask.cpu(), strict=True)]


def generate_shared(
    model,
    engine: Engine,
    prompt_ids: list[list[int]],
    generation_config: GenerationConfig,
    pad_token_id: int,
    eos_token_ids: list[int],
    pad_to_multiple_of: int | None,
    device: torch.device,
    offer_boundaries: bool | None = None,
) -> list[list[int]]:
    """Completions of `prompt_ids` (one list of token ids per row), one `generate` call per distinct prompt.

    The rows of one prompt are passed to `generate` left-padded to the batch width exactly as `GRPOTrainer` pads
    the whole batch, so the logits processors (repetition penalty, minimum length) and the maximum length see the
    same `input_ids` as in stock; only the decoding loop is `shared_prompt_decoder`'s. With a sharded prompt state
    (`engine.shards`), the ranks of the shard group decode the prompts in one agreed order, in lockstep; in the
    engine's world lockstep (FSDP2, without a sharded state or with shard groups smaller than the world), every rank
    runs the agreed slots, with fillers where it (its group) has less to do (see the module docstring).

    Args:
        model: the model `generate` is called on (unwrapped, PEFT adapters active).
        engine: the engine of that model.
        generation_config: the trainer's generation config; checked with `check_generation_config`.
        offer_boundaries: unless None, the state of every prompt is offered to the loss pass (`Engine.offer`),
            prefilled with chunk boundaries if True (exact mode), at the positions the loss pass gives the prompt:
            after its left padding in this batch, as stock's forward numbers padded rows (the rows then decode at
            the positions that follow; see `shared_prompt_decoder`'s `offset`). With a sharded prompt state, a prompt
            is offered only if every rank of the shard group pads it alike (the ranks prefill it together); the
            others are prefilled at `generate`'s positions and not offered.
    Returns:
        Per row, the generated ids up to and including the first EOS.
    """
    # The batch width of stock's left padding; each prompt's rows are built from one padded row (views), not as a
    # `[B, width]` copy of the whole batch.
    width = max(len(ids) for ids in prompt_ids)
    if pad_to_multiple_of is not None:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, ids in enumerate(prompt_ids):
        groups.setdefault(tuple(ids), []).append(row)
    items: list[tuple[tuple[int, ...], list[int]] | None] = list(groups.items())
    rows_per_rank: list[list[int] | None] = [None] * len(items)
    prefill_passes: list[int | None] = [None] * len(items)
    lockstep = _world_lockstep(engine)
    if engine.shards is not None:
        # The ranks of a shard group hold the same prompts (other rows of them) and decode them in one agreed order.
        keyed = [PromptGroup(tokens=torch.tensor(tokens), pad=0, rows=rows) for tokens, rows in items]
        order, plan = engine.shards.agree(keyed, [[len(rows)] for _, rows in items])
        items = [items[i] for i in order]
        rows_per_rank = [[counts[0] for counts in ranks] for ranks in plan]
    if lockstep:
        # World lockstep: the ranks (shard groups) hold different prompts. Fewest passes first (stable: the ranks of a
        # shard group keep one order), so that the ranks' long prompts share slots; every rank then runs each slot's
        # agreed prefill passes, and empty slots (no prompt of its own: `None`) up to the most prompts of any rank.
        num_passes = {tokens: engine._num_passes(PromptGroup(torch.tensor(tokens), 0, [])) for tokens in groups}
        ranked = sorted(range(len(items)), key=lambda i: num_passes[items[i][0]])
        items, rows_per_rank = [items[i] for i in ranked], [rows_per_rank[i] for i in ranked]
        # The agreement's table needs the same size on every rank; TRL gives every process the same rows except in
        # multi-turn tool calls, which generate again for the rows that called a tool.
        slots = torch.tensor([len(items)], device=device)
        dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        # Every slot decodes (the branch column), so that no slot counts as empty, one-token prompts' included.
        agreed = agree_pass_counts([(num_passes[tokens], 1, 0) for tokens, _ in items], int(slots.item()), device)
        items += [None] * (len(agreed) - len(items))
        rows_per_rank += [None] * (len(agreed) - len(rows_per_rank))
        prefill_passes = [counts[PREFILL] for counts in agreed]
    # Left padding of each prompt in the batch, where the loss pass places it (offers only).
    offsets: list[int | None] = [None] * len(items)
    if offer_boundaries is not None:
        offsets = [None if item is None else width - len(item[0]) for item in items]
        real = [o for o in offsets if o is not None]  # the prompts first, then the world lockstep's empty slots
        if engine.shards is not None and real:  # `agree` gave every rank of the group the same prompts and slots
            # The ranks prefill a prompt together, so they place it alike: they offer it only where their loss
            # passes will look it up under the same padding.
            lowest, highest = engine.shards.extremes(real, device)
            offsets[: len(real)] = [
                o if low == high else None for o, low, high in zip(real, lowest, highest, strict=True)
            ]
    config = generation_config_for_decoder(generation_config)
    completions: list[list[int]] = [[] for _ in prompt_ids]
    # Per-call RoPE: each prompt decodes from the state stock's one `generate` starts from, and the state left
    # behind is that of the longest decoding, as after stock's call.
    longest = max(len(ids) for ids in prompt_ids)
    start = final = engine.rope.snapshot()
    most_steps = -1
    for item, counts, passes, offset in zip(items, rows_per_rank, prefill_passes, offsets, strict=True):
        if item is None:  # world lockstep: another rank (group) decodes a prompt in this slot
            with fsdp2_gathered(engine.model):
                _filler_prefills(passes, engine, device)
                _filler_steps(engine, device)
            fsdp2_reshard(engine.model)
            continue
        tokens, rows = item
        engine.rope.restore(start)
        prompt = torch.tensor(tokens, device=device)
        decoder = shared_prompt_decoder(
            engine,
            prompt,
            longest,
            counts,
            offer=offset is not None,
            boundaries=offset is not None and bool(offer_boundaries),
            offset=offset or 0,
            prefill_passes=passes,
        )
        # The rows as `generate` receives them in stock, left-padded to the batch width: one row, expanded.
        padded = torch.full((1, width), pad_token_id, dtype=prompt.dtype, device=device)
        padded[0, width - len(tokens) :] = prompt
        mask = torch.zeros((1, width), dtype=prompt.dtype, device=device)
        mask[0, width - len(tokens) :] = 1
        out = model.generate(
            input_ids=padded.expand(len(rows), -1),
            attention_mask=mask.expand(len(rows), -1),
            generation_config=config,
            custom_generate=decoder,
        )
        del padded, mask
        if out.shape[1] > most_steps:
            most_steps, final = out.shape[1], engine.rope.snapshot()
        for row, completion in zip(rows, trim_after_eos(out[:, width:], eos_token_ids), strict=True):
            completions[row] = completion
    engine.rope.restore(final)
    return completions
