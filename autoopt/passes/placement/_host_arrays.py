"""What the placer, the constant cache and the packer need to know about a host array.

* **Alignment.** XLA:CPU aliases (zero-copies) a host buffer that is 64-byte aligned instead of
  copying it, for as long as a computation reads it: the packer allocates such buffers on purpose
  (``aligned_empty``, ``_packing.Pool``), the constant cache copies them before placing
  (``_host_constants``), and the placer leaves a large one to jit's zero-copy path.
* **Read-only.** A NumPy array that nothing can write through NumPy now (``is_read_only``): the
  findings point such an argument at ``autoopt.constant``. It is not proof that the array never
  changes (the flag can be switched back on), so nothing is cached on its account.
* **Leaf types.** Which leaf types are host arrays and host scalars, for one set test a leaf.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["aligned_empty", "is_read_only"]

# XLA:CPU aliases (zero-copies) a host buffer with this alignment instead of copying it.
_ALIGN = 64

NDARRAY_TYPES = frozenset({np.ndarray, np.memmap})
SCALAR_TYPES = frozenset({bool, int, float, complex}) | frozenset(np.sctypeDict.values())


def aligned_empty(n: int, dtype) -> np.ndarray:
    """A fresh 1-D array of ``n`` elements whose data is ``_ALIGN``-byte aligned.

    XLA:CPU aliases such a buffer for as long as a computation reads it, so a buffer is reused
    only once jax has let go of it (``_packing.Pool``).
    """
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + nbytes].view(dtype)


def is_aligned(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.__array_interface__["data"][0] % _ALIGN == 0


def _calibrate_base_refs() -> int:
    view = np.empty(2).reshape(1, 2)
    base = view.base
    return sys.getrefcount(base)


# References to a base array that only its view holds, as ``is_read_only`` counts them.
_PRIVATE_BASE_REFS = _calibrate_base_refs()


def is_read_only(a: np.ndarray) -> bool:
    """True when neither ``a`` nor any array it views can be written through NumPy.

    A read-only view of a writeable array that anything else refers to is *not* read-only: the
    base can still change. A writeable base that only the view refers to (the temporary in
    ``np.arange(n).reshape(r, c)``) can be reached only through ``a.base``, so it counts as
    read-only. Non-array bases (``bytes``, a read-only ``mmap``) are immutable buffers.
    """
    if a.flags.writeable:
        return False
    base = a.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable and sys.getrefcount(base) > _PRIVATE_BASE_REFS:
            return False
        base = base.base
    return not isinstance(base, bytearray | memoryview) or (
        isinstance(base, memoryview) and base.readonly
    )
