"""One compress or decompress call as a value: built once at the public API (``Client.compress``, ``decompress`` and
their ``_async`` forms) from the caller's arguments and the context of the call, then passed explicitly down whichever
route serves it (the one-tensor ring path, the general ring path, ZeroMQ) instead of being read again from context
variables deep inside. A route that cannot finish a call hands the same request (or its :meth:`Request.part` for one
device) to the next route, so the SM budget and stream tag the caller gave travel with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from . import _ring

_SAME = object()  # Request.part: keep the streams


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked call.

    Attributes:
        items: the tensors to compress, or the CompressedTensors to decompress, in the caller's order.
        single: the caller passed one item (and gets one result back, not a list).
        outs: ``out=`` per item (a uint8 frame buffer for compress, a result tensor for decompress, or None), or None
            when the call has none.
        codec: compress only: the caller's codec name (None: each device's default, tzip._codec_choice.codec_for).
        verify: decompress only: check every chunk's digest (docs/format.md, section 9).
        sm_budget: SMs the daemon's kernels may use for this call (0: all, at most tzip._job.MAX_SM_BUDGET), or None:
            the daemon's budget. Checked by the public API.
        stream: the stream tag (tzip.tagged) in force where the call was made, or None (untagged).
        streams: asynchronous calls: the caller's current CUDA stream per device index at the call, else None (the
            current stream where the work is done).
    """

    items: list
    single: bool
    outs: list | None = None
    codec: str | None = None
    verify: bool = True
    sm_budget: int | None = None
    stream: str | None = None
    streams: dict[int, Any] | None = None

    def part(self, idx: Iterable[int], streams: Any = _SAME) -> "Request":
        """The request restricted to ``items[i]`` for ``i`` in ``idx`` (a list result); ``streams`` replaces the
        caller's streams when given (None included)."""
        idx = list(idx)
        return dataclasses.replace(
            self, items=[self.items[i] for i in idx], single=False,
            outs=None if self.outs is None else [self.outs[i] for i in idx],
            streams=self.streams if streams is _SAME else streams)

    def ring_sm_budget(self, sms: int) -> int | None:
        """The SQE's sm_budget byte for this call on a GPU of ``sms`` SMs (0: the ring's default), or None when an SQE
        cannot say it (such GPU requests go through ZeroMQ). A budget of 1 to 255 is said as it is. All SMs (0) and
        budgets above 255 are said as 255 on a GPU of at most 255 SMs: the kernels run on min(budget, SMs) SMs
        (gpu::detail::persistent_grid), so 255 there is every SM, as 0 and 300 are; on a larger GPU they go through
        ZeroMQ. The job's budget (``tzip set JOB sm_budget=N``) is not the client's to apply: the daemon hands it to
        the ring thread, which applies it over every SQE's (docs/ring.md, "Who applies the job's settings")."""
        if self.sm_budget is None:
            return 0
        if 1 <= self.sm_budget <= 255:
            return self.sm_budget
        return 255 if sms <= 255 else None

    @property
    def ring_tag(self) -> int:
        """The SQE's stream tag byte (0: untagged)."""
        return _ring.STREAM_TAGS.get(self.stream, 0)

    def wire_fields(self) -> dict[str, Any]:
        """The fields a ZeroMQ compress/decompress request of protocol version 3 or later carries for this call
        (docs/protocol.md, "Jobs"): ``stream`` and ``sm_budget`` where given."""
        fields: dict[str, Any] = {}
        if self.stream is not None:
            fields["stream"] = self.stream
        if self.sm_budget is not None:
            fields["sm_budget"] = self.sm_budget
        return fields
