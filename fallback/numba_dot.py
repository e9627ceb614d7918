"""Exact integer sums of products for the numba CPU kernels, as intrinsics written in LLVM IR.

    int_dots(x, i, w, j, n_x, n_w, x_type)
                                         the n_x * n_w dot products Σ_k x[i + a, k] * w[j + b, k],
                                         at index a * n_w + b: int32 when x holds int8
                                         values, int64 when int16 ones
    int_weighted_rows(u, w, rows, out, n_u)
                                         out[a, d] += Σ_{p < n2} u[a, p] * w[rows[p], d]
                                         for a < n_u and d < D16

int_dots: x (N, K) int16 holding values of x_type, np.int8 (a row-scaled input, a query) or
np.int16 (block inputs, docs/spec.md §2.2.1; an array's dtype will do); w the weights of K inputs: a
(M, K) int8 or int16 matrix with |w| <= W_MAX, or int4 as the tuple (values (M, K) int8,
multipliers (M, ceil(K / LANES)) int16), one multiplier per LANES columns:
acc = Σ_k x_k (m_{k / LANES} w_k), that is docs/spec.md §3 when the group size is a multiple of
LANES.
int_weighted_rows: u (n_u, n) int16, w (M, D) int8, rows (n,) int64, out (n_u, D) int32, with
D16 = D - D % LANES and n2 = n - n % 2 (the caller adds the terms left out). All arrays are
C-contiguous; n_x, n_w and n_u are compile-time constants. Rows are not bounds-checked: the
caller keeps them inside the arrays.

Why intrinsics: LLVM vectorizes a numba loop with one int32 accumulator into pair products
(x86 vpmaddwd) at half width, a loop with several accumulators into 32-bit multiplies, and a
loop whose accumulators live in an array not well at all; yet a tile of accumulators held in
registers is what lets one load serve several products. Here each step takes LANES products
in int32, adds adjacent pairs, and accumulates 8 int32 lanes in a register: target-independent
IR that x86 lowers to vpmaddwd. Every product and sum is an exact integer wherever it runs.
For int8 values the caller bounds the sums to int32 (docs/spec.md §3 for the linears, whose
every partial sum is bounded by the sum of |terms|; attention splits its weights, see
numba_cpu). Sums of int16 values may exceed that: their lanes restart every WIDE_CHUNK
columns, where a lane holds at most WIDE_CHUNK / LANES * 2 * 32768 * W_MAX < 2**31, and each
chunk's lanes are added to int64 lanes. No float operation is involved. int_dots prefetches
weight rows PREFETCH_BYTES ahead: a one-token matmul streams its weights from memory once.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16                    # columns per step: 16 products, 8 pair sums
PREFETCH_BYTES = 2048         # how far ahead of the current column weight rows are prefetched
W_MAX = 255 * 8               # the largest |w| of any weights: int8, or int4 times its multiplier
WIDE_CHUNK = 16 * LANES       # int16 values: columns per int32 lane sum
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
PAIR_SUMS = ir.VectorType(I32, LANES // 2)
ZERO_SUMS = ir.Constant(PAIR_SUMS, None)
WIDE_SUMS = ir.VectorType(I64, LANES // 4)    # half of PAIR_SUMS' lanes: 256 bits, as they are
HALVES = [ir.Constant(ir.VectorType(I32, LANES // 4), list(range(h, h + LANES // 4)))
          for h in (0, LANES // 4)]


def _constant(value):
    return ir.Constant(I64, value)


def _pair_products(builder, x, w):
    """x, w: <LANES x i16> -> <LANES/2 x i32> with lane i = x[2i] w[2i] + x[2i+1] w[2i+1]."""
    wide = ir.VectorType(I32, LANES)
    p = builder.mul(builder.sext(x, wide), builder.sext(w, wide))
    even = ir.Constant(PAIR_SUMS, list(range(0, LANES, 2)))
    odd = ir.Constant(PAIR_SUMS, list(range(1, LANES, 2)))
    return builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))


def _load_lanes(builder, address, n, bits):
    """<n x i16> from n consecutive int8 or int16 values at `address` (widened if int8)."""
    vector = ir.VectorType(ir.IntType(bits), n)
    v = builder.load(builder.bitcast(address, vector.as_pointer()), align=bits // 8)
    return v if bits == 16 else builder.sext(v, ir.VectorType(I16, n))


def _prefetch(builder, address):
    """Hint a read of `address` + PREFETCH_BYTES (a hint: never faults, whatever the address)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
    at = builder.gep(builder.bitcast(address, i8p), [_constant(PREFETCH_BYTES)])
    builder.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _loop(builder, start, end, step, carried, body):
    """for i in range(start, end, step), carrying values: body(i, values) -> new values.
    Returns the values after the loop (`carried` itself when it runs no iteration)."""
    entry = builder.block
    head = builder.append_basic_block("loop.body")
    done = builder.append_basic_block("loop.done")
    builder.cbranch(builder.icmp_signed("<", start, end), head, done)
    builder.position_at_end(head)
    i = builder.phi(I64)
    phis = [builder.phi(v.type) for v in carried]
    new = body(i, phis)
    latch = builder.block
    i_next = builder.add(i, step)
    builder.cbranch(builder.icmp_signed("<", i_next, end), head, done)
    i.add_incoming(start, entry)
    i.add_incoming(i_next, latch)
    builder.position_at_end(done)
    finals = []
    for phi, before, after in zip(phis, carried, new):
        phi.add_incoming(before, entry)
        phi.add_incoming(after, latch)
        final = builder.phi(before.type)
        final.add_incoming(before, entry)
        final.add_incoming(after, latch)
        finals.append(final)
    return finals


