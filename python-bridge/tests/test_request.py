"""tzip._request.Request, the call as a value: what the ring's SQE and the ZeroMQ message get from it, and the part of
it one device's request carries (test_sm_budget.py follows it through a real daemon)."""

from __future__ import annotations

import pytest
import torch

from tzip import _ring
from tzip._request import Request


@pytest.mark.parametrize("budget, sms, sqe", [(None, 132, 0), (1, 132, 1), (10, 132, 10), (255, 132, 255),
                                              (0, 132, 255), (256, 132, 255), (1024, 132, 255), (0, 255, 255),
                                              (10, 300, 10), (255, 300, 255), (0, 300, None), (256, 300, None)])
def test_the_sqe_says_a_budget_of_1_to_255_and_all_sms_where_255_is_all(budget, sms, sqe):
    # 0 in an SQE is "the ring's default". All SMs (0), or more than 255, is 255 on a GPU of at most 255 SMs (the
    # kernels take min(budget, SMs)); on a larger GPU such a call goes through ZeroMQ.
    assert Request([], False, sm_budget=budget).ring_sm_budget(sms) == sqe


def test_stream_tag_and_budget_on_the_wire_only_where_given():
    assert Request([], False).wire_fields() == {}
    assert Request([], False, sm_budget=0).wire_fields() == {"sm_budget": 0}
    req = Request([], False, sm_budget=7, stream="gradients")
    assert req.wire_fields() == {"stream": "gradients", "sm_budget": 7}
    assert req.ring_tag == _ring.STREAM_TAGS["gradients"] != 0
    assert Request([], False).ring_tag == 0


def test_a_part_keeps_the_calls_settings_and_its_items_outs_in_order():
    ts = [torch.full((2,), float(i)) for i in range(4)]
    outs = [None, torch.empty(8, dtype=torch.uint8), None, torch.empty(8, dtype=torch.uint8)]
    streams = {0: "stream-of-cuda:0"}
    req = Request(ts, False, outs, codec="fast", verify=False, sm_budget=3, stream="optimizer", streams=streams)
    part = req.part([3, 1])
    assert part.items[0] is ts[3] and part.items[1] is ts[1] and part.outs[0] is outs[3] and part.outs[1] is outs[1]
    assert (part.single, part.codec, part.verify, part.sm_budget, part.stream) == (False, "fast", False, 3, "optimizer")
    assert part.streams is streams
    assert req.part([0], None).streams is None and req.part([0], {1: "s"}).streams == {1: "s"}
    assert Request(ts, True).part([0]).outs is None and Request(ts, True).part([0]).single is False
