"""What the backend's ``chunk`` and ``decode`` ops return: one type, whatever was asked of them.

Before this type the two ops returned ``out``, ``(out, m, l)``, ``(out, weights)`` or ``(out, weights, m, l)``
depending on their ``weights`` / ``residuals`` flags, so every caller unpacked conditionally. Now the flags say only
what is computed; the result is always an :class:`Attended` whose fields are None when not asked for. Unpacking it
like the old tuples raises a ``TypeError`` that names the fields, so code written against the old arity fails at
the call, not three lines later with a shape error.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class Attended:
    """``out``: the attention output (``chunk``: ``[b, t, h, d]``; ``decode``: ``[b, h, d]``), in the query dtype,
    or float32 when residuals were asked for (they are merged in float32). ``weights``: with ``weights=True``
    (decode only), the probabilities each slot received, summed over each KV group, ``[b, k, s]`` float32. ``m,
    l``: with ``residuals=True``, each query row's logit max and sum of exponentials ``[b, (t,) h]`` (a row that
    saw no key: ``l = 0``), as :func:`lcx.kernels.merge_partials` combines them."""

    out: jax.Array
    weights: jax.Array | None = None
    m: jax.Array | None = None
    l: jax.Array | None = None  # noqa: E741

    @property
    def parts(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(out, m, l)`` for :func:`lcx.kernels.merge_partials`; raises when residuals were not computed."""
        if self.m is None or self.l is None:
            raise ValueError("Attended.parts needs the residuals: call the backend op with residuals=True")
        return self.out, self.m, self.l

    def __iter__(self):
        raise TypeError("backend chunk / decode ops return an lcx.kernels.Attended (fields out, weights, m, l; "
                        "None when not asked for), not a tuple whose length depends on the flags: read "
                        "result.out, result.weights, result.m, result.l (or result.parts for merge_partials)")


def attended(result, *, weights: bool = False, residuals: bool = False) -> Attended:
    """Wrap a kernel's flag-dependent tuple ``out [, weights] [, m, l]`` as an :class:`Attended`."""
    if not weights and not residuals:
        return Attended(out=result)
    parts = list(result)
    out = parts.pop(0)
    w = parts.pop(0) if weights else None
    m, l = parts if residuals else (None, None)  # noqa: E741
    return Attended(out=out, weights=w, m=m, l=l)


__all__ = ["Attended", "attended"]
