"""Worker of tests/test_generation.py's 2-process test: shared-prompt decoding against a prompt state sharded over 2
CPU processes (gloo).

Launched through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, OUT)`. The two ranks
hold other rows of the same prompts (13, 7 and 1 tokens, prefilled in chunks of 3; 2, 2, 1 rows on rank 0 and 1, 2, 3
on rank 1), and each rank:

- greedy: runs `_generate_single_turn` of a `LongStrawGRPOTrainer` with `shard_prompt_state=True` and transformers'
  own `generate` on the same rows;
- sampling: for each prompt, runs `generate` with the shared-prompt decoder and with its own `_sample` loop on the
  same rows from the same seed (the seed differs between the ranks, so their rows differ and the exchange of rows
  between the ranks is exercised), recording the processed scores of every step; most tokens are EOS on rank 0, so
  its rows finish first and it steps on in lockstep with rank 1;
- records, for each prompt state the decoding prefilled, whether decoding left it unchanged and how many attention
  records this rank holds of how many chunks;
- greedy again on an FSDP2 model (`fully_shard` on every layer and the root), where `generate` runs with
  `synced_gpus` and the decoder in lockstep with FSDP2's per-layer gathers; and on the same model without a sharded
  state (different prompts per rank: the data-parallel lockstep of generation); and checks that transformers'
  `generate` would run in lockstep (synced_gpus) on a PEFT model sharded by `fully_shard` as accelerate does.

Rank 0 writes every rank's results to `OUT`.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

PROMPTS = ["a b c d e f g h i j k l m", "h i j k l m n", "x"]
ROWS = {0: [0, 1, 0, 2, 1], 1: [2, 1, 0, 2, 1, 2]}
# FSDP2 without a sharded state: different prompts per rank (the same number of rows, as TRL gives every process).
DP_ROWS = {0: [0, 1, 0, 1, 0], 1: [2, 2, 2, 2, 2]}
# The pad token is never drawn: its zero embedding gives glm_moe_dsa indexer keys that tie at the top-k cut-off,
# where stock's order is unspecified (see glm_moe_dsa.py).
SAMPLING = {"do_sample": True, "temperature": 1.3, "top_k": 0, "suppress_tokens": [0]}
# Sampling: most tokens end rank 0's rows, so they finish before rank 1's, which rank 0 then steps on with.
EOS = {0: [1, *range(3, 40)], 1: [1]}


def main(model_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from datasets import Dataset
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.generation import generation_config_for_decoder, shared_prompt_decoder, trim_after_eos

    config = LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=1,
        num_generations=2,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
        bf16=False,
        prefill_chunk_size=3,
        prefill_progress=False,
        shard_prompt_state=True,
        generation_kwargs={"do_sample": False},
    )
    trainer = LongStrawGRPOTrainer(
        model_path,
        lambda completions, **kw: [0.0] * len(completions),
        config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the distributed decoding test needs 2 processes, got {world}"
    shards = trainer._prompt_shards
    assert shards is not None and shards.world == 2 and trainer._shared_generation
    model = trainer.accelerator.unwrap_model(trainer.model)
    engine = trainer._engine(trainer.model)
    tokenizer = trainer.processing_class
    ids = [tokenizer(text=PROMPTS[i])["input_ids"] for i in ROWS[rank]]

    states, prefill = [], engine.prefill

    def recording(*args, **kwargs):
        state = prefill(*args, **kwargs)
        states.append((state, [t.clone() for t in state.tensors()]))
        return state

    engine.prefill = recording

    # Greedy: the trainer's generation against transformers' generate on the same (left-padded) rows.
    got, _ = trainer._generate_single_turn(ids, None, {}, 2)
    width = max(len(x) for x in ids)
    padded = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
        out = model.generate(input_ids=padded, attention_mask=mask, generation_config=trainer.generation_config)
    expected = trim_after_eos(out[:, width:], trainer.eos_token_ids)

    class Recorder(LogitsProcessor):
        def __init__(self):
            self.scores = []

        def __call__(self, input_ids, scores):
            self.scores.append(scores.clone())
            return scores

    # Sampling, prompt by prompt in the same order on both ranks, one left-padding token.
    counts = [[ROWS[r].count(i) for r in range(world)] for i in range(len(PROMPTS))]
    sampled = []
    for i, text in enumerate(PROMPTS):
        prompt = tokenizer(text=text)["input_ids"]
        rows = counts[i][rank]
        input_ids, attention = torch.tensor([[0] + prompt] * rows), torch.tensor([[0] + [1] * len(prompt)] * rows)
        generation = GenerationConfig(
            max_new_tokens=8, pad_token_id=0, eos_token_id=EOS[rank], disable_compile=True, **SAMPLING
        )
        runs = []
        for custom in (shared_prompt_decoder(engine, torch.tensor(prompt), rows_per_rank=counts[i]), None):
            recorder = Recorder()
            torch.manual_seed(100 + rank)
            with torch.no_grad():
                result = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    generation_config=generation_config_for_decoder(generation) if custom else generation,
                    logits_processor=LogitsProcessorList([recorder]),
                    custom_generate=custom,
                )
            runs.append((trim_after_eos(result[:, len(prompt) + 1 :], EOS[rank]), recorder.scores))
        (ours, our_scores), (stock, stock_scores) = runs
        # Ours may step further (the ranks stop together); the steps stock ran compare one to one, on the rows still
        # decoding (a finished row is fed padding, whose scores do not matter).
        error = max(
            (a.log_softmax(-1) - b.log_softmax(-1))[[len(c) > k for c in stock]].abs().nan_to_num(0.0).max().item()
            for k, (a, b) in enumerate(zip(stock_scores, our_scores[: len(stock_scores)], strict=True))
        )
        sampled.append(
            {"ours": ours, "stock": stock, "logp_error": error, "steps": (len(our_scores), len(stock_scores))}
        )

    unchanged = all(
        all(torch.equal(a, b) for a, b in zip(state.tensors(), before, strict=True)) for state, before in states
    )
    held = []
    for state, _ in states:
        attention_layers = [layer for layer in state.records if layer not in state.recurrent]
        chunks = state.records[attention_layers[0]] if attention_layers else []
        held.append((sum(record is not None for record in chunks), len(chunks)))
    # FSDP2 (`fully_shard` on every decoder layer and the root): `generate` runs with synced_gpus, the decoder in
    # lockstep with the layers gathered pass by pass; greedy completions are the unsharded model's.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.integrations.fsdp import is_fsdp_managed_module

    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine
    from trl_longstraw.generation import generate_shared

    fsdp = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    assert is_fsdp_managed_module(fsdp), "generate would not run with synced_gpus"
    fsdp_engine = Engine(fsdp, fsdp, get_adapter(fsdp), chunk_size=3, shards=shards)
    config = generation_config_for_decoder(trainer.generation_config)
    with torch.no_grad():
        fsdp_got = generate_shared(fsdp, fsdp_engine, ids, config, 0, trainer.eos_token_ids, None, torch.device("cpu"))

    # FSDP2 without a sharded state: the data-parallel lockstep of generation. The ranks hold different prompts (rank
    # 0 two, rank 1 one, of other chunk counts), so each pads its prefills and steps with fillers where it has less to
    # do; greedy completions are the unsharded model's.
    dp_ids = [tokenizer(text=PROMPTS[i])["input_ids"] for i in DP_ROWS[rank]]
    dp_engine = Engine(fsdp, fsdp, get_adapter(fsdp), chunk_size=3)
    assert dp_engine.lockstep
    with torch.no_grad():
        dp_got = generate_shared(fsdp, dp_engine, dp_ids, config, 0, trainer.eos_token_ids, None, torch.device("cpu"))
        dp_width = max(len(x) for x in dp_ids)
        dp_out = model.generate(
            input_ids=torch.tensor([[0] * (dp_width - len(x)) + x for x in dp_ids]),
            attention_mask=torch.tensor([[0] * (dp_width - len(x)) + [1] * len(x) for x in dp_ids]),
            generation_config=trainer.generation_config,
        )

    # With shared_generation=False under FSDP2, transformers' generate must run every rank in lockstep (synced_gpus):
    # it does for any module fully_shard manages, so for accelerate's FSDP2 of a PEFT model too (generate runs on the
    # causal LM inside the PEFT wrappers).
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["o_proj"]))
    for layer in peft.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(peft, mesh=mesh)
    peft_synced_gpus = is_fsdp_managed_module(peft.base_model.model)

    mine = {
        "peft_synced_gpus": peft_synced_gpus,
        "greedy": (got, expected),
        "fsdp2_greedy": fsdp_got,
        "fsdp2_data_parallel": (dp_got, trim_after_eos(dp_out[:, dp_width:], trainer.eos_token_ids)),
        "sampled": sampled,
        "unchanged": unchanged,
        "held": held,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        torch.save(everyone, out_path)
    dist.barrier()