def _is_array(ty, ndim, dtypes):
    return (isinstance(ty, types.Array) and ty.ndim == ndim and ty.layout == "C"
            and ty.dtype in dtypes)


def _rows(builder, data, first, n, n_cols):
    """Pointers to rows first .. first + n - 1 of a row-major matrix with n_cols columns."""
    return [builder.gep(data, [builder.mul(builder.add(first, _constant(r)), n_cols)])
            for r in range(n)]


class _Matrix:
    """Rows first .. first + n - 1 of an int8 or int16 (., n_cols) matrix: LANES columns
    from k as <LANES x i16>, or column k as i32."""

    def __init__(self, builder, array, first, n):
        self.builder = builder
        self.bits = array.data.type.pointee.width
        self.rows = _rows(builder, array.data, first, n, builder.extract_value(array.shape, 1))

    def lanes(self, r, k):
        return _load_lanes(self.builder, self.builder.gep(self.rows[r], [k]), LANES, self.bits)

    def element(self, r, k):
        return self.builder.sext(self.builder.load(self.builder.gep(self.rows[r], [k])), I32)

    def prefetch(self, r, k):
        _prefetch(self.builder, self.builder.gep(self.rows[r], [k]))


class _Grouped:
    """Rows first .. first + n - 1 of int4 weights: their values (an int8 matrix) and an
    int16 multiplier per LANES columns, applied as the columns are read (|m w| <= 2040)."""

    def __init__(self, builder, values, multipliers, first, n):
        self.builder = builder
        self.values = _Matrix(builder, values, first, n)
        self.multipliers = _Matrix(builder, multipliers, first, n)
        self.rows = self.values.rows

    def _multiplier_index(self, k):
        return self.builder.udiv(k, _constant(LANES))       # a shift

    def lanes(self, r, k):
        b = self.builder
        m = b.load(b.gep(self.multipliers.rows[r], [self._multiplier_index(k)]))
        m = b.shuffle_vector(b.insert_element(ir.Constant(ir.VectorType(I16, LANES), None), m,
                                              ir.Constant(I32, 0)),
                             ir.Constant(ir.VectorType(I16, LANES), None),
                             ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))
        return b.mul(self.values.lanes(r, k), m)

    def element(self, r, k):
        return self.builder.mul(self.values.element(r, k),
                                self.multipliers.element(r, self._multiplier_index(k)))

    def prefetch(self, r, k):
        self.values.prefetch(r, k)


