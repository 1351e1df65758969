"""Closed-form reference of the built-in initialisers' values (bmt/core/philox.h's documented layout), written out
independently of the engine: Philox4x32-10, the (seed, stream, block) counter layout, uniform (w + 0.5) / 2^32 and
Box-Muller over word pairs, in double, rounded through float32 to the parameter's dtype."""
import math

import torch

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def philox4x32_10(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def stream_of_name(name):
    h = 1469598103934665603
    for b in name.encode():
        h = ((h ^ b) * 1099511628211) & _M64
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


def reference(name, shape, dtype, dist, shift, scale, seed):
    """The whole logical tensor a parameter called `name` gets (dist "normal" or "uniform")."""
    s = stream_of_name(name)
    n = math.prod(shape)
    out = []
    for i in range(n):
        blk = i // 4
        w = philox4x32_10((blk & _M32, blk >> 32, s & _M32, s >> 32), (seed & _M32, seed >> 32))
        lane = i % 4

        def u(k):
            return (w[k] + 0.5) / 4294967296.0

        if dist == "uniform":
            z = u(lane)
        else:
            first = lane & ~1
            r = math.sqrt(-2.0 * math.log(u(first)))
            theta = 2.0 * math.pi * u(first + 1)
            z = r * math.cos(theta) if lane == first else r * math.sin(theta)
        out.append(shift + scale * z)
    return torch.tensor(out, dtype=torch.float64).to(torch.float32).to(dtype).reshape(shape)


def xavier_std(shape, gain):
    return gain * math.sqrt(2.0 / (shape[0] + shape[1]))
