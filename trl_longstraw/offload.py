"""Host memory for the exact-mode recurrent boundary states (`offload_boundary_states`).

In exact mode the prefill keeps, for every recurrent layer (Gated DeltaNet), its state at the end of every prompt
chunk: the reverse pass restarts chunk `c` from the state after chunk `c - 1`. These *boundaries* are cold from the
moment the next chunk supersedes them until the reverse pass reaches them, and on Qwen3.6-27B one boundary is
147 MiB, so a 2.1M-token prompt in chunks of 4096 holds 513 of them (74 GiB; a sharded state holds its 1/W share).

`HostBoundaries` moves each boundary to host memory as soon as the prefill supersedes it (pinned memory when the
device is CUDA, so that copies are asynchronous DMA) and brings it back in the reverse pass one chunk ahead: while
chunk `c` is recomputed, boundary `c - 2` is copied to the device on a side stream, and it is installed in the state
(as a fresh leaf that requires grad, as the prefilled records are) just before the reverse pass needs it. Copies are
bit-exact, so gradients are identical to keeping the boundaries on the device. Only the newest record of each layer
stays on the device, which the branches read.

On CPU the "host" copies are plain copies in the same memory (nothing is saved); the path runs anyway, so that it is
tested without a GPU.
"""

from __future__ import annotations

import contextlib

import torch

Record = tuple[torch.Tensor, ...]


class HostBoundaries:
    """The boundary records of one prompt state held in host memory, by chunk then layer.

    Args:
        device: the device the prompt state lives on; pinned memory and a side stream are used when it is CUDA.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.held: dict[int, dict[int, Record]] = {}
        # Reverse pass: chunk -> layer -> device copies in flight on the side stream.
        self._fetched: dict[int, dict[int, Record]] = {}
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for layers in self.held.values() for r in layers.values() for t in r)

    def stash(self, records: dict[int, list[Record | None]], layers: set[int], chunk: int) -> None:
        """Moves the records of `chunk` of the recurrent `layers` to host memory; leaves `None` in their place.

        Called by the prefill once chunk `chunk + 1` has superseded them. The device-to-host copy is queued on the
        current stream (into pinned memory, so it does not block the host); the device memory is reused only by later
        work on that stream, which runs after the copy.
        """
        for layer in sorted(layers):
            record = records[layer][chunk]
            if record is None:  # a sharded state: another rank owns this boundary
                continue
            self.held.setdefault(chunk, {})[layer] = tuple(self._to_host(t) for t in record)
            records[layer][chunk] = None

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        return host

    def prefetch(self, chunk: int) -> None:
        """Starts copying the boundary of `chunk` back to the device (side stream on CUDA). No-op if none is held."""
        layers = self.held.pop(chunk, None)
        if layers is None:
            return
        stream = self._stream
        if stream is not None:
            # The host copies were queued on the current stream by `stash`: the side stream reads them after that.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._fetched[chunk] = {
                layer: tuple(t.to(self.device, non_blocking=True) for t in record) for layer, record in layers.items()
            }

    def restore(self, records: dict[int, list[Record | None]], chunk: int) -> None:
        """Installs the boundary of `chunk` in `records` as leaves that require grad, waiting for its copy.

        Prefetches it first if `prefetch(chunk)` was not called. No-op if no boundary of `chunk` is held here.
        """
        if chunk not in self._fetched:
            self.prefetch(chunk)
        layers = self._fetched.pop(chunk, None)
        if layers is None:
            return
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            for record in layers.values():
                for t in record:
                    # Allocated on the side stream, used and freed on the current one.
                    t.record_stream(current)
        for layer, record in layers.items():
            records[layer][chunk] = tuple(t.requires_grad_(True) for t in record)
