"""Inline PTX used by the tile kernel on the GPU (the interpreter cannot run PTX; the kernels
take tl.histogram there instead).

- A warp-ballot histogram over a 64-bin window (_ballot_hist64).
- A lane-private histogram in shared memory (_lane_hist_*): 256 bins (the float32 exponent
  field of |x|, zeros in bin 0, Inf/NaN in bin 255; or an fp8 byte's value) times 32 columns,
  one per lane of a warp, shared by the warps of a program. One `red.shared.add` per element: the 32 lanes of a
  warp always write 32 different banks, so nothing serializes, whatever the data. (tl.histogram
  keeps one shared counter per bin: the lanes of a warp collide on the few bins a tensor's
  exponents fall in.) 32 KiB of static shared memory per program; 43.25 KiB with the fast
  pass's threshold table (THR_ROWS below).
"""
from __future__ import annotations

import triton
import triton.language as tl


def _ballot_ptx() -> str:
    # %m: lanes with a valid bin; for each of bits 0-4, keep the lanes whose bit equals this
    # lane's (xor with (lane bit - 1) inverts the vote where the lane's bit is 0); bit 5 splits
    # the result into bin lane and bin lane + 32
    bit = """
        and.b32 %t, $1, {m};
        setp.ne.u32 %p, %t, 0;
        vote.sync.ballot.b32 %b, %p, -1;
        bfe.u32 %k, %l, {i}, 1;
        sub.u32 %k, %k, 1;
        xor.b32 %b, %b, %k;
        and.b32 %m, %m, %b;"""
    return ("""{
        .reg .pred %p;
        .reg .b32 %m, %b, %t, %l, %k;
        mov.u32 %l, %laneid;
        setp.lt.u32 %p, $1, 64;
        vote.sync.ballot.b32 %m, %p, -1;"""
            + "".join(bit.format(m=1 << i, i=i) for i in range(5))
            + """
        and.b32 %t, $1, 32;
        setp.ne.u32 %p, %t, 0;
        vote.sync.ballot.b32 %b, %p, -1;
        and.b32 %k, %m, %b;
        not.b32 %b, %b;
        and.b32 %t, %m, %b;
        popc.b32 %t, %t;
        popc.b32 %k, %k;
        shl.b32 %k, %k, 16;
        or.b32 $0, %t, %k;
        }""")


_BALLOT_PTX = tl.constexpr(_ballot_ptx())  # a global a @triton.jit function reads


@triton.jit
def _ballot_hist64(sel):
    # A warp-level histogram over 64 bins (sel in [0, 64); anything else is not counted), one
    # element slot at a time: the 32 lanes vote on each bit of their element's bin, lane L keeps
    # the lanes whose bits spell L (bin L) or L + 32 and counts them. Returns, per slot, bin L's
    # count | bin (L + 32)'s count << 16. No shared memory and no atomics. GPU only; every lane
    # of the warp must reach it (uniform code).
    return tl.inline_asm_elementwise(
        asm=_BALLOT_PTX,
        constraints="=r,r", args=[sel], dtype=tl.int32, is_pure=True, pack=1)


LANE_HIST_BINS = tl.constexpr(256)

# The threshold table inside the lane histogram's allocation: the word of (exponent field f,
# lane L) lies THR_ROWS rows (of 32 words, one per lane) after the histogram word of (f, L), so
# that one address serves both the table load and the count (one LOP3 per element, and a SHF
# for float32 bits or the high bf16 of a word, where the table's own address and the count's
# took three instructions). The threshold fields (102..135) put their words in histogram rows
# 192..255: the bins of |x| >= 2^65, Inf and NaN, which no program that keeps its fast pass
# holds. A count there changes the row from its initial words, and the program then runs the
# careful pass (tile_fast._top_rows). The rows past 255 take the loads of fields 166..255, which
# have no threshold: they hold NaN, so that those values always add 1 (a count in a top row then
# grows its word by at most 65535, and the change of the row's total is exact).
THR_ROWS = tl.constexpr(90)
TOP_ROW = tl.constexpr(192)


