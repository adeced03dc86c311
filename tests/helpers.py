"""Builders shared by the tests: paired stock/LongStraw trainers, gradient comparison, and the launch of the
multi-process workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig

from tests.tolerances import GRAD_RTOL
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.reference import detached_prompt_logps


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def base_args(**overrides) -> dict:
    args = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=9,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        gradient_checkpointing=False,
    )
    args.update(overrides)
    return args


def make_trainer(path, cls=LongStrawGRPOTrainer, **overrides):
    """A trainer on the model saved at `path`, ready for `training_step` on hand-built micro-batches."""
    config_cls = LongStrawGRPOConfig if cls is LongStrawGRPOTrainer else GRPOConfig
    kw = base_args(**overrides)
    if config_cls is GRPOConfig:
        for key in ("prompt_gradient", "prefill_chunk_size", "group_shuffle", "prefill_progress"):
            kw.pop(key, None)
    trainer = cls(str(path), zero_reward, config_cls(**kw), train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}))
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    if trainer.args.gradient_checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return trainer


def detached_reference(path, **overrides):
    """A stock `GRPOTrainer` whose log-probs come from `reference.detached_prompt_logps`: stock's loss and backward on
    a plain detached-prompt forward (the prompt without autograd, each completion on a fresh copy of the cache).

    transformers drops the cache under gradient checkpointing, so the reference always runs without it.
    """
    from trl import GRPOTrainer

    return score_detached(make_trainer(path, GRPOTrainer, **{**overrides, "gradient_checkpointing": False}))


def score_detached(trainer):
    """Makes a stock `GRPOTrainer` (built without gradient checkpointing) score every log-prob, old-policy and
    reference ones included, with `reference.detached_prompt_logps` on its policy model."""
    causal_lm = trainer.model

    def plain(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kwargs):
        lp, ent = detached_prompt_logps(causal_lm, input_ids, attention_mask, logits_to_keep, trainer.temperature)
        return lp, ent if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = plain
    return trainer


def run_steps(trainer, micro_batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Accumulates `training_step` over `micro_batches`; returns the losses and the parameter gradients."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    losses = [float(trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])) for mb in micro_batches]
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return losses, grads


def assert_grads_close(ours: dict, ref: dict, rtol: float = GRAD_RTOL) -> float:
    """Every parameter that has a reference gradient has ours, within `rtol` relative error in norm."""
    assert ref, "the reference produced no gradient"
    assert set(ours) == set(ref), f"gradients differ in which parameters they reach: {set(ours) ^ set(ref)}"
    worst = 0.0
    for name, g in ref.items():
        err = ((ours[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
        assert err <= rtol, f"{name}: relative gradient error {err:.3e} > {rtol:.1e}"
    return worst


def rebind_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
    """For the detached reference on Qwen3.5 (patch `transformers.cache_utils.LinearAttentionLayer` with it): stock
    `LinearAttentionLayer.update_recurrent_state`, storing the new state instead of copying it into the old
    one: the in-place copy overwrites a tensor that the branch's own graph saved, so backward fails."""
    if not self.is_recurrent_states_initialized[state_idx]:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
    self.recurrent_states[state_idx] = recurrent_states
    return recurrent_states


ROOT = Path(__file__).resolve().parent.parent


class Launch:
    """One `torchrun` launch of test worker cases (see `torchrun`), running in the background until waited for."""

    def __init__(self, what: str, cases: dict[str, tuple[str, list]], tmp: Path, nproc: int, timeout: float):
        self.what, self.timeout, self.tmp = what, timeout, tmp
        spec = {"world": nproc, "cases": []}
        self.outputs: dict[str, Path] = {}
        for name, (worker, args) in cases.items():
            self.outputs[name] = tmp / f"{name}.pt"
            spec["cases"].append({"name": name, "worker": worker, "args": [*map(str, args), str(self.outputs[name])]})
        (tmp / "cases.json").write_text(json.dumps(spec))
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        command += [str(ROOT / "tests" / "torchrun_main.py"), str(tmp / "cases.json")]
        # Output to a file, not a pipe that nobody reads while the test process works (a full pipe would block the
        # workers); a session of its own, so that a hang is ended with the workers, not only the launcher.
        with open(tmp / "output.log", "w") as log:
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.deadline = time.monotonic() + timeout
        self.code: int | None = None
        self.output: str | None = None
        self.loaded: dict = {}

    def wait(self) -> None:
        """Waits for the launch to end, at most until `timeout` seconds after its start; past it (a hang: collectives
        that did not meet), ends the launcher and its workers (`code` stays None)."""
        if self.output is not None:
            return
        try:
            self.code = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._end()
        self.output = (self.tmp / "output.log").read_text()  # the cases' CPU and wall seconds among it

    def _end(self) -> None:
        # torchrun starts each worker in a session of its own: SIGTERM makes it end them before it exits.
        with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        """Ends a launch whose results no test asked for (all deselected, the session interrupted) instead of waiting
        for it; leaves no worker behind."""
        if self.proc.poll() is None:
            self._end()

    def result(self, case: str):
        """What rank 0 wrote for `case`, once the launch has run to its end cleanly: no rank hung (all finished
        within the timeout), every rank exited 0, and none printed a traceback."""
        self.wait()
        tail = self.output[-6000:]
        assert self.code is not None, f"{self.what} did not finish in {self.timeout} s (a hang?):\n{tail}"
        assert self.code == 0, f"{self.what} failed (exit {self.code}):\n{tail}"
        assert "Traceback" not in self.output, f"{self.what} printed a traceback:\n{tail}"
        assert self.outputs[case].exists(), f"{self.what}: case {case} wrote no results:\n{tail}"
        if case not in self.loaded:
            self.loaded[case] = torch.load(self.outputs[case], weights_only=False)
        return self.loaded[case]


def torchrun(what: str, cases: dict[str, tuple[str, list]], tmp: Path, nproc: int, timeout: float) -> Launch:
    """Starts the worker cases on `nproc` CPU processes (gloo) in one `torchrun` launch of tests/torchrun_main.py,
    in the background: the test process can compute its single-process references meanwhile. `Launch.result` waits.

    `cases` maps a case's name to `(worker, arguments)`: the worker's `main(*arguments, results path)` runs it (a
    worker `"module:function"` runs that function instead; modules of tests/); the path of the case's results file is
    appended to its arguments. Process start and the import of torch, transformers and TRL are paid once for all the
    cases. `timeout` (seconds from the start) bounds the whole launch. Use the launch as a context manager (a fixture
    yields it inside `with`), so that it is ended if no test asks for its results.
    """
    return Launch(what, cases, tmp, nproc, timeout)


def selected(request, name: str) -> bool:
    """Whether this session runs the test function `name` (any of its parametrizations) of the requesting fixture's
    module: a launch started with a module's first test, so that it runs while the module's single-process tests do,
    is started only when a test will ask for its results."""
    return any(
        getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == name
        for item in request.session.items
    )
