"""The script that `tests.helpers.torchrun` launches on every rank: it runs the `main` of the multi-process test
workers (`dist_worker`, `group_worker`, `ep_worker`, `ep_generate_worker`, `cp_worker`, `decode_worker`,
`offer_worker`), case by case.

One launch runs every case of a test module (one per model family, say) in the same processes, one after the other:
process start and the import of torch, transformers and TRL (5 to 15 s each) are paid once per module, not once per
case. Each case writes its own results file, so the tests still assert on each case separately.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

# The default generator's seed in a fresh process: every case starts from it, as it would in a launch of its own.
FRESH_SEED = torch.initial_seed()


def run(cases_path: str) -> None:
    """Runs the cases listed in `cases_path` (JSON, written by `tests.helpers.torchrun`) one after the other, prints
    any exception, destroys the process group and exits with 0 or 1.

    Each case is `{"name": ..., "worker": "module" or "module:function" of tests/, "args": [...]}`: the worker's
    `main(*args)` (or `function(*args)`) runs it, its last argument the path its rank 0 writes the results to. After
    each case the ranks, which must number the launch's `world`, meet at a barrier. The exit is explicit
    (`os._exit`): gloo FSDP runs can abort while the interpreter tears down after passing.
    """
    code = 0
    try:
        with open(cases_path) as f:
            spec = json.load(f)
        for case in spec["cases"]:
            start = time.process_time(), time.perf_counter()
            torch.manual_seed(FRESH_SEED)
            module, _, function = case["worker"].partition(":")
            main: Callable[..., None] = getattr(importlib.import_module(module), function or "main")
            main(*case["args"])
            cpu, wall = time.process_time() - start[0], time.perf_counter() - start[1]
            print(f"rank {os.environ.get('RANK')}: case {case['name']}: {cpu:.1f} CPU-s, {wall:.1f} s", flush=True)
            assert dist.is_initialized(), "the worker set up no process group"
            world = dist.get_world_size()
            assert world == spec["world"], f"the launch asked for {spec['world']} processes, the group has {world}"
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    # The workers import each other (`from dist_worker import ...`) and the package from the checkout.
    sys.path[:0] = [
        os.path.dirname(os.path.abspath(__file__)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ]
    run(sys.argv[1])
