"""nlq: nonlinear-query attention (Karbevski 2026, "Beyond Linearity in Attention Projections:
The Case for Nonlinear Queries", arXiv 2603.13381).

Q(X) = (X + f(X)) / 2,  f(X) = LN(GELU(RMSNorm(X) W1) W2),  W1: d x d/2,  W2: d/2 x d.
"""

__version__ = "0.1.0"
