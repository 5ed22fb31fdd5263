"""The init's draws: each weight from its own generator, keyed by (seed, parameter name), so
seed-paired arms start bitwise alike in every tensor they share (Transformer.reset_parameters
says which std each tensor gets)."""

from __future__ import annotations

import zlib

import numpy as np
import torch


def keyed_normal_(w: torch.Tensor, std: float, seed: int, name: str, nested: bool = False,
                  units_last: bool = False) -> None:
    """w <- N(0, std^2) drawn on the CPU from a generator seeded by (seed, name): the same
    values on every device and whatever the module order (Transformer.reset_parameters).

    nested (model.init_nested): drawn from numpy's PCG64, whose normals come one after the
    other, so the first k values of a stream are the same however many are drawn; a matrix
    is filled unit by unit (row by row, or with units_last column by column), so a tensor
    with more units starts with the smaller one's values (one with longer units matches it
    in its first unit only: the stream runs on through the rows)."""
    if w.is_meta:  # counting parameters (nlq/model/params.py): nothing to draw
        return
    if nested:
        key = np.random.SeedSequence([seed, zlib.crc32(name.encode()), 1])
        shape = tuple(w.shape[::-1]) if units_last else tuple(w.shape)
        z = np.random.Generator(np.random.PCG64(key)).standard_normal(shape, np.float32)
        z = torch.from_numpy(z).mul_(std)  # (units, fan) as drawn
        w.copy_(z.T if units_last else z)  # back to w's (out, in)
        return
    key = np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(2)
    g = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
    w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32, device="cpu").mul_(std))
