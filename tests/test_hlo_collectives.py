"""bench/hlo_collectives.py reads the collectives of a decode loop from a hand-written HLO module whose bytes
and trip counts are counted by hand here; a real compiled loop is read by tests/sharding_worker.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from hlo_collectives import Collective, decode_loop_collectives, decode_step_collective_bytes  # noqa: E402

HLO = """HloModule decode

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(bf16[] %a, bf16[] %b)
}

%layer_cond (lp: (s32[], bf16[4,4])) -> pred[] {
  %lp = (s32[], bf16[4,4]) parameter(0)
  %li = s32[] get-tuple-element((s32[], bf16[4,4]) %lp), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %li, s32[] %three), direction=LT
}

%layer_body (lb: (s32[], bf16[4,4])) -> (s32[], bf16[4,4]) {
  %lb = (s32[], bf16[4,4]) parameter(0)
  %y = bf16[4,4] get-tuple-element((s32[], bf16[4,4]) %lb), index=1
  %ar = bf16[4,4] all-reduce(bf16[4,4] %y), replica_groups={}, to_apply=%add
  %j = s32[] get-tuple-element((s32[], bf16[4,4]) %lb), index=0
  ROOT %lt2 = (s32[], bf16[4,4]) tuple(s32[] %j, bf16[4,4] %ar)
}

%move_cond (mp: (s32[], f32[2])) -> pred[] {
  %mp = (s32[], f32[2]) parameter(0)
  ROOT %go = pred[] constant(false)
}

%move_body (mb: (s32[], f32[2])) -> (s32[], f32[2]) {
  %mb = (s32[], f32[2]) parameter(0)
  %z = f32[2] get-tuple-element((s32[], f32[2]) %mb), index=1
  %cp = f32[2] collective-permute(f32[2] %z), source_target_pairs={{0,1},{1,0}}
  %k = s32[] get-tuple-element((s32[], f32[2]) %mb), index=0
  ROOT %mt = (s32[], f32[2]) tuple(s32[] %k, f32[2] %cp)
}

%step_cond (sp: (s32[], f32[8,4])) -> pred[] {
  %sp = (s32[], f32[8,4]) parameter(0)
  %si = s32[] get-tuple-element((s32[], f32[8,4]) %sp), index=0
  %ten = s32[] constant(10)
  ROOT %slt = pred[] compare(s32[] %si, s32[] %ten), direction=LT
}

%step_body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %x = f32[8,4] get-tuple-element((s32[], f32[8,4]) %p), index=1
  %ag = f32[16,4] all-gather(f32[8,4] %x), dimensions={0}
  %ags = (f32[8,4], f32[16,4]) all-gather-start(f32[8,4] %x), dimensions={0}
  %agd = f32[16,4] all-gather-done((f32[8,4], f32[16,4]) %ags)
  %h = bf16[4,4] constant({...})
  %zero = s32[] constant(0)
  %li0 = (s32[], bf16[4,4]) tuple(s32[] %zero, bf16[4,4] %h)
  %layers = (s32[], bf16[4,4]) while((s32[], bf16[4,4]) %li0), condition=%layer_cond, body=%layer_body<trips>
  %m = f32[2] constant({0, 0})
  %mi0 = (s32[], f32[2]) tuple(s32[] %zero, f32[2] %m)
  %moves = (s32[], f32[2]) while((s32[], f32[2]) %mi0), condition=%move_cond, body=%move_body
  %i = s32[] get-tuple-element((s32[], f32[8,4]) %p), index=0
  ROOT %out = (s32[], f32[8,4]) tuple(s32[] %i, f32[8,4] %x)
}

ENTRY %main (arg: f32[8,4]) -> (s32[], f32[8,4]) {
  %arg = f32[8,4] parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8,4]) tuple(s32[] %c0, f32[8,4] %arg)
  ROOT %loop = (s32[], f32[8,4]) while((s32[], f32[8,4]) %init), condition=%step_cond, body=%step_body
}
""".replace("<trips>", ', backend_config={"known_trip_count":{"n":"3"}}')  # the layer scan: 3 layers


def test_a_step_counts_each_collective_by_its_loops_trip_count():
    gather = Collective("all-gather", ((16, 4),), ((8, 4),), 16 * 4 * 4, 1)  # the result is the larger
    reduce = Collective("all-reduce", ((4, 4),), ((4, 4),), 4 * 4 * 2, 3)  # bf16, once per layer of 3
    permute = Collective("collective-permute", ((2,),), ((2,),), 2 * 4, 1)
    # the async gather counts once (its start; the done moves nothing more), by its tuple's larger array
    assert sorted(decode_loop_collectives(HLO, dynamic_loops=False)) == sorted([gather, gather, reduce])
    routing = decode_loop_collectives(HLO, dynamic_loops=True)  # the move loop, taken once
    assert sorted(routing) == sorted([gather, gather, reduce, permute])
    step = 2 * 256 + 3 * 32
    assert decode_step_collective_bytes(HLO) == {"step": step, "routing_step": step + 8}


def test_a_program_without_one_decode_loop_is_refused():
    entry = HLO[HLO.index("ENTRY") :]
    no_loop = entry.replace("ROOT %loop = (s32[], f32[8,4]) while", "ROOT %loop = (s32[], f32[8,4]) tuple")
    with pytest.raises(ValueError, match="expected one while loop in the entry computation, found 0"):
        decode_loop_collectives(HLO.replace(entry, no_loop), dynamic_loops=False)
