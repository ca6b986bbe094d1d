#!/usr/bin/env python3
"""fit_mills.py: the fit behind float gelu's Phi in model/scalar_math.h.

Phi's lower tail is Phi(-u) = R(u) phi(u) for u >= 0, R the Mills ratio. With
t = 1 / (1 + p u) and s = 1 - t = p u t, which maps [0, inf) onto [0, 1),
R(u) = t S(s) for an S that is smooth on [0, 1] (S(1) = p, from R(u) ~ 1/u).
S is a polynomial in s, not in t: where u is small, s is small and so is
its absolute error, while t's rounding would be amplified 2.5 times
(d ln R / d ln t = 1 / (1.25 p) at u = 0). This finds S of a given degree
by least squares in relative error, reweighted towards the worst points
(Lawson's iteration, which approaches the minimax fit), prints the largest
relative error of t S(s) against R computed in 30 digits, and the
coefficients times 1/sqrt(2 pi) (phi's constant, folded in), rounded to
float, highest degree first: the order of model/scalar_math.h's Horner sum.

    python3 tests/unit/fit_mills.py [p] [degree]     (defaults 0.32 9)

Needs numpy and mpmath (Debian python3-numpy, python3-mpmath); mnemo itself
does not run it. tests/unit/test_scalar_math.c checks the result in float.
"""
import struct
import sys

import mpmath as mp
import numpy as np

mp.mp.dps = 30


def as_float(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def mills(u):
    """R(u) = Phi(-u) / phi(u), to 30 digits."""
    u = mp.mpf(u)
    return mp.sqrt(mp.pi / 2) * mp.erfc(u / mp.sqrt(2)) * mp.exp(u * u / 2)


def fit(p, degree, nodes=3000, rounds=80):
    k = np.arange(nodes)
    s = 0.5 - 0.5 * np.cos(np.pi * (k + 0.5) / nodes)  # denser at both ends
    t = 1 - s
    target = np.array([float(mills((1 - ti) / (p * ti)) / ti) for ti in t])
    V = np.vander(s, degree + 1, increasing=True)
    weight = np.ones(nodes)
    for _ in range(rounds):
        root = np.sqrt(weight)
        coef, *_ = np.linalg.lstsq(V / target[:, None] * root[:, None], root, rcond=None)
        err = np.abs(V @ coef / target - 1)
        weight = weight * err
        weight /= weight.sum()
    return coef, err.max()


def main():
    p = as_float(float(sys.argv[1]) if len(sys.argv) > 1 else 0.32)
    degree = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    coef, err = fit(p, degree)
    print("p = %.9g, degree %d: largest relative error of t S(s) %.3g" % (p, degree, err))
    scale = 1 / np.sqrt(2 * np.pi)
    for c in reversed(coef):
        print("%.9g" % as_float(c * scale))


if __name__ == "__main__":
    main()