def _lane_hist_init_ptx(table: dict, rows: int) -> str:
    # Declares the histogram (rows of 32 words), writes zeros, the threshold table (the words of
    # row f + THR_ROWS hold field f's threshold as float32 bits, counted when |x| >= it) and NaN
    # in the rows past 255 with the program's threads, and returns its address (the same in
    # every thread). Called on a scalar, so that it appears once in the kernel whatever layout
    # Triton picks for tensors (a second copy of the declaration does not assemble). The caller
    # puts a barrier between this and the first count.
    at = {f + THR_ROWS.value: t for f, t in table.items()}
    assert all(TOP_ROW.value <= r < 256 for r in at) and (not at or rows >= 256 + THR_ROWS.value)
    # each word's value from its row %r: zero, NaN past row 255, or a threshold; a plain
    # histogram (256 rows, no table) only zeroes
    value = "" if rows == 256 and not at else """
    shr.u32 %r, %i, 3;
    setp.ge.u32 %p, %r, 256;
    selp.u32 %v, 0x7FFFFFFF, 0, %p;""" + "".join(f"""
    setp.eq.u32 %p, %r, {r};
    selp.u32 %v, {t}, %v, %p;""" for r, t in sorted(at.items()))
    return f"""
    .shared .align 16 .b32 sw_lane_hist[{rows * 32}];
    {{
    .reg .pred %p;
    .reg .b32 %i, %n, %a, %b, %r, %v;
    mov.u32 %b, sw_lane_hist;
    mov.u32 %i, %tid.x;
    mov.u32 %n, %ntid.x;
    sw_lane_hist_zero:
    setp.ge.u32 %p, %i, {rows * 8};
    @%p bra sw_lane_hist_done;
    mov.u32 %v, 0;{value}
    shl.b32 %a, %i, 4;
    add.u32 %a, %a, %b;
    st.shared.v4.u32 [%a], {{%v, %v, %v, %v}};
    add.u32 %i, %i, %n;
    bra sw_lane_hist_zero;
    sw_lane_hist_done:
    mov.u32 $0, %b;
    }}"""


_LANE_HIST_INIT = tl.constexpr(_lane_hist_init_ptx({}, 256))  # 32 KiB


def _lane_hist_init_thr_ptx(table: dict) -> str:
    # with the threshold table: 346 rows, 43.25 KiB
    return _lane_hist_init_ptx(table, 256 + THR_ROWS.value)


# %l = the table's address + 4 * lane: the same in every copy of a count, which ptxas then
# computes once (an address built as ((bin * 32 + lane) * 4) + table took ~5 instructions per
# element)
def _lane_base(table: str) -> str:
    return f"""
    mov.u32 %l, %laneid;
    shl.b32 %l, %l, 2;
    add.u32 %l, %l, {table};"""


# The threshold counts in two steps, each over a whole tile: first every element's slot (its
# histogram word's address and its table word, one ld.shared), then every element's count. In
# one asm block per element (load, compare, atomic) ptxas kept each load behind the previous
# element's atomic (both touch shared memory), a chain of load latencies through the tile.
def _lane_thr_slot_ptx(shift: int) -> str:
    # $0: the address of this lane's histogram word for the exponent field in bits 7..14 of
    # $2 >> shift (16: float32 bits, or the high bf16 of a word; 0: the low bf16); $1: the
    # field's threshold word. $3: 4 * %laneid (_lane_col: read once, not in every copy of the
    # asm, which ptxas did not merge across the two-tile loop's branch). The sign bit falls
    # outside the mask; one lop3 masks the field and adds the lane's column (bits 2..6).
    src = "%t" if shift else "$2"
    return ("""{
    .reg .b32 %l, %t;""" + (f"""
    shr.u32 %t, $2, {shift};""" if shift else "") + f"""
    lop3.b32 $0, {src}, 0x7F80, $3, 0xEA;
    mov.u32 %l, sw_lane_hist;
    add.u32 $0, $0, %l;
    ld.shared.u32 $1, [$0+{THR_ROWS.value * 128}];
    }}""")


