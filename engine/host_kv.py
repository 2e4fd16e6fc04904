"""The host side of KV swapping on one rank: the host pool's memory and each step's copies (``cache.swap``
keeps the books and says which blocks move; the model runner calls ``HostKVCache.swap`` before a forward).

On CUDA the host pool is pinned and the copies run on two side streams. A swap-out first gathers its device
blocks into one staging tensor (a device kernel, microseconds); the forward waits for that gather only, since
from then on the freed blocks may be rewritten, and the device-to-host copies run beside the forward. A
swap-in must land before the forward reads it, so the forward waits for it. On the CPU these are plain copies.
"""

from __future__ import annotations

import torch


class HostKVCache:
    """Host blocks ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so one
    block is one contiguous copy (the device cache is layer-major: one block is ``2 * num_layers`` pieces)."""

    def __init__(self, device_cache: torch.Tensor, num_blocks: int) -> None:
        num_layers, two, _, block_size, num_kv_heads, head_dim = device_cache.shape
        self.device = device_cache.device
        on_cuda = self.device.type == "cuda"
        self.blocks = torch.zeros(
            (num_blocks, num_layers, two, block_size, num_kv_heads, head_dim),
            dtype=device_cache.dtype,
            pin_memory=on_cuda,
        )
        self.out_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.in_stream = torch.cuda.Stream(self.device) if on_cuda else None

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def swap(self, kv_cache: torch.Tensor, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Run one step's swap-outs (device block, host block), then its swap-ins (host block, device block)."""
        if self.out_stream is None or self.in_stream is None:
            if swap_out:
                self._copy_out(kv_cache, swap_out)
            if swap_in:
                self._copy_in(kv_cache, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        if swap_out:
            self.out_stream.wait_stream(compute)  # the blocks' last writes (steps still in flight included)
            with torch.cuda.stream(self.out_stream):
                gathered = self._copy_out(kv_cache, swap_out)
            assert gathered is not None
            compute.wait_event(gathered)
        if swap_in:
            self.in_stream.wait_stream(self.out_stream)  # host blocks that earlier swap-outs are still writing
            self.in_stream.wait_stream(compute)
            with torch.cuda.stream(self.in_stream):
                self._copy_in(kv_cache, swap_in)
            compute.wait_stream(self.in_stream)

    def _copy_out(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.cuda.Event | None:
        by_host = dict((host, dev) for dev, host in pairs)  # a host block written twice: the last copy wins
        host_ids = list(by_host)
        index = torch.tensor(list(by_host.values()), dtype=torch.long).to(self.device, non_blocking=True)
        # [num_layers, 2, k, block_size, heads, head_dim] -> [k, num_layers, 2, block_size, heads, head_dim]
        staged = kv_cache[:, :, index].permute(2, 0, 1, 3, 4, 5).contiguous()
        event = None
        if self.out_stream is not None:
            event = torch.cuda.Event()
            event.record(self.out_stream)
        for j, host_id in enumerate(host_ids):
            self.blocks[host_id].copy_(staged[j], non_blocking=True)
        return event

    def _copy_in(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        by_device = dict((dev, host) for host, dev in pairs)  # a device block written twice: the last copy wins
        staged = torch.empty((len(by_device), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=self.device)
        for j, host_id in enumerate(by_device.values()):
            staged[j].copy_(self.blocks[host_id], non_blocking=True)
        index = torch.tensor(list(by_device), dtype=torch.long).to(self.device, non_blocking=True)
        kv_cache[:, :, index] = staged.permute(1, 2, 0, 3, 4, 5)  # [num_layers, 2, k, block_size, heads, head_dim]
