"""Recipe configs, the recipe script, publishable configs and the Hub export."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trl import ModelConfig

from trl_longstraw import LongStrawGRPOConfig
from trl_longstraw.hub import (
    CARD_TAGS,
    config_from_dict,
    config_to_dict,
    export,
    installed_launch_command,
    launch_command,
    load_config,
    main,
    parse_recipe_config,
    save_config,
)
from trl_longstraw.recipe import LongStrawScriptArguments, check_rope_override, reward_function, summarize
from trl_longstraw.tasks import exact_match_reward, retrieval_reward

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
TINY = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


def same(parsed_a, parsed_b) -> bool:
    """Whether two (script_args, training_args, model_args) triples hold the same values."""
    (sa, ta, ma), (sb, tb, mb) = parsed_a, parsed_b
    return vars(sa) == vars(sb) and ta.to_dict() == tb.to_dict() and vars(ma) == vars(mb)


def load_script():
    """recipes/grpo_long.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("grpo_long", ROOT / "recipes" / "grpo_long.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {
        "tiny_cpu.yaml",
        "qwen3.6-27b_8xh20_2.1m_detached.yaml",
        "qwen3.6-27b_8xh20_2.1m_exact.yaml",
        "glm-5.2_32xh20_2.1m.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_starts_with_its_launch_line(path):
    script_args, training_args, model_args = parse_recipe_config(path)
    assert isinstance(script_args, LongStrawScriptArguments)
    assert isinstance(training_args, LongStrawGRPOConfig)
    assert isinstance(model_args, ModelConfig)
    text = path.read_text()
    assert text.startswith("# Launch: "), "each config starts with its launch command"
    launch = launch_command(text)
    assert "recipes/grpo_long.py" in launch and f"--config recipes/configs/{path.name}" in launch
    for name in script_args.reward_funcs:
        reward_function(name)


@pytest.mark.parametrize("path", [p for p in CONFIGS if p != TINY], ids=lambda p: p.name)
def test_long_configs_cover_their_positions(path):
    mapping = yaml.safe_load(path.read_text())
    script_args, training_args, model_args = parse_recipe_config(path)
    # FSDP2, with CPU offload where the config needs the host memory (its header quotes the planner's --offload);
    # expert parallelism launches without accelerate's sharding, as transformers shards the model.
    offload = "--offload" in path.read_text()
    accelerate = "fsdp2_offload.yaml" if offload else "fsdp2.yaml"
    if training_args.expert_parallel_size > 1:
        accelerate = "expert_parallel.yaml"
        assert training_args.save_only_model
    assert f"--config_file recipes/accelerate/{accelerate}" in launch_command(path.read_text())
    assert mapping["bf16"] is True and training_args.gradient_checkpointing
    assert training_args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert script_args.prompt_tokens >= 2_100_000
    kwargs = training_args.model_init_kwargs
    text_kwargs = kwargs.get("text_config", kwargs)
    rope = text_kwargs["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    window = rope["factor"] * rope["original_max_position_embeddings"]
    # transformers warns when max_position_embeddings disagrees with the YaRN factor.
    assert text_kwargs["max_position_embeddings"] == window
    assert window >= script_args.prompt_tokens + training_args.max_completion_length
    if "glm" in path.name:
        assert training_args.router_aux_loss_coef == 0.0
        assert model_args.use_peft


def test_configs_disagree_only_where_named():
    exact = yaml.safe_load((ROOT / "recipes/configs/qwen3.6-27b_8xh20_2.1m_exact.yaml").read_text())
    detached = yaml.safe_load((ROOT / "recipes/configs/qwen3.6-27b_8xh20_2.1m_detached.yaml").read_text())
    differ = {k for k in set(exact) | set(detached) if exact.get(k) != detached.get(k)}
    assert differ == {"prompt_gradient", "output_dir", "prefill_chunk_size", "offload_boundary_states"}
    assert (exact["prompt_gradient"], detached["prompt_gradient"]) == ("exact", "detached")
    # Exact mode keeps its boundaries in host memory; detached mode keeps none, and prefills in smaller chunks.
    assert exact["offload_boundary_states"] and (exact["prefill_chunk_size"], detached["prefill_chunk_size"]) == (
        8192,
        4096,
    )


def test_unknown_config_key_raises(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text() + "prefil_chunk_size: 12\n")
    with pytest.raises(ValueError, match="prefil_chunk_size"):
        parse_recipe_config(bad)


def test_tiny_yaml_is_the_embedded_default():
    script = load_script()
    from_yaml = parse_recipe_config(TINY)
    embedded = script.parse([])
    assert same(from_yaml, embedded)
    assert yaml.safe_load(TINY.read_text()) == script.TINY_CPU_DEFAULTS


def test_tiny_default_spans_several_prefill_chunks():
    script_args, training_args, _ = parse_recipe_config(TINY)
    assert script_args.prompt_tokens > 2 * training_args.prefill_chunk_size
    assert training_args.prefill_progress


def test_flags_override_the_yaml():
    script_args, training_args, _ = load_script().parse(
        ["--config", str(TINY), "--max_steps", "3", "--prompt_gradient", "detached"]
    )
    assert training_args.max_steps == 3 and training_args.prompt_gradient == "detached"


def test_reward_function_names():
    assert reward_function("retrieval_reward") is retrieval_reward
    assert reward_function("exact_match_reward") is exact_match_reward
    assert reward_function("trl_longstraw.tasks.retrieval_reward") is retrieval_reward
    with pytest.raises(ValueError, match="retrieval_reward"):
        reward_function("no_such_reward")


def test_summarize():
    history = [{"reward": 0.1 * i, "longstraw/prompt_positions": 383.0} for i in range(10)]
    history.append({"train_runtime": 5.0})
    summary = summarize(history, window=3)
    assert summary["reward_first"] == pytest.approx(0.1)
    assert summary["reward_last"] == pytest.approx(0.8)
    assert summary["prompt_positions"] == 383.0
    for entry in history[:10]:
        entry.update({"longstraw/prompt_positions": 0.0, "longstraw/prompt_positions_reused": 383.0})
    assert summarize(history, window=3)["prompt_positions"] == 383.0
    with pytest.raises(ValueError, match="logging_steps"):
        summarize([{"train_runtime": 1.0}])


# ---------------------------------------------------------------------------------------------- RoPE override
ROPE = {"rope_type": "default", "rope_theta": 500000.0}


def test_rope_override_must_keep_the_checkpoint_values(tiny_model_path):
    from transformers import AutoConfig

    path = tiny_model_path("llama")
    theta = AutoConfig.from_pretrained(path).rope_parameters["rope_theta"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    check_rope_override(str(path), {"rope_parameters": {**yarn, "rope_theta": theta}})
    check_rope_override(str(path), {"max_position_embeddings": 4096})
    with pytest.raises(ValueError, match="rope_theta"):
        check_rope_override(str(path), {"rope_parameters": yarn})
    with pytest.raises(ValueError, match="rope_theta"):
        check_rope_override(str(path), {"rope_parameters": {**yarn, "rope_theta": theta * 2}})


def test_rope_override_under_text_config(tmp_path):
    from transformers.models.qwen3_5 import Qwen3_5Config

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, head_dim=16, rope_parameters=rope)
    Qwen3_5Config(text_config=text).save_pretrained(tmp_path)
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768}
    check_rope_override(str(tmp_path), {"text_config": {"rope_parameters": {**rope, **yarn}}})
    with pytest.raises(ValueError, match="mrope_section"):
        check_rope_override(str(tmp_path), {"text_config": {"rope_parameters": {**rope, **yarn, "mrope_section": []}}})


# ------------------------------------------------------------------------------------------ publishable configs
def sample_config(tmp_path) -> LongStrawGRPOConfig:
    return LongStrawGRPOConfig(
        output_dir=str(tmp_path / "out"),
        prompt_gradient="detached",
        prefill_chunk_size=777,
        group_shuffle=False,
        prefill_progress=False,
        learning_rate=3e-4,
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        loss_type="bnpo",
        beta=0.04,
        reward_weights=[1.0, 0.0],
        model_init_kwargs={"rope_parameters": {"rope_type": "yarn", "factor": 8.0}},
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        report_to="none",
        hub_token="secret",
    )


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_round_trips(tmp_path, suffix):
    config = sample_config(tmp_path)
    path = save_config(config, tmp_path / f"config{suffix}")
    assert "secret" not in path.read_text()
    loaded = load_config(path)
    assert isinstance(loaded, LongStrawGRPOConfig)
    assert config_to_dict(loaded) == config_to_dict(config)
    for name in (
        "prompt_gradient",
        "prefill_chunk_size",
        "group_shuffle",
        "prefill_progress",
        "generation_batch_size",
    ):
        assert getattr(loaded, name) == getattr(config, name)
    assert loaded.model_init_kwargs == config.model_init_kwargs
    assert loaded.hub_token is None


def test_config_from_dict_validates():
    with pytest.raises(ValueError, match="prompt_gradient"):
        config_from_dict({"prompt_gradient": "approximate", "bf16": False})


def test_save_config_needs_a_known_suffix(tmp_path):
    with pytest.raises(ValueError, match="json"):
        save_config(sample_config(tmp_path), tmp_path / "config.toml")


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "qwen3.6-27b_8xh20_2.1m_exact.yaml", "glm-5.2_32xh20_2.1m.yaml"])
def test_hub_export_folder(tmp_path, name):
    source = ROOT / "recipes" / "configs" / name
    out = export(source, tmp_path / "hub")
    launch = launch_command(source.read_text())
    accelerate = ["accelerate.yaml"] if "--config_file" in launch else []
    assert sorted(p.name for p in out.iterdir()) == ["README.md", *accelerate, "config.json", "config.yaml"]
    if accelerate:
        named = launch.split("--config_file ")[1].split()[0]
        assert (out / "accelerate.yaml").read_text() == (ROOT / named).read_text()
    assert (out / "config.yaml").read_text() == source.read_text()
    assert json.loads((out / "config.json").read_text()) == yaml.safe_load(source.read_text())
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "trl"
    assert set(CARD_TAGS) <= set(meta["tags"]) and set(CARD_TAGS) == {"trl", "grpo", "longstraw"}
    assert launch in card
    # The card launches the installed command on the downloaded files, not a checkout's paths.
    installed = installed_launch_command(
        source.read_text(), f"{source.stem}/config.yaml", f"{source.stem}/accelerate.yaml" if accelerate else None
    )
    assert f"\n{installed}\n" in card
    # trl_longstraw is not on PyPI: the card installs it from its source, and claims no package.
    assert "not published on PyPI: `pip install .` in a checkout" in card and "pip install trl_longstraw" not in card
    assert "recipes/" not in installed and "trl_longstraw.cli grpo" in installed
    mapping = yaml.safe_load(source.read_text())
    if not mapping["model_name_or_path"].startswith("longstraw/"):
        assert meta["base_model"] == mapping["model_name_or_path"]
    # The exported JSON is itself a recipe config (JSON is YAML) that parses to the same arguments.
    assert same(parse_recipe_config(out / "config.json"), parse_recipe_config(source))


