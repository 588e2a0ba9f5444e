"""Moving data between one maxpar parameter and its Hugging Face tensors, as a `TensorRule` says.

`maxpar_block` builds any block `leaf[index]` of a maxpar parameter (a device's shard) reading only
the bytes of the HF tensors that block needs; `hf_tensor` turns one stacked entry of a maxpar
parameter back into its HF tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from maxpar.convert.architectures import TensorRule

Reader = Callable[[str, tuple[slice, ...]], np.ndarray]  # (HF name, contiguous slices) -> tensor[slices]


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> list[range]:
    ranges = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"only contiguous slices are read, got {s}")
        ranges.append(range(start, stop))
    return ranges


def _flat(ranges: Sequence[Sequence[int]], shape: Sequence[int]) -> np.ndarray:
    """Row-major flat indices into `shape` of the block `ranges` (indices per dim), in the block's own row-major
    order."""
    if not ranges:
        return np.zeros((1,), np.int64)
    grids = np.meshgrid(*[np.asarray(r) for r in ranges], indexing="ij")
    return np.ravel_multi_index(tuple(grids), tuple(shape)).ravel()


def _linear_block(read: Reader, name: str, own_shape: Sequence[int], own: Sequence[Sequence[int]],
                  inputs: int) -> np.ndarray:
    """maxpar block of an nn.Linear weight [out, in]: read the bounding box of the rows and columns it needs."""
    cols = _flat(own[:inputs], own_shape[:inputs])
    rows = _flat(own[inputs:], own_shape[inputs:])
    r0, c0 = int(rows.min()), int(cols.min())
    box = read(name, (slice(r0, int(rows.max()) + 1), slice(c0, int(cols.max()) + 1)))
    block = box[np.ix_(rows - r0, cols - c0)].T  # [in, out] in the block's row-major order
    return block.reshape(tuple(len(r) for r in own))


def maxpar_block(rule: TensorRule, leaf_shape: Sequence[int], index: Sequence[slice], read: Reader) -> np.ndarray:
    """`leaf[index]` of the maxpar parameter `rule.path`, assembled from its HF tensors."""
    ranges = _bounds(index, leaf_shape)
    stacked, own = ranges[:len(rule.stacked)], ranges[len(rule.stacked):]
    own_shape = leaf_shape[len(rule.stacked):]
    if rule.order is not None:
        if rule.inputs is None or rule.inputs == len(own):
            raise ValueError(f"{rule.path}: a reordered axis must be an nn.Linear output")
        own = [*own[:-1], [rule.order[i] for i in own[-1]]]
    blocks = []
    for combo in itertools.product(*stacked):
        name = rule.hf_name_at(combo)
        if rule.inputs is None:
            blocks.append(read(name, tuple(slice(r.start, r.stop) for r in own)))
        else:
            blocks.append(_linear_block(read, name, own_shape, own, rule.inputs))
    if not stacked:
        return blocks[0]
    return np.stack(blocks).reshape(tuple(len(r) for r in ranges))


def hf_tensor(rule: TensorRule, entry: np.ndarray) -> np.ndarray:
    """The HF tensor of one stacked entry of a maxpar parameter (e.g. `leaf[layer]`)."""
    if rule.inputs is None:
        return entry
    if rule.order is not None:
        entry = entry[..., np.argsort(rule.order)]
    return entry.reshape(math.prod(entry.shape[:rule.inputs]), -1).T
