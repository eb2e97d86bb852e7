"""PagedKVCache: the per-layer K/V tensors of the block pool, written by slot mapping.

Token position ``t`` of a request with block table ``table`` lives at slot
``table[t // P] * P + t % P``; slot ``s`` is row ``s % P`` of block ``s // P``. The pool
is one tensor ``[L, 2, NB, P, Hkv, D]``; layer ``l``'s K and V are contiguous views of it.
A keys-only pool (``keys_only=True``: DeepSeek-V3's latent rows, one per token and layer)
is ``[L, 1, NB, P, Hkv, D]``: no value plane.
"""

from __future__ import annotations

import math
import mmap

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from deepinfer_kit._kernels import Impl, resolve_impl
from deepinfer_kit._staging import to_device
from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import CapacityError, ConfigError, DeviceUnavailableError, InvariantError

__all__ = ["PagedKVCache", "Impl"]

_WriteOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_CopyOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class PagedKVCache:
    """K/V storage for every layer, addressed by physical block and offset.

    Allocated zero-filled at construction (so never-written slots hold finite values);
    on the CPU from an anonymous memory mapping, whose pages the OS zeroes when first
    touched, so a pool costs time and resident memory only for the blocks written.
    Afterwards it is mutated only by :meth:`write` and :meth:`copy_blocks`. One scratch
    block beyond the ``NB`` addressable ones holds :attr:`pad_slot`, where the padded rows
    of a static-shape step write their K/V without touching a live block. The
    implementation of both (torch reference or Triton kernels) is chosen once here:
    ``impl="auto"`` picks Triton on a CUDA device, the reference elsewhere.

    ``keys_only=True`` holds one tensor per token and layer instead of a key and a value
    (the multi-head latent attention row of DeepSeek-V3: ``Hkv = 1``, ``D = kv_lora_rank +
    qk_rope_head_dim``; ``ModelConfig.cache_row`` says which a model needs): half the
    bytes of a K/V pool of the same ``Hkv x D``, nothing stored twice. Its
    :meth:`value_cache` is the keys view (the latent attention reads its values out of
    the same rows), :meth:`write` stores only ``key``, and block copies use the torch
    reference op whatever ``impl`` (the Triton copy kernel addresses two planes per layer).

    Raises:
        ConfigError: a size is not a positive int, ``dtype`` is not floating point, or
            ``impl`` is unknown.
        DeviceUnavailableError: ``device`` is CUDA on a machine without it, or
            ``impl="triton"`` without CUDA and without ``TRITON_INTERPRET=1`` (or without
            Triton installed).
        CapacityError: the device cannot allocate the pool (names the bytes asked for and
            ``num_blocks``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        impl: Impl = "auto",
        keys_only: bool = False,
    ) -> None:
        if not isinstance(keys_only, bool):
            raise ConfigError(f"keys_only must be a bool, got {keys_only!r}")
        require_ints_at_least(1, 
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {str(dev)!r} asked for, but CUDA is not available")
        self._write_op, self._copy_op, self._impl = _select_ops(impl, dev)
        self._keys_only = keys_only
        if keys_only:  # the Triton copy kernel walks two planes per layer
            from deepinfer_kit.cache import ref_ops

            self._copy_op = ref_ops.copy_blocks
        # num_blocks + 1: the last block is the scratch block of ``pad_slot``.
        shape = (num_layers, 1 if keys_only else 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        try:
            self._kv = _zeroed(shape, dtype, dev)
        except (RuntimeError, MemoryError, OSError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            per_block = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype,
                                             keys_only=keys_only)
            nbytes = num_blocks * per_block
            planes = "keys only" if keys_only else "K and V"
            raise CapacityError(
                f"cannot allocate the KV cache pool on {dev}: {nbytes} bytes for "
                f"num_blocks={num_blocks} (blocks of {block_size} tokens x {num_layers} layers x "
                f"{num_kv_heads} KV heads x {head_dim} dims, {dtype}, {planes}); lower num_blocks "
                f"(the engine's num_blocks or kv_cache_memory_mb): {str(exc).splitlines()[0]}"
            ) from exc

    @property
    def num_layers(self) -> int:
        """``L``."""
        return self._kv.shape[0]

    @property
    def num_blocks(self) -> int:
        """``NB``, blocks in the pool (the scratch block of :attr:`pad_slot` not counted)."""
        return self._kv.shape[2] - 1

    @property
    def pad_slot(self) -> int:
        """A slot outside every addressable block (``NB * P``): a :meth:`write` there is
        discarded from the point of view of attention, which reads only blocks
        ``[0, NB)``. The padded rows of a static-shape (captured) step write here; it may
        repeat in one ``slot_mapping``."""
        return self.num_blocks * self.block_size

    @property
    def block_size(self) -> int:
        """``P``, token slots per block."""
        return self._kv.shape[3]

    @property
    def num_kv_heads(self) -> int:
        """``Hkv``."""
        return self._kv.shape[4]

    @property
    def head_dim(self) -> int:
        """``D``."""
        return self._kv.shape[5]

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stored K/V."""
        return self._kv.dtype

    @property
    def device(self) -> torch.device:
        """Where the pool lives."""
        return self._kv.device

    @property
    def impl(self) -> Literal["ref", "triton"]:
        """The implementation chosen at construction."""
        return self._impl

    @property
    def keys_only(self) -> bool:
        """One tensor per token and layer (no value plane); see the class docstring."""
        return self._keys_only

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[NB, P, Hkv, D]``: a contiguous view (writes show)."""
        return self._kv[layer, 0, :-1]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, ``[NB, P, Hkv, D]``: a contiguous view (writes show).
        A keys-only pool has no values: the keys view."""
        return self._kv[layer, -1, :-1]

    def slot_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V with the scratch block, ``[NB + 1, P, Hkv, D]`` each:
        contiguous views that slot ``s`` (``[0, NB * P]``, :attr:`pad_slot` included)
        addresses as row ``s``. Called by the model's fused RoPE + KV-write kernel, which
        writes them in place. A keys-only pool returns its keys twice."""
        return self._kv[layer, 0], self._kv[layer, -1]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer; called by the model before attention.

        Args:
            layer: in ``[0, L)``.
            key, value: ``[T, Hkv, D]`` on the pool's device; cast to the pool dtype. A
                keys-only pool stores ``key`` and does not read ``value`` beyond its shape
                (pass the key again).
            slot_mapping: ``[T]`` int64 distinct slots in ``[0, NB * P)``, or
                :attr:`pad_slot` (which may repeat) for a padded row (not checked on the
                device: an out-of-range slot is a caller bug).

        Raises:
            InvariantError: shapes disagree with the pool or with each other.
        """
        t = slot_mapping.shape[0]
        expected = (t, self.num_kv_heads, self.head_dim)
        if key.shape != expected or value.shape != expected or slot_mapping.dim() != 1:
            raise InvariantError(
                f"write expects key/value of shape {list(expected)} and slot_mapping [T]; got "
                f"key {list(key.shape)}, value {list(value.shape)}, "
                f"slot_mapping {list(slot_mapping.shape)}"
            )
        if t and self._keys_only:  # the ops write both planes: the key twice, same values
            self._write_op(self._kv[layer, 0], self._kv[layer, 0], key, key, slot_mapping)
        elif t:
            self._write_op(self._kv[layer, 0], self._kv[layer, 1], key, value, slot_mapping)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` in every layer, K and V (copy-on-write;
        the keys of a keys-only pool).

        Called by the runner before the forward whose writes go to ``dst``. Other blocks
        are unchanged.

        Raises:
            InvariantError: a block id is out of range, a ``dst`` repeats, or a ``dst`` is
                also a ``src`` (the copies must not depend on their order).
        """
        if not pairs:
            return
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        n = self.num_blocks
        if any(not 0 <= b < n for b in src + dst):
            raise InvariantError(f"copy_blocks: block ids must be in [0, {n}), got {list(pairs)}")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise InvariantError(
                f"copy_blocks: destinations must be distinct and not sources, got {list(pairs)}"
            )
        # One pinned, non-blocking copy on CUDA: called inside a step's launch, where a copy
        # from pageable memory would make the host wait for the forward in flight.
        ids = to_device(src + dst, torch.int64, self._kv.device)
        self._copy_op(self._kv, ids[: len(src)], ids[len(src) :])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer as the KV tiers store it: ``[L, planes, P, Hkv, D]``
        (``planes`` 2, or 1 for a keys-only pool)."""
        L, planes, _, P, H, D = self._kv.shape
        return (L, planes, P, H, D)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s K/V of ``blocks`` (int64 ``[n]`` on the pool's device) as a new
        ``[n, planes, P, Hkv, D]`` tensor on the pool's device (the KV tiers' save, layer
        by layer). Mutates nothing."""
        return self._kv[layer].index_select(1, blocks).transpose(0, 1)

    def write_blocks(self, layer: int, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite layer ``layer``'s K/V of ``blocks`` (int64 ``[n]``, distinct, on the
        pool's device) with ``data`` (``[n, planes, P, Hkv, D]``, same device and dtype):
        the KV tiers' load, layer by layer, before the forward that reads them."""
        self._kv[layer].index_copy_(1, blocks, data.transpose(0, 1))

    def copy_scratch(self) -> None:
        """Run :meth:`copy_blocks`' op on one pair that copies the scratch block of
        :attr:`pad_slot` onto itself (warm-up: it compiles the copy and changes no
        block)."""
        scratch = torch.full((1,), self.num_blocks, dtype=torch.int64, device=self._kv.device)
        self._copy_op(self._kv, scratch, scratch)

    def nbytes(self) -> int:
        """Bytes of the pool's addressable blocks (the scratch block not counted)."""
        return self._kv[:, :, :-1].numel() * self._kv.element_size()

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        *, keys_only: bool = False,
    ) -> int:
        """Bytes one block takes across all layers, K and V: ``2 * L * P * Hkv * D * itemsize``
        (``keys_only``: ``L * P * Hkv * D * itemsize``).

        Use it to size the pool from a memory budget: ``num_blocks = budget // bytes``.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (1 if keys_only else 2) * num_layers * block_size * num_kv_heads * head_dim * itemsize


def _select_ops(impl: str, device: torch.device) -> tuple[_WriteOp, _CopyOp, Literal["ref", "triton"]]:
    if resolve_impl(impl, on_cuda=device.type == "cuda") == "ref":
        from deepinfer_kit.cache import ref_ops

        return ref_ops.write_kv, ref_ops.copy_blocks, "ref"
    import deepinfer_kit.cache.triton_ops as triton_ops

    return triton_ops.write_kv, triton_ops.copy_blocks, "triton"


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape``. On the CPU its memory is an anonymous mapping, whose
    pages the OS hands out zeroed when first touched: building a pool costs nothing until
    its blocks are written, and holds only the pages in use (``torch.zeros`` writes every
    byte at once: 0.12 s and 512 MiB resident for the default CPU pool before any
    request). Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # anonymous, private: zero-filled on first touch
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
