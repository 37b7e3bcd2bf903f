"""Plan data: what a refit copies, as frozen, validated, serializable data.

* :mod:`~megarefit.plan.ops`: :class:`TensorRef`, :class:`TensorMeta`, :class:`CopyOp`,
  :class:`QuantizeStep`, :class:`ValueStep` (offsets in elements, ``nbytes`` in bytes);
* :mod:`~megarefit.plan.columns`: a plan's ops as int64 columns, checks on whole columns;
* :mod:`~megarefit.plan.table`: columnar plans (tensor tables named on demand, :class:`OpTable`);
* :mod:`~megarefit.plan.validate`: :func:`validate_plan`, exact cover before a byte moves;
* :mod:`~megarefit.plan.plan`: :class:`Plan` and its JSON round trip.
"""

from megarefit.plan.ops import (
    ITEMSIZE,
    STAGING_SUFFIX,
    VALUE_DTYPES,
    CopyOp,
    Direction,
    OpKind,
    QuantizeStep,
    TensorMeta,
    TensorRef,
    ValueStep,
    digest_of,
    itemsize,
    joined,
    make_op,
    merge_ops,
)
from megarefit.plan.plan import Plan
from megarefit.plan.validate import validate_plan

__all__ = ["ITEMSIZE", "STAGING_SUFFIX", "VALUE_DTYPES", "CopyOp", "Direction", "OpKind", "Plan", "QuantizeStep", "TensorMeta", "TensorRef", "ValueStep",
           "digest_of", "itemsize", "joined", "make_op", "merge_ops", "validate_plan"]
