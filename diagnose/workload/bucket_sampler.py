"""Bucketed batches: which items of the dataset make each batch of an epoch, and which are flipped.

Each batch holds images of one bucket (one square side); :class:`BucketBatchSampler` takes the
buckets in turn, so successive steps cycle through the training resolutions (what
``RunConfig.resolution`` promises). The sampler decides the flips too, so that batches, their
order and their pixels depend only on the seed and the epoch, never on the number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
from torch.utils.data import Sampler


class SampleKey(NamedTuple):
    """What the batch sampler hands the dataset: which item, and whether to flip it.

    The flip is decided by the (seeded) sampler in the main process rather than by a random
    generator inside each worker, so the pixels are the same whatever the number of workers.
    """

    #: Position in the dataset (``index`` would shadow ``tuple.index``).
    item: int
    flip: bool


class BucketBatchSampler(Sampler[list[SampleKey]]):
    """Batches of one bucket each; steps take the buckets in turn; every batch is full.

    Per epoch: the items of each bucket are shuffled and, when their number is not a multiple of
    the batch size, the shuffled list is repeated to fill the last batch (so a batch larger than
    the bucket repeats images; nothing is dropped and every batch has the same shape). Batches
    are then taken round-robin over the buckets. Each item gets a seeded coin flip for the
    horizontal flip. Epoch ``e`` depends only on ``(seed, e)``; the epoch counter advances when an
    iteration actually starts, so iterators that torch creates and drops unused (it makes two for
    the first epoch of a multi-worker loader) do not shift the sequence.
    """

    def __init__(self, buckets: Sequence[int], batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not buckets:
            raise ValueError("no items to sample")
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        order: list[int] = []
        members: dict[int, list[int]] = {}
        for index, side in enumerate(buckets):
            if side not in members:
                order.append(side)
                members[side] = []
            members[side].append(index)
        #: Bucket sides in first-seen order, and the item indices of each.
        self.bucket_order = order
        self.members = members

    def __len__(self) -> int:
        return sum(-(-len(items) // self.batch_size) for items in self.members.values())

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration produce epoch ``epoch``."""
        self.epoch = epoch

    def plan_epoch(self, epoch: int) -> list[list[SampleKey]]:
        """The batches of one epoch, in order (pure: same epoch, same seed, same batches)."""
        rng = np.random.default_rng([self.seed, epoch])
        per_bucket: list[list[list[SampleKey]]] = []
        for side in self.bucket_order:
            items = [self.members[side][i] for i in rng.permutation(len(self.members[side]))]
            batches_needed = -(-len(items) // self.batch_size)
            needed = batches_needed * self.batch_size
            filled = [items[i % len(items)] for i in range(needed)]
            flips = rng.random(needed) < 0.5
            keys = [SampleKey(index, bool(flip)) for index, flip in zip(filled, flips, strict=True)]
            per_bucket.append(
                [keys[i : i + self.batch_size] for i in range(0, needed, self.batch_size)]
            )
        batches: list[list[SampleKey]] = []
        for round_index in range(max(len(bucket) for bucket in per_bucket)):
            batches.extend(
                bucket[round_index] for bucket in per_bucket if round_index < len(bucket)
            )
        return batches

    def __iter__(self) -> Iterator[list[SampleKey]]:
        # A generator function: nothing below runs (and the epoch does not advance) until the
        # first batch is requested.
        epoch = self.epoch
        self.epoch += 1
        yield from self.plan_epoch(epoch)


__all__ = ["BucketBatchSampler", "SampleKey"]