_THR_SLOT_LO = tl.constexpr(_lane_thr_slot_ptx(0))
_THR_SLOT_HI = tl.constexpr(_lane_thr_slot_ptx(16))
_LANE_HIST_ADD_AT = tl.constexpr("""{
    red.shared.add.u32 [$1], $2;
    mov.u32 $0, 0;
    }""")


def _lane_hist_count_ptx(shift: int) -> str:
    # One count: bin = $1 >> shift (0..255), word bin * 32 + lane, at table + bin * 128 + lane * 4
    # (the table's address in $2)
    return """{
    .reg .b32 %l;""" + _lane_base("$2") + f"""
    shr.u32 $0, $1, {shift};
    shl.b32 $0, $0, 7;
    add.u32 $0, $0, %l;
    red.shared.add.u32 [$0], 1;
    }}"""


_LANE_HIST_COUNT = tl.constexpr(_lane_hist_count_ptx(23))  # |x| bits: the exponent field
_LANE_HIST_COUNT_BYTE = tl.constexpr(_lane_hist_count_ptx(0))  # a byte: its value


def _lane_hist_read_ptx(split: bool) -> str:
    # bin $1's total over the 32 columns; lane L starts at column L so that the lanes of a warp
    # read 32 different banks at each step. split: two results ($0, $1, bin in $2), the totals
    # of the low and the high 16-bit halves apart (each half of a column is a count; their sums
    # over 32 columns can pass 65535)
    add = """
    and.b32 %w, %v, 65535;
    add.u32 $0, $0, %w;
    shr.u32 %w, %v, 16;
    add.u32 $1, $1, %w;""" if split else """
    add.u32 $0, $0, %v;"""
    step = """
    add.u32 %c, %l, {j};
    and.b32 %c, %c, 31;
    shl.b32 %c, %c, 2;
    add.u32 %c, %c, %a;
    ld.shared.u32 %v, [%c];""" + add
    return ("""{
    .reg .b32 %a, %c, %l, %v, %w;
    mov.u32 %l, %laneid;
    mov.u32 %a, sw_lane_hist;
    shl.b32 %c, """ + ("$2" if split else "$1") + """, 7;
    add.u32 %a, %a, %c;
    mov.u32 $0, 0;""" + ("""
    mov.u32 $1, 0;""" if split else "")
            + "".join(step.format(j=j) for j in range(32))
            + """
    }""")


_LANE_HIST_READ = tl.constexpr(_lane_hist_read_ptx(False))
_LANE_HIST_READ2 = tl.constexpr(_lane_hist_read_ptx(True))


@triton.jit
def _lane_hist_init_with(zero, ASM: tl.constexpr):
    # zero: a scalar (0); ASM: _LANE_HIST_INIT or an extension of it. Returns the table's
    # shared-memory address (the same in every thread)
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,r", args=[zero],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _lane_hist_init(zero):
    return _lane_hist_init_with(zero, _LANE_HIST_INIT)


