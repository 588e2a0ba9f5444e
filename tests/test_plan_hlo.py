"""maxpar.plan.hlo: replica-group syntaxes, loop trip counts, async pairs, bytes and mesh-axis labels."""

from __future__ import annotations

import pytest

from maxpar.plan import hlo

AXES = {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "tensor": 2}

# A hand-written module in the syntax XLA prints: a scan whose body (3 trips) holds an async
# all-gather and a tuple all-reduce, nested in an outer loop of 2 trips, and collectives outside.
MODULE = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %w = f32[4,8]{1,0} get-tuple-element(%p), index=1, metadata={op_name="jit(step)/layers/mlp/dot_general"}
  %ags = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %g = bf16[16]{0} parameter(1), metadata={op_name="jit(step)/transpose(jvp(layers))/norm/reduce_sum"}
  %ar = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce(%w, %g), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%p)
}

%inner_cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (q: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %inner = (s32[], f32[4,8]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

%outer_cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8]) -> f32[] {
  %a = f32[4,8]{1,0} parameter(0), metadata={op_name="jit(step)/output"}
  %t0 = (s32[], f32[4,8]{1,0}) tuple(%a)
  %loop = (s32[], f32[4,8]{1,0}) while(%t0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  %rs = f32[2,8]{1,0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%add
  %a2a = f32[4,8]{1,0} all-to-all(%a), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}
  %cp = f32[4,8]{1,0} collective-permute(%a), channel_id=5, source_target_pairs={{0,2},{2,0},{1,1},{3,3},{4,6},{6,4},{5,5},{7,7}}
  ROOT %r = f32[] constant(0)
}
"""


def test_replica_group_syntaxes():
    assert hlo.parse_replica_groups("{{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
    assert hlo.parse_replica_groups(None, 4) == [[0, 1, 2, 3]]
    assert hlo.parse_replica_groups("[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Mesh-axes groups: devices [2,2,2] (iota); group over axis_1 -> pairs 2 apart.
    assert hlo.parse_replica_groups("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}", 8) == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    # With a device order: iota(8).reshape(4,2).T = [0,2,4,6,1,3,5,7] laid out as [2,4].
    assert hlo.parse_replica_groups("mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}", 8) == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    # A sub-axis: the middle 2 of axis_0 = 8 split as (1)2 x 4.
    assert hlo.parse_replica_groups("mesh['axis_0'=8] {'axis_0':(1)2}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_collectives_count_loop_trips_fold_async_pairs_and_split_tuples():
    found = {c.name: c for c in hlo.collectives(MODULE, 8)}
    assert set(found) == {"ags", "ar", "rs", "a2a", "cp"}  # all-gather-done is the same transfer
    ag, ar = found["ags"], found["ar"]
    assert (ag.kind, ag.count, ag.operand_bytes, ag.group_size) == ("all-gather", 6, 4 * 8 * 4, 2)
    assert ar.count == 6 and ar.dtype == "mixed" and ar.group_size == 4
    assert [(o.nbytes, o.dtype) for o in ar.operands] == [(128, "f32"), (32, "bf16")]
    assert "norm/reduce_sum" in ar.operands[1].op_name and "mlp" in ar.operands[0].op_name
    assert found["rs"].count == 1 and found["rs"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert sorted(hlo.while_loops(MODULE)) == [("inner_body", 3, 2), ("outer_body", 2, 0)]


# A tick loop (4 trips) whose body switches between an idle branch, one with an all-gather and one whose
# layer loop (2 trips) all-reduces, as the explicit-backward pipeline executor compiles.
SWITCH = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%idle (a: f32[4,8]) -> f32[4,8] {
  ROOT %a = f32[4,8]{1,0} parameter(0)
}

%forward (b: f32[4,8]) -> f32[4,8] {
  %b = f32[4,8]{1,0} parameter(0)
  %ag = f32[8,8]{1,0} all-gather(%b), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %y = f32[4,8]{1,0} slice(%ag), slice={[0:4], [0:8]}
}

%layer (l: f32[4,8]) -> f32[4,8] {
  %l = f32[4,8]{1,0} parameter(0)
  ROOT %ar = f32[4,8]{1,0} all-reduce(%l), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

%layer_cond (l: f32[4,8]) -> pred[] {
  %l = f32[4,8]{1,0} parameter(0)
  ROOT %c = pred[] constant(true)
}

%backward (w: f32[4,8]) -> f32[4,8] {
  %w = f32[4,8]{1,0} parameter(0)
  ROOT %layers = f32[4,8]{1,0} while(%w), condition=%layer_cond, body=%layer, backend_config={"known_trip_count":{"n":"2"}}
}

%tick (t: f32[4,8]) -> f32[4,8] {
  %t = f32[4,8]{1,0} parameter(0)
  %k = s32[] constant(1)
  ROOT %op = f32[4,8]{1,0} conditional(%k, %t, %t, %t), branch_computations={%idle, %forward, %backward}
}

%tick_cond (t: f32[4,8]) -> pred[] {
  %t = f32[4,8]{1,0} parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  ROOT %ticks = f32[4,8]{1,0} while(%a), condition=%tick_cond, body=%tick, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_conditional_branches_count_as_bound_or_by_their_runs():
    # Unknown branch choice: every branch counted each trip, flagged as a bound (nested loops included).
    bound = {c.name: c for c in hlo.collectives(SWITCH, 8)}
    assert (bound["ag"].count, bound["ar"].count) == (4, 8) and bound["ag"].every_branch and bound["ar"].every_branch
    # Known: per loop entry, F runs 1.5 times and B 2 times per device on average (the rest idle).
    runs = {c.name: c for c in hlo.collectives(SWITCH, 8, {3: (0.5, 1.5, 2.0)})}
    assert (runs["ag"].count, runs["ar"].count) == (1.5, 4.0)
    assert not runs["ag"].every_branch and not runs["ar"].every_branch
    assert {c.name: c.count for c in hlo.collectives(SWITCH, 8, {2: (1.0, 1.0)})} == {"ag": 4, "ar": 8}


def test_groups_are_labelled_with_mesh_axes():
    found = {c.name: c for c in hlo.collectives(MODULE, 8)}
    parts = hlo.axis_partitions(AXES)
    # [4,2]<=[2,4]T(1,0): pairs 4 apart, i.e. differing in the first mesh axis (data).
    assert hlo.label_groups(found["ags"], AXES, parts) == "data"
    assert hlo.label_groups(found["ar"], AXES, parts) == "data+tensor"
    assert hlo.label_groups(found["rs"], AXES, parts) == "tensor"
    assert hlo.label_groups(found["cp"], AXES, parts) == "fsdp"


def test_wire_bytes_are_the_ring_costs():
    assert hlo.wire_bytes("all-gather", 100, 4) == 300          # (n-1)/n of the 400-byte result
    assert hlo.wire_bytes("reduce-scatter", 400, 4) == 300
    assert hlo.wire_bytes("all-reduce", 400, 4) == 600          # reduce-scatter + all-gather
    assert hlo.wire_bytes("all-to-all", 400, 4) == 300
    assert hlo.wire_bytes("collective-permute", 400, 2, moving_fraction=0.5) == 200
    assert hlo.wire_bytes("all-reduce", 400, 1) == 0
    cp = {c.name: c for c in hlo.collectives(MODULE, 8)}["cp"]
    assert hlo.collective_wire_bytes(cp) == pytest.approx(128 * 0.5)  # half the devices send to themselves
