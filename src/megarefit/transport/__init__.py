"""Transports move the bytes of plan ops; see :class:`~megarefit.transport.base.Transport`."""

from megarefit.transport.base import Transport
from megarefit.transport.local import LocalTransport

__all__ = ["LocalTransport", "Transport"]