def test_hub_export_command(tmp_path, capsys):
    assert main(["export", "--config", str(TINY), "--out", str(tmp_path / "dir"), "--repo-id", "me/tiny"]) == 0
    assert "README.md" in capsys.readouterr().out
    card = (tmp_path / "dir" / "README.md").read_text()
    assert "hf download me/tiny config.yaml" in card and "# tiny_cpu:" in card


def test_hub_export_refuses_a_config_without_launch_line(tmp_path):
    config = tmp_path / "x.yaml"
    config.write_text("\n".join(TINY.read_text().splitlines()[1:]) + "\n")
    with pytest.raises(ValueError, match="# Launch:"):
        export(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_launch_command_joins_continuation_lines():
    text = "# Launch: accelerate launch \\\n#   --num_processes 8 \\\n#   recipes/grpo_long.py\n# other\nkey: 1\n"
    assert launch_command(text) == "accelerate launch --num_processes 8 recipes/grpo_long.py"


@pytest.mark.parametrize(
    ("launch", "installed"),
    [
        (
            "python recipes/grpo_long.py --config a/b.yaml --max_steps 2",
            "trl-longstraw grpo --config c.yaml --max_steps 2",
        ),
        ("recipes/grpo_long.py --config a/b.yaml", "trl-longstraw grpo --config c.yaml"),
        (
            "accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 8 recipes/grpo_long.py \\\n"
            "#   --config a/b.yaml",
            "accelerate launch --config_file d.yaml --num_processes 8 -m trl_longstraw.cli grpo --config c.yaml",
        ),
        (
            "torchrun --nproc_per_node 2 recipes/grpo_long.py --config a/b.yaml",
            "torchrun --nproc_per_node 2 -m trl_longstraw.cli grpo --config c.yaml",
        ),
    ],
)
def test_installed_launch_command(launch, installed):
    assert installed_launch_command(f"# Launch: {launch}\nkey: 1\n", "c.yaml", "d.yaml") == installed


def test_installed_launch_command_needs_the_recipe_and_its_config():
    with pytest.raises(ValueError, match="recipes/grpo_long.py --config"):
        installed_launch_command("# Launch: python train.py --config a.yaml\n", "c.yaml")


# ------------------------------------------------------------------------------------------- multi-process runs
# One process of the recipe through the real command line (progress bar, metrics, summary, checkpoint) is
# tests/test_cli.py::test_installed_command_runs_outside_the_checkout, which runs the installed `trl-longstraw`
# command that recipes/grpo_long.py wraps; the launches below run recipes/grpo_long.py itself.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_recipe_on_two_processes_with_sharded_state(tmp_path, family):
    """`accelerate launch --multi_gpu --num_processes 2` of the recipe on CPU (gloo), the prompt state sharded over
    both processes: each step's 8 completions are spread 4 per process, and the run ends with its summary.

    llama runs the README's two-process line (warm-up and held-out accuracy included); qwen3_5 (the hybrid model's
    sharded decoding and passes through the recipe) skips both, which do not depend on the family. glm_moe_dsa runs
    with a sharded state in test_recipe_expert_parallel_on_two_processes, the same launch plus expert parallelism."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--main_process_port", "0", "recipes/grpo_long.py", "--config", str(TINY)]
    command += ["--model_name_or_path", f"longstraw/tiny-{family}", "--max_steps", "2", "--num_prompts", "8"]
    command += ["--shard_prompt_state", "true", "--per_device_train_batch_size", "4"]
    command += ["--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path)]
    if family != "llama":
        command += ["--warmup_sft_steps", "0", "--heldout_prompts", "0"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "rror" in line or "terminate" in line or "what()" in line]
    assert result.returncode == 0, "\n".join(errors[:40]) + "\n" + output[-3000:]
    assert "processes               2, prompt state sharded over groups of 2" in result.stdout
    assert "prompt positions        383 prefilled per micro-batch" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_expert_parallel_on_two_processes(tmp_path):
    """The recipe with `--expert_parallel_size 2` on 2 CPU processes (gloo): transformers loads the tiny GLM-5 with 2
    of its 4 experts per rank, the run generates, trains 2 steps and saves a checkpoint (`save_only_model`) that
    loads whole, with all 4 experts of each MoE layer, trained away from the initial weights."""
    import torch
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--main_process_port", "0", "recipes/grpo_long.py", "--config", str(TINY)]
    command += ["--model_name_or_path", "longstraw/tiny-glm_moe_dsa", "--max_steps", "2", "--num_prompts", "8"]
    command += ["--shard_prompt_state", "true", "--per_device_train_batch_size", "4"]
    command += ["--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path), "--expert_parallel_size", "2"]
    command += ["--save_only_model", "true", "--save_strategy", "steps", "--save_steps", "2"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "rror" in line or "terminate" in line or "what()" in line]
    assert result.returncode == 0, "\n".join(errors[:40]) + "\n" + output[-3000:]
    assert "processes               2, prompt state sharded over groups of 2" in result.stdout
    assert "prompt positions        383 prefilled per micro-batch" in result.stdout
    trained = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2").named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-model").named_parameters())
    experts = [name for name in initial if name.endswith("experts.gate_up_proj")]
    assert experts and all(trained[name].shape == initial[name].shape == (4, 32, 64) for name in experts)
    assert any(not torch.equal(trained[name], initial[name]) for name in experts)
