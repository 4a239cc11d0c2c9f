"""``kvtier demo``: a paged-KV JAX model reusing its prompt's prefix through kvtier.

Needs the ``demo`` extra (``pip install 'kvtier[demo]'``: jax, rich, matplotlib
for ``--plot``).  See :mod:`kvtier.demo.run`.
"""