def _products_loop(builder, xs, ws, start, end, accs):
    """accs[a * n_w + b] + the pair products of x row a and weight row b over k in
    [start, end), LANES at a time."""
    n_x, n_w = len(xs.rows), len(ws.rows)

    def step(k, accs):
        for b in range(n_w):
            ws.prefetch(b, k)
        x_lanes = [xs.lanes(a, k) for a in range(n_x)]
        w_lanes = [ws.lanes(b, k) for b in range(n_w)]
        return [builder.add(accs[a * n_w + b], _pair_products(builder, x_lanes[a], w_lanes[b]))
                for a in range(n_x) for b in range(n_w)]
    return _loop(builder, start, end, _constant(LANES), accs, step)


def _wide_products_loop(builder, xs, ws, end, n_accs):
    """The pair products over k in [0, end) as int64 lanes: _products_loop's int32 lanes over
    WIDE_CHUNK columns at a time, each chunk's added to two halves of int64 lanes (256-bit
    vectors: on x86, 512-bit ones would slow every vector instruction around them)."""
    def chunk(k, totals):
        chunk_end = builder.add(k, _constant(WIDE_CHUNK))
        chunk_end = builder.select(builder.icmp_signed("<", chunk_end, end), chunk_end, end)
        sums = _products_loop(builder, xs, ws, k, chunk_end, [ZERO_SUMS] * n_accs)
        return [builder.add(totals[2 * n + h],
                            builder.sext(builder.shuffle_vector(part, part, half), WIDE_SUMS))
                for n, part in enumerate(sums) for h, half in enumerate(HALVES)]
    totals = _loop(builder, _constant(0), end, _constant(WIDE_CHUNK),
                   [ir.Constant(WIDE_SUMS, None)] * (2 * n_accs), chunk)
    return [builder.add(totals[2 * n], totals[2 * n + 1]) for n in range(n_accs)]


def _dots(builder, xs, ws, n_cols, acc_type):
    """The exact dot products of every (x row, weight row) pair, as acc_type (i32, or i64 in
    chunks for int16 values): LANES columns at a time, then the last n_cols % LANES one by one
    (fewer than LANES terms: their int32 sum is below 2**31 for any int16 x)."""
    n_x, n_w = len(xs.rows), len(ws.rows)
    k_end = builder.and_(n_cols, _constant(-LANES))
    if acc_type == I32:
        accs = _products_loop(builder, xs, ws, _constant(0), k_end, [ZERO_SUMS] * (n_x * n_w))
    else:
        accs = _wide_products_loop(builder, xs, ws, k_end, n_x * n_w)

    def add_column(k, sums):
        return [builder.add(sums[a * n_w + b], builder.mul(xs.element(a, k), ws.element(b, k)))
                for a in range(n_x) for b in range(n_w)]
    tails = _loop(builder, k_end, n_cols, _constant(1), [ir.Constant(I32, 0)] * (n_x * n_w),
                  add_column)
    lanes = accs[0].type
    reduce_add = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(acc_type, [lanes]),
        f"llvm.vector.reduce.add.v{lanes.count}i{acc_type.width}")
    return [builder.add(builder.call(reduce_add, [acc]),
                        tail if acc_type == I32 else builder.sext(tail, acc_type))
            for acc, tail in zip(accs, tails)]


def _is_grouped(w):
    return (isinstance(w, types.BaseTuple) and len(w) == 2
            and _is_array(w[0], 2, (types.int8,)) and _is_array(w[1], 2, (types.int16,)))


def _named_type(x_type):
    """The integer type x_type names: np.int8 in compiled code, or an array's dtype."""
    if isinstance(x_type, types.NumberClass):
        return x_type.instance_type
    return x_type.dtype if isinstance(x_type, types.DType) else None