@triton.jit
def _lane_hist_add(u, table, ASM: tl.constexpr):
    # one count per element of u by the PTX in ASM (a _LANE_HIST_COUNT*); table: the histogram's
    # address from the init. The result (the word's address) is not used.
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,r,r",
                                     args=[u, table + tl.zeros_like(u)], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _lane_col(zero):
    # 4 * %laneid, from a scalar 0
    return tl.inline_asm_elementwise(asm="mov.u32 $0, %laneid; shl.b32 $0, $0, 2;",
                                     constraints="=r,r", args=[zero], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _lane_thr_slot(bits, col, ASM: tl.constexpr):
    # (histogram word address, threshold word) per element of bits (_THR_SLOT_LO / _HI); col:
    # _lane_col. The table is found by name: tile_fast's init writes it, constant after that
    # barrier
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r,r",
                                     args=[bits, col + tl.zeros_like(bits)],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _thr_value(x, t):
    # the count to add for a value x (float32) whose field's table word is t: 1 | (|x| >= t) << 16
    # (the low half counts the values of the field, the high half those at or above its
    # threshold; |x| is an operand modifier of the compare, no instruction of its own). Packed
    # 16-bit counts: at most 65535 values per lane and program (stats_triton.tile_programs)
    return tl.where(tl.abs(x) >= t.to(tl.float32, bitcast=True), 65537, 1)


@triton.jit
def _lane_hist_add_at(addr, v):
    # adds v (int32) to the histogram words at addr (from _lane_thr_slot)
    return tl.inline_asm_elementwise(asm=_LANE_HIST_ADD_AT, constraints="=r,r,r",
                                     args=[addr, v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _lane_hist_read2(bins):
    # bins: tl.arange(0, 256); after a barrier that follows the last count. Returns (the low
    # halves' total, the high halves' total) per bin.
    return tl.inline_asm_elementwise(asm=_LANE_HIST_READ2, constraints="=r,=r,r", args=[bins],
                                     dtype=(tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _lane_hist_count(u, table):
    # u: |x| bit patterns; table: from _lane_hist_init
    return _lane_hist_add(u, table, _LANE_HIST_COUNT)


@triton.jit
def _lane_hist_count_byte(b, table):
    # b: byte values 0..255 (int32)
    return _lane_hist_add(b, table, _LANE_HIST_COUNT_BYTE)


@triton.jit
def _lane_hist_read(bins):
    # bins: tl.arange(0, 256); after a barrier that follows the last count
    return tl.inline_asm_elementwise(asm=_LANE_HIST_READ, constraints="=r,r", args=[bins],
                                     dtype=tl.int32, is_pure=False, pack=1)


# One thread of the program asks the copy engine to bring $2 bytes at address $1 (rounded down
# to 16 bytes) into L2; no registers wait for it. The tile loops issue it a few tiles ahead, so
# that their own loads find the bytes in L2: a program keeps one tile in registers, too little
# in flight to hide HBM's latency at the occupancy its registers allow.
_L2_PREFETCH = tl.constexpr("""{
    .reg .pred %p;
    .reg .b32 %t;
    .reg .b64 %a;
    mov.u32 %t, %tid.x;
    setp.eq.u32 %p, %t, 0;
    and.b64 %a, $1, -16;
    @%p cp.async.bulk.prefetch.L2.global [%a], $2;
    mov.u32 $0, 0;
    }""")


@triton.jit
def _l2_prefetch(ptr, nbytes):
    # ptr: a scalar pointer; nbytes: a multiple of 16
    return tl.inline_asm_elementwise(asm=_L2_PREFETCH, constraints="=r,l,r",
                                     args=[ptr.to(tl.int64), nbytes], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _halves_sum(w):
    # (w & 0xFFFF) + (w >> 16 & 0xFFFF) in one instruction: dp2a adds the two unsigned 16-bit
    # halves of w, each times 1 (bytes 0 and 1 of 257)
    return tl.inline_asm_elementwise(asm="dp2a.lo.u32.u32 $0, $1, 257, 0;", constraints="=r,r",
                                     args=[w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_min(a, b):
    # the two bf16 halves of a and b at once (one HMNMX2 where two FMNMX took the unpacked
    # values); also a tl.reduce combine function
    return tl.inline_asm_elementwise(asm="min.bf16x2 $0, $1, $2;", constraints="=r,r,r",
                                     args=[a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _s16x2_min(a, b):
    # the two signed 16-bit halves of a and b at once (sm_90: one VIMNMX.S16x2, or the
    # three-input VIMNMX3 that ptxas forms); also a tl.reduce combine function
    return tl.inline_asm_elementwise(asm="min.s16x2 $0, $1, $2;", constraints="=r,r,r",
                                     args=[a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_max(a, b):
    return tl.inline_asm_elementwise(asm="max.bf16x2 $0, $1, $2;", constraints="=r,r,r",
                                     args=[a, b], dtype=tl.int32, is_pure=True, pack=1)
