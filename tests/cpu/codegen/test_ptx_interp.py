"""The PTX interpreter itself (ptx_interp.py) keeps the hardware's rules the kernels rely on: a barrier
holds every thread until all arrive, a shuffle needs the whole warp, accesses are aligned, cp.async lands only
at the wait that retires it, and a warp may run ahead of the others up to a barrier."""
import numpy as np
import pytest

from .ptx_interp import launch

HEADER = """
.version 8.0
.target sm_90
.address_size 64
.shared .align 16 .b8 sm[16];
.visible .entry k(
    .param .u64 p_out
)
{
    .reg .pred %p;
    .reg .b32 %tid, %w, %v, %f;
    .reg .b64 %rs, %ro;
    mov.u32 %tid, %tid.x;
    shr.u32 %w, %tid, 5;
    mov.u64 %rs, sm;
    ld.param.u64 %ro, [p_out];
    cvta.to.global.u64 %ro, %ro;
"""


def test_a_barrier_waits_for_the_warp_that_writes_after_two_shuffles():
    """Warp 1 shuffles twice, then writes shared memory; warp 0 reads it after bar.sync: 7, not poison."""
    body = """
    setp.eq.u32 %p, %w, 0;
    @%p bra WAIT;
    shfl.sync.idx.b32 %f, %tid, 0, 31, -1;
    shfl.sync.idx.b32 %f, %tid, 0, 31, -1;
    mov.u32 %v, 7;
    st.shared.b32 [%rs], %v;
WAIT:
    bar.sync 0;
    ld.shared.b32 %v, [%rs];
    setp.ne.u32 %p, %tid, 0;
    @%p bra DONE;
    st.global.b32 [%ro], %v;
DONE:
    ret;
}
"""
    out = np.zeros(1, np.uint32)
    launch(HEADER + body, "k", (1, 1, 1), 64, out)
    assert out[0] == 7


def test_lanes_at_different_shuffles_and_misaligned_vectors_are_errors():
    split = """
    and.b32 %v, %tid, 1;
    setp.eq.u32 %p, %v, 0;
    @%p bra EVEN;
    shfl.sync.idx.b32 %f, %tid, 1, 31, -1;
    ret;
EVEN:
    shfl.sync.idx.b32 %f, %tid, 0, 31, -1;
    ret;
}
"""
    with pytest.raises(RuntimeError, match="not all at one shuffle"):
        launch(HEADER + split, "k", (1, 1, 1), 32, np.zeros(1, np.uint32))
    misaligned = """
    mov.u32 %v, 1;
    st.global.v2.b32 [%ro+4], {%v, %v};
    ret;
}
"""
    with pytest.raises(RuntimeError, match="misaligned"):
        launch(HEADER + misaligned, "k", (1, 1, 1), 1, np.zeros(4, np.uint32))


def test_cp_async_lands_only_when_a_wait_retires_its_group():
    """A copy's destination reads as poison from its issue to the wait that retires its group: wait_group 1
    retires the older of two groups only, wait_all the rest; src-size 0 lands zeros."""
    text = HEADER.replace(".param .u64 p_out", ".param .u64 p_out,\n    .param .u64 p_src") + """
    .reg .b64 %rx;
    ld.param.u64 %rx, [p_src];
    cvta.to.global.u64 %rx, %rx;
    cp.async.ca.shared.global [%rs], [%rx], 4;
    cp.async.commit_group;
    cp.async.ca.shared.global [%rs+4], [%rx+4], 4;
    cp.async.commit_group;
    mov.u32 %f, 0;
    cp.async.ca.shared.global [%rs+8], [%rx], 4, %f;
    ld.shared.b32 %v, [%rs];
    st.global.b32 [%ro], %v;
    cp.async.wait_group 1;
    ld.shared.b32 %v, [%rs];
    st.global.b32 [%ro+4], %v;
    ld.shared.b32 %v, [%rs+4];
    st.global.b32 [%ro+8], %v;
    cp.async.wait_all;
    ld.shared.b32 %v, [%rs+4];
    st.global.b32 [%ro+12], %v;
    ld.shared.b32 %v, [%rs+8];
    st.global.b32 [%ro+16], %v;
    ret;
}
"""
    out, src = np.zeros(5, np.uint32), np.array([11, 22], np.uint32)
    launch(text, "k", (1, 1, 1), 1, out, src)
    poison = 0xFFFFFFFF
    assert out.tolist() == [poison, 11, poison, 22, 0]


def _write_then_read(prologue: str, value: int) -> str:
    """Warp 0 writes `value` to shared memory and exits; warp 1 reads it with no barrier between (after
    `prologue`), and its lane 0 stores what it read at out[block]."""
    return HEADER + f"""
    .reg .b32 %b;
    {prologue}
    setp.ne.u32 %p, %w, 0;
    @%p bra READ;
    mov.u32 %v, {value};
    st.shared.b32 [%rs], %v;
    ret;
READ:
    ld.shared.b32 %v, [%rs];
    setp.ne.u32 %p, %tid, 32;
    @%p bra DONE;
    mov.u32 %b, %ctaid.x;
    mad.wide.u32 %ro, %b, 4, %ro;
    st.global.b32 [%ro], %v;
DONE:
    ret;
}}
"""


def test_a_warp_runs_ahead_to_its_barrier_so_a_missing_one_shows():
    """Block 0 runs the lowest warp first (warp 1 reads 5 by luck), block 1 the highest first (warp 1 reads the
    poison), as a GPU may."""
    out = np.zeros(2, np.uint32)
    launch(_write_then_read("", 5), "k", (2, 1, 1), 64, out)
    assert out.tolist() == [5, 0xFFFFFFFF]


def test_a_one_block_grid_has_each_end_run_ahead_between_barriers():
    """Before the first barrier the lowest warp runs ahead, after it the highest: with the write and the read
    after a barrier, warp 1 reads the poison in a grid of one block."""
    out = np.zeros(1, np.uint32)
    launch(_write_then_read("bar.sync 0;", 9), "k", (1, 1, 1), 64, out)
    assert out[0] == 0xFFFFFFFF