@intrinsic
def int_dots(typingctx, x, i, w, j, n_x, n_w, x_type):
    if not (isinstance(n_x, types.IntegerLiteral) and isinstance(n_w, types.IntegerLiteral)):
        return None                  # numba retries with the constants as literals
    if not (_is_array(x, 2, (types.int16,)) and _named_type(x_type) in (types.int8, types.int16)
            and (_is_array(w, 2, (types.int8, types.int16)) or _is_grouped(w))):
        return None
    tile_x, tile_w = n_x.literal_value, n_w.literal_value
    acc_type = types.int64 if _named_type(x_type) == types.int16 else types.int32

    def codegen(context, builder, sig, args):
        def array(ty, value):
            return context.make_array(ty)(context, builder, value)

        def first(n):
            return context.cast(builder, args[n], sig.args[n], types.int64)
        xa = array(sig.args[0], args[0])
        xs = _Matrix(builder, xa, first(1), tile_x)
        if _is_grouped(sig.args[2]):
            values, multipliers = (array(ty, builder.extract_value(args[2], n))
                                   for n, ty in enumerate(sig.args[2]))
            ws = _Grouped(builder, values, multipliers, first(3), tile_w)
        else:
            ws = _Matrix(builder, array(sig.args[2], args[2]), first(3), tile_w)
        dots = _dots(builder, xs, ws, builder.extract_value(xa.shape, 1),
                     ir.IntType(acc_type.bitwidth))
        return context.make_tuple(builder, sig.return_type, dots)
    return types.UniTuple(acc_type, tile_x * tile_w)(x, i, w, j, n_x, n_w, x_type), codegen


INTERLEAVE = [ir.Constant(ir.VectorType(I32, LANES),                # two vectors' lanes by
                          [v for lane in range(half, half + LANES // 2)  # halves, alternately
                           for v in (lane, lane + LANES)])
              for half in (0, LANES // 2)]
REPEAT_PAIR = ir.Constant(ir.VectorType(I32, LANES), [0, 1] * (LANES // 2))


@intrinsic
def int_weighted_rows(typingctx, u, w, rows, out, n_u):
    if not isinstance(n_u, types.IntegerLiteral):
        return None                  # numba retries with the constant as a literal
    if not (_is_array(u, 2, (types.int16,)) and _is_array(w, 2, (types.int8,))
            and _is_array(rows, 1, (types.int64,)) and _is_array(out, 2, (types.int32,))):
        return None
    n_weights = n_u.literal_value

    def codegen(context, builder, sig, args):
        ua, wa, ra, oa = (context.make_array(sig.args[n])(context, builder, args[n])
                          for n in range(4))
        n_keys = builder.extract_value(ua.shape, 1)
        n_cols = builder.extract_value(wa.shape, 1)
        u_rows = _rows(builder, ua.data, _constant(0), n_weights, n_keys)
        out_rows = _rows(builder, oa.data, _constant(0), n_weights, n_cols)

        def pair(d, p, accs):
            """Two weight rows' LANES columns from d, interleaved, times each u's pair."""
            r0, r1 = (builder.load(builder.gep(ra.data, [builder.add(p, _constant(b))]))
                      for b in (0, 1))
            v0, v1 = (_load_lanes(builder, builder.gep(wa.data, [
                builder.add(builder.mul(r, n_cols), d)]), LANES, 8) for r in (r0, r1))
            halves = [builder.shuffle_vector(v0, v1, order) for order in INTERLEAVE]
            new = []
            for a, row in enumerate(u_rows):
                both = _load_lanes(builder, builder.gep(row, [p]), 2, 16)
                both = builder.shuffle_vector(both, both, REPEAT_PAIR)
                new += [builder.add(accs[2 * a + h], _pair_products(builder, halves[h], both))
                        for h in (0, 1)]
            return new

        def columns(d, _):
            n_paired = builder.and_(n_keys, _constant(-2))
            accs = _loop(builder, _constant(0), n_paired, _constant(2),
                         [ZERO_SUMS] * (2 * n_weights), lambda p, accs: pair(d, p, accs))
            for a, row in enumerate(out_rows):
                for h in (0, 1):
                    at = builder.gep(row, [builder.add(d, _constant(h * LANES // 2))])
                    at = builder.bitcast(at, PAIR_SUMS.as_pointer())
                    total = builder.add(builder.load(at, align=4), accs[2 * a + h])
                    builder.store(total, at, align=4)
            return []
        _loop(builder, _constant(0), builder.and_(n_cols, _constant(-LANES)), _constant(LANES),
              [], columns)
        return context.get_dummy_value()
    return types.none(u, w, rows, out, n_u), codegen

