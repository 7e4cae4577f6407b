"""KunServe's KV pool resizing on one engine: drop decoder layers and grow the pool by their bytes,
bring them back and shrink it, or set the block count a pipeline group agrees on."""

from __future__ import annotations

from typing import Any

from tidal.engine.engine_core import EngineCore
from tidal.engine.kv_cache import kv_block_bytes


class PoolResizer:
    def __init__(self, core: EngineCore):
        self.core = core
        self.pool_spare_bytes = 0  # KV memory too small for one more block (after a drop / restore)
        self.dropped_weight_bytes: dict[int, int] = {}  # dropped layer -> its weights' bytes

    @property
    def pool_bytes(self) -> int:
        """The memory the KV pool may use: its blocks plus what is left over below one block."""
        return self.core.kv_cache.nbytes + self.pool_spare_bytes

    def _set_pool(self, num_blocks: int, mem: int) -> None:
        """Resize the pool to ``num_blocks`` within ``mem`` bytes (live blocks relocated on a
        shrink); the rest of ``mem`` stays as spare bytes."""
        kv_cache, kv_manager = self.core.kv_cache, self.core.kv_manager
        bpb = kv_cache.bytes_per_block
        if num_blocks * bpb > mem:
            raise ValueError(f"{num_blocks} blocks of {bpb} bytes do not fit in {mem} bytes")
        delta = num_blocks - kv_manager.num_blocks
        if delta >= 0:
            kv_manager.grow(delta)
            kv_cache.grow(delta)
        else:
            moves = kv_manager.shrink(-delta)
            if moves is None:
                raise ValueError(f"cannot shrink the KV pool to {num_blocks} blocks: "
                                 f"{kv_manager.num_blocks - kv_manager.num_free_blocks} are in use")
            kv_cache.shrink(-delta, moves)
        self.pool_spare_bytes = mem - num_blocks * bpb

    def drop_layers(self, layer_ids: list[int] | range) -> int:
        """KunServe Sec. 4.1's local memory manager: drop these decoder layers' weights and KV and
        grow the pool by the freed bytes; the pool then holds exactly ``(its KV bytes + the freed
        weight bytes) // bytes per block of the layers still here`` blocks. Block ids do not
        change (the new blocks come on top). Returns the new number of blocks."""
        model, kv_cache = self.core.model, self.core.kv_cache
        ids = sorted(set(layer_ids))
        present = set(model.layer_ids)
        if not ids or not set(ids) <= present:
            raise ValueError(f"layers {ids} are not all present here (present: {sorted(present)})")
        if len(ids) == len(present):
            raise ValueError("an instance keeps at least one decoder layer")
        if kv_cache.num_host_blocks and self.core.kv_manager.host_tier:
            raise ValueError("layers cannot be dropped with --kv-offloading-size: the host tier's cached blocks "
                             "hold every layer's KV")
        # a host pool for swap stays, for the layers kept; what it holds would lack the dropped layers, so the
        # swapped-out requests recompute, and the instance preempts by recompute while layers are dropped (its
        # requests' KV is spread over the group's stages: a swap copy here would lack the others' layers)
        sched = self.core.scheduler
        sched.recompute_swapped()
        sched.preemption_mode = "recompute"
        mem = self.pool_bytes  # before the drop: it includes the dropped layers' KV
        for i in ids:
            self.dropped_weight_bytes[i] = model.drop_layers([i])
            mem += self.dropped_weight_bytes[i]
        kv_cache.drop_layers(ids)
        self.core.kv_manager.reset_prefix_cache()  # cached blocks no longer hold every layer's KV
        self._set_pool(mem // kv_cache.bytes_per_block, mem)
        return self.core.kv_manager.num_blocks

    def stage_layer(self, layer_id: int) -> Any:
        """Sec. 4.4 overlapped with serving: load one dropped layer's weights beside the model
        (from the host copy, here the checkpoint) between steps; :meth:`restore_layers` with
        ``staged`` puts it in. The staged weights sit outside the pool until then (host memory
        here; a GPU would first shrink the pool to make room for them)."""
        if layer_id not in self.dropped_weight_bytes:
            raise ValueError(f"layer {layer_id} was not dropped here")
        return self.core.model.stage_layer(layer_id, self.core.checkpoint.weights())

    def restore_layers(self, layer_ids: list[int] | range, staged: dict[int, Any] | None = None) -> int:
        """Sec. 4.4: bring dropped layers back and shrink the pool by their weights and KV (live
        blocks relocated). Refused, changing nothing, when the blocks in use would not fit. Their
        KV starts empty: the requests in flight get theirs from the exchange back. ``staged``:
        layers already loaded by :meth:`stage_layer` (else they load now). Returns the new number
        of blocks."""
        core = self.core
        kv_cache, kv_manager = core.kv_cache, core.kv_manager
        ids = sorted(set(layer_ids))
        if not ids or not set(ids) <= set(self.dropped_weight_bytes):
            raise ValueError(f"layers {ids} were not dropped here")
        if staged is not None and sorted(staged) != ids:
            raise ValueError(f"staged layers {sorted(staged)} are not the layers to restore {ids}")
        mem = self.pool_bytes - sum(self.dropped_weight_bytes[i] for i in ids)
        bpb = kv_block_bytes(core.arch, kv_cache.block_size, core.kv_dtype, len(kv_cache.layers) + len(ids))
        n = max(0, mem) // bpb
        used = kv_manager.num_blocks - kv_manager.num_free_blocks
        if n < used:
            raise ValueError(f"cannot restore layers {ids}: {used} KV blocks are in use and only {n} would fit")
        # shrink at the current layers' block size (relocating live blocks), then add the layers
        self._set_pool(n, n * kv_cache.bytes_per_block)
        kv_cache.add_layers(ids)
        kv_manager.reset_prefix_cache()  # the restored layers' KV starts empty in every block
        self.pool_spare_bytes = mem - n * bpb
        # on CPU host memory is device memory: the "host copy" of every layer (Sec. 4.4, also
        # for fault tolerance) is the checkpoint file itself, read (mmapped) again here
        if staged is not None:
            core.model.insert_layers(staged)
        else:
            core.model.restore_layers(ids, core.checkpoint.weights())
        for i in ids:
            del self.dropped_weight_bytes[i]
        if not self.dropped_weight_bytes:  # whole again: it preempts as configured
            core.scheduler.preemption_mode = core.config.scheduler.preemption_mode
        return kv_manager.num_blocks

    def resize_pool(self, num_blocks: int) -> None:
        """Set the pool to ``num_blocks`` within its current bytes (a group's members agree on
        one block count: the tail's pool mirrors the head's)."""
        self._set_pool(num_blocks, self.pool_bytes)
