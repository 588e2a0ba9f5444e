"""Reading XLA:TPU's compiled programs (maxpar/plan/hlo.py): loops without known_trip_count, collective matmuls
(windowed loops and unrolled ones), multi-slice transfers; on a small module written in XLA:TPU's form."""

from __future__ import annotations

import pytest

from maxpar.core.mesh import MeshShape
from maxpar.plan import hlo, verify

WEIGHT_GRAD = 'op_name="jit(train_step)/transpose(jvp(Transformer))/ble,blv->ev/dot_general"'
FORWARD = 'op_name="jit(train_step)/jvp(Transformer)/decoder/layers/mlp/mlp.project/ble,em->blm/dot_general"'
MODULE = f"""\
HloModule jit_train_step, is_scheduled=true, num_partitions=4

%cond (p: (u32[], f32[8])) -> pred[] {{
  %p = (u32[], f32[8]) parameter(0)
  %gte = u32[] get-tuple-element(%p), index=0
  %limit = u32[] constant(4)
  ROOT %lt = pred[] compare(%gte, %limit), direction=LT
}}

%wide.windowed_dot_general_body_rs.1 (q: (u32[], f32[8])) -> (u32[], f32[8]) {{
  %q = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%q), index=0
  %x = f32[8] get-tuple-element(%q), index=1
  %cp = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}, metadata={{{WEIGHT_GRAD}}}
  %cpd = f32[8] collective-permute-done(%cp), metadata={{{WEIGHT_GRAD}}}
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  ROOT %t = (u32[], f32[8]) tuple(%next, %cpd)
}}

ENTRY %main (a: f32[8], b: bf16[4]) -> f32[8] {{
  %a = f32[8] parameter(0)
  %b = bf16[4] parameter(1)
  %zero = u32[] constant(0)
  %z = u32[] copy(%zero)
  %init = (u32[], f32[8]) tuple(%z, %a)
  %w = (u32[], f32[8]) while(%init), condition=%cond, body=%wide.windowed_dot_general_body_rs.1, metadata={{{WEIGHT_GRAD}}}
  %peeled = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%a), channel_id=2, source_target_pairs={{{{0,3}},{{1,0}},{{2,1}},{{3,2}}}}, metadata={{{WEIGHT_GRAD}}}
  %fwd = (bf16[4], bf16[4], u32[], u32[]) collective-permute-start(%b), channel_id=3, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}, metadata={{{FORWARD}}}
  %token = token[] after-all()
  %send = (f32[8], u32[], token[]) send(%a, %token), channel_id=4, is_host_transfer=true, frontend_attributes={{_xla_megascale_transfer_type="ALL_REDUCE"}}
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}}
"""


def test_trip_counts_are_read_from_the_loop_condition():
    [(body, trips, in_body)] = hlo.while_loops(MODULE)
    assert (body, trips, in_body) == ("wide.windowed_dot_general_body_rs.1", 2, 1)  # from 0 to 4 in steps of 2


def test_collective_matmul_permutes_stand_for_their_collective_and_slices_transfer_over_dcn():
    found = {c.name: c for c in hlo.collectives(MODULE, 4, num_slices=2)}
    assert found["cp"].stands_for == "reduce-scatter" and found["cp"].count == 2  # the windowed loop names it
    assert found["peeled"].stands_for == "reduce-scatter"  # peeled out of the loop: the same matmul's op_name
    assert found["fwd"].stands_for == "all-gather"  # unrolled: the einsum keeps the batch, so it gathers a weight
    send = found["send"]
    assert (send.kind, send.dcn, send.operand_bytes, send.groups) == ("all-reduce", True, 32, ((0, 1),))
    assert hlo.module_partitions(MODULE) == 4


def test_verify_counts_collective_matmuls_at_ring_bytes_and_slices_on_their_dcn_axes():
    mesh = MeshShape(("data", "fsdp"), (1, 4), (2, 1))
    rows = verify.measure(MODULE, mesh)
    by_name = {(r["axis"], r["collective"], r["via"]): r for r in rows}
    rs = [r for r in rows if r["collective"] == "reduce-scatter"]
    assert {r["axis"] for r in rs} == {"fsdp"} and all(r["via"] == "collective-permute" for r in rs)
    assert sum(r["sent_bytes"] for r in rs) == 3 * 32  # two loop trips and the peeled permute
    assert sum(r["bytes"] for r in rs) == pytest.approx(3 * 32 * 3 / 5)  # a ring over 4 sends (n-1)/(n+1) of it
    dcn = by_name[("data", "all-reduce", "")]
    assert dcn["bytes"] == 2 * 32 * (2 - 1) / 2  # all-reduce over the 2 slices


@pytest.mark.parametrize("op_name, kind", [
    ("jit(train_step)/transpose(jvp(Transformer))/decoder/layers/attention/blhd,ble->hde/dot_general",
     "reduce-scatter"),
    ("jit(train_step)/transpose(jvp(Transformer))/decoder/layers/mlp/ble,me->blm/dot_general", "all-gather"),
    ("jit(train_step)/jvp(Transformer)/decoder/layers/attention/ble,ehd->blhd/dot_general", "all-gather"),
    ("jit(train_step)/jvp(Transformer)/decoder/convert_element_type", ""),
])
def test_unrolled_collective_matmuls_are_read_from_their_einsum(op_name, kind):
    assert hlo.unrolled_collective_matmul(op_name) == kind
