r"""Compressors for compressed gossip: what travels is a small payload, not the array.

A :class:`Compressor` is a pair of pure functions with fixed payload shapes
(so they jit, and a payload goes through :func:`jaxfog.neighbor_allgather`
as one message):

* ``compress(x, key, warm=None) -> payload`` (a :class:`Payload`: the arrays
  that travel, plus ``x``'s shape and dtype as static metadata);
* ``decompress(payload) -> x_hat``, with ``x``'s shape and dtype;

and ``bytes(x)``, what one payload for ``x`` weighs on the wire.

Every compressor states what it guarantees for an array of ``d`` entries:

* ``unbiased``: :math:`\mathbb{E}_{key}\, C(x) = x`;
* ``delta(d)``, the contraction
  :math:`\mathbb{E}\,\|C(x) - x\|^2 \le (1 - \delta)\, \|x\|^2` that
  CHOCO-SGD and BEER assume (``None`` when the compressor is not a
  contraction, as the unbiased random ones are not: use their biased form);
* ``omega(d)`` for the unbiased ones, the variance bound
  :math:`\mathbb{E}\,\|C(x) - x\|^2 \le \omega\, \|x\|^2`.

Compressors work on one array. A pytree is compressed in groups of its
leaves (:func:`compress_tree`): the leaves of a group are flattened and
merged into one vector, compressed as one (MergeComp); :func:`search` picks
the grouping from measured times.

The modules: ``compressors`` (the compressors, pure), ``quantized`` (those for
outer gradients: 8-bit floats, integers of 8, 4 or 2 bits with a scale a
chunk, chunked top-k with quantized values, a chunked DCT then top-k),
``groups`` (a pytree in groups of leaves) and ``search`` (MergeComp's search,
which times exchanges).
Import the names from :mod:`jaxfog.compress` itself.

References:
  Koloskova, Stich, Jaggi. *Decentralized Stochastic Optimization and Gossip
  Algorithms with Compressed Communication*. ICML, 2019 (top-k, rand-k,
  qsgd as contractions).

  Alistarh, Grubic, Li, Tomioka, Vojnovic. *QSGD: Communication-Efficient SGD
  via Gradient Quantization and Encoding*. NeurIPS, 2017.

  Karimireddy, Rebjock, Stich, Jaggi. *Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes*. ICML, 2019 (scaled sign).

  Vogels, Karimireddy, Jaggi. *PowerGossip: Practical Low-Rank Communication
  Compression in Decentralized Deep Learning*. NeurIPS, 2020.

  Wang, Neglia, Aldrich, Sundaram, Jaggi, Chen. *MergeComp: A Compression
  Scheduler for Scalable Communication-Efficient Distributed Training*, 2021.
"""

from jaxfog.compress.compressors import (Compressor, Payload, identity, low_rank, qsgd, rand_k,
                                         sign, top_k)
from jaxfog.compress.quantized import chunked_top_k, dct_top_k, float8, quantize
from jaxfog.compress.groups import (Groups, balanced, check_groups, compress_groups,
                                    compress_tree, decompress_tree, merge, per_leaf, split,
                                    tree_bytes, unstack)
from jaxfog.compress.search import SearchResult, exchange_timer, search

__all__ = ["Compressor", "Groups", "Payload", "SearchResult", "balanced", "check_groups",
           "chunked_top_k", "compress_groups", "compress_tree", "dct_top_k", "decompress_tree",
           "exchange_timer", "float8", "identity", "low_rank", "merge", "per_leaf", "qsgd",
           "quantize", "rand_k", "search", "sign", "split", "top_k", "tree_bytes", "unstack"]
